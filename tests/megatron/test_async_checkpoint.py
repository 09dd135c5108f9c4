"""Checkpoints written in the background (Trainer.save(background=True), Megatron-Core's asynchronous save through
a forked writer per rank): the state saved is the one at the call, even as training changes the weights meanwhile; a
checkpoint counts only once completed on every rank, so a job killed before resumes from the previous one; a write
that fails on one rank is an error on every rank. Real tiny Megatron models on gloo, one process and two ranks."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from megatron_launch import read_json, run_worker, worker_command, worker_env

from spade_mega.megatron import find_latest
from spade_mega.megatron.checkpoint import is_complete, read_manifest
from spade_mega.selfplay.lock import RunDirInUseError, RunDirLock

WORKER = Path(__file__).with_name("async_save_worker.py")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two expert-parallel ranks (each rank's forked writer writes shards of its own): a background save against a
    foreground one, then a background write that fails on rank 0."""
    out = tmp_path_factory.mktemp("async_save")
    run_worker(2, "equal", out, "--fail-rank", "0", "parallel.expert=2", worker=WORKER)
    return out


@pytest.mark.multiproc
def test_a_background_save_holds_the_state_of_its_call_and_resumes_as_a_foreground_one(two_ranks: Path) -> None:
    for rank in (0, 1):
        result = read_json(two_ranks / f"equal_rank{rank}.json")
        assert not result["visible_while_pending"] and result["complete"]
        assert result["write_s"] is not None and result["write_s"] >= 0
        assert not result["written_before_step_2"]  # the write came after step 2 changed the weights
        assert result["sync_weights_as_saved"] and result["async_weights_as_saved"]  # not step 2's weights
        assert result["sync_step"]["loss"] == result["async_step"]["loss"]
        assert result["sync_step"]["grad_norm"] == result["async_step"]["grad_norm"]
        assert torch.equal(torch.load(two_ranks / f"sync_logits_rank{rank}.pt"),
                           torch.load(two_ranks / f"async_logits_rank{rank}.pt"))
        # the second save completed the first before it began
        assert result["chain_first_complete_before_finish"] == ["step_00000002"]
    # the non-blocking check: the same answer on both ranks at every check, "still writing" while rank 1's writer
    # stalled though rank 0's had written its files, then complete (the write's seconds) on both
    polls = [read_json(two_ranks / f"equal_rank{rank}.json")["polls"] for rank in (0, 1)]
    assert [p is None for p in polls[0]] == [p is None for p in polls[1]]
    assert len(polls[0]) >= 2 and polls[0][0] is None and polls[0][-1] is not None and polls[0][-1] == polls[1][-1]
    assert is_complete(two_ranks / "poll" / "step_00000003")
    assert sorted(p.name for p in (two_ranks / "chain").iterdir()) == ["step_00000002", "step_00000003"]
    assert sorted(p.name for p in (two_ranks / "async").iterdir()) == ["step_00000001"]
    assert not list((two_ranks / "async" / "step_00000001").glob(".write_results*"))
    assert read_manifest(two_ranks / "async" / "step_00000001")["step"] == 1


@pytest.mark.multiproc
def test_a_background_write_that_fails_on_one_rank_is_an_error_on_every_rank(two_ranks: Path) -> None:
    errors = [read_json(two_ranks / f"fail_rank{rank}.json") for rank in (0, 1)]
    assert errors[0] == errors[1]  # rank 1 names rank 0's failure too
    assert not errors[0]["pending"]
    message = errors[0]["error"]
    assert message.startswith(f"{two_ranks / 'ckpt' / 'step_00000003'}: the background write of this checkpoint "
                              "failed (rank 0: ") and "OSError" in message and "previous checkpoint stays" in message
    assert find_latest(two_ranks / "ckpt") is None
    # a writer that cannot be forked on rank 1 (rank 0's was): the save's error on both ranks, which train on together
    refused = [read_json(two_ranks / f"refused_rank{rank}.json") for rank in (0, 1)]
    assert refused[0] == refused[1] and not refused[0]["pending"]
    assert refused[0]["error"].startswith(f"{two_ranks / 'refused'}: cannot save a checkpoint there (OSError: "), \
        refused[0]["error"]
    assert "rank 1's background writer did not start" in refused[0]["error"]
    assert find_latest(two_ranks / "refused") is None and not list((two_ranks / "refused").glob(".step_*"))


def test_a_job_killed_before_its_background_save_completed_resumes_from_the_previous_checkpoint(
        tmp_path: Path) -> None:
    proc = subprocess.Popen(worker_command(1, "killpending", tmp_path, worker=WORKER), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=worker_env(), start_new_session=True)
    root = tmp_path / "ckpt"
    try:
        assert proc.stdout is not None
        assert any(line.startswith("PENDING") for line in proc.stdout)
        deadline = time.monotonic() + 60  # its files all written: only the completion is missing
        while time.monotonic() < deadline and not list(root.glob(".step_00000002.partial-*/.write_results.rank0")):
            time.sleep(0.05)
        partial = list(root.glob(".step_00000002.partial-*"))
        assert len(partial) == 1 and list(partial[0].glob(".write_results.rank0"))
        assert find_latest(root) == root / "step_00000001"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert find_latest(root) == root / "step_00000001" and not is_complete(partial[0])
    resumed = subprocess.run(worker_command(1, "killpending", tmp_path, worker=WORKER), capture_output=True,
                             text=True, env=worker_env(), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "RESUMED 1" in resumed.stdout
    before, after = torch.load(tmp_path / "step1_weights.pt"), torch.load(tmp_path / "resumed_weights.pt")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]  # its save removed the partial folder


def test_a_background_writer_dies_with_its_trainer_and_frees_the_run_directory(tmp_path: Path) -> None:
    """The writer is a fork of the trainer: it holds the trainer's descriptors, the run directory's lock among them.
    A trainer killed alone (kill -9, the OOM killer) cannot complete the checkpoint, so the writer goes with it, and a
    restarted run takes the run directory at once, not when (if ever) a stalled write ends."""
    proc = subprocess.Popen(worker_command(1, "orphan", tmp_path, worker=WORKER), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=worker_env(), start_new_session=True)
    try:
        assert proc.stdout is not None
        pending = next(line for line in proc.stdout if line.startswith("PENDING")).split()
        assert len(pending) == 2  # one writer
        with pytest.raises(RunDirInUseError):
            RunDirLock(tmp_path / "run")
        os.kill(proc.pid, signal.SIGKILL)  # the trainer alone: its writer stalls in a write for 600 s
        proc.wait()
        deadline, lock = time.monotonic() + 30, None
        while lock is None:
            try:
                lock = RunDirLock(tmp_path / "run")
            except RunDirInUseError:
                assert time.monotonic() < deadline, "the dead trainer's writer still holds the run directory's lock"
                time.sleep(0.1)
        lock.close()
    finally:
        with contextlib.suppress(ProcessLookupError):  # the writer too, had it outlived the trainer
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert find_latest(tmp_path / "ckpt") is None


def test_the_write_duration_is_timed_by_the_writers_clock_not_the_file_systems(tmp_path: Path) -> None:
    """time/checkpoint_write_s: when the forked writer reported its results, by its own clock. A network file system
    stamps a file's modification time by the server's clock, which may be far from the trainer's."""
    import multiprocessing

    from spade_mega.megatron.checkpoint import _ResultsFile

    results = _ResultsFile(tmp_path / ".write_results.rank0")
    writer = multiprocessing.get_context("fork").Process(target=results.put, args=({0: ["written"]},))
    began = time.time()
    writer.start()
    writer.join()
    ended = time.time()
    os.utime(results.path, (began + 3600, began + 3600))  # a file server whose clock is an hour ahead
    assert results.get_nowait() == {0: ["written"]}
    assert results.finished_at is not None and began <= results.finished_at <= ended
    assert not results.path.exists()
