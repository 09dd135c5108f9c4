"""selfplay.async_save: the loop's periodic checkpoints written in the background. The real loop (agent-only, the
tiny Megatron model on gloo, environment programs in sandbox workers): the same run with and without it logs the same
metrics and ends with the same checkpoint, tensor for tensor; the write's duration is logged when a save completes;
keep_checkpoints and the loop states count completed saves only; a run that fails while a save is being written leaves
it incomplete (its writer stopped, its files removed) and the previous checkpoint the newest; a save that fails (a full
disk) stops the run with an error saying how to go on, its data kept."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch
from sandbox_support import strict_missing

from spade_mega.config.loader import load_config
from spade_mega.selfplay.loop import SelfPlay
from spade_mega.selfplay.state import CheckpointStore

ROOT = Path(__file__).resolve().parents[1]
TIMING = ("time", "time/", "perf/", "train/tokens_per_s", "train/step_time_s", "gpu/")


def _config(tmp_path: Path, name: str, *extra: str):
    isolation = [] if strict_missing() is None else ["sandbox.isolation=best-effort"]
    return load_config(ROOT / "examples" / "configs" / "tiny_learn.yaml", [
        f"run.output_dir={tmp_path}", f"run.name={name}", "logging.progress=false", "logging.tensorboard=false",
        *isolation, "rollout.agent_trajectories_per_env=4", "selfplay.global_batch_size=4", "selfplay.num_rollouts=4",
        "selfplay.save_interval=2", "selfplay.keep_checkpoints=1",
        f"selfplay.environments=[{{path: {ROOT / 'examples' / 'envs' / 'first_char.py'}, hint: h, skill: logic}}]",
        *extra])


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _tensors(checkpoint: Path, out: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("async_save")
    for name, on in (("sync", "false"), ("async", "true")):
        SelfPlay(_config(base, name, f"selfplay.async_save={on}")).run()
    return {name: base / name for name in ("sync", "async")}


@pytest.mark.slow
def test_a_run_saving_in_the_background_trains_and_saves_as_one_saving_in_the_foreground(
        runs: dict[str, Path], tmp_path: Path) -> None:
    sync, background = _records(runs["sync"]), _records(runs["async"])
    assert sorted(background) == [1, 2, 3, 4]

    def untimed(record: dict) -> dict:
        return {k: v for k, v in record.items() if not k.startswith(TIMING)}

    assert all(untimed(sync[r]) == untimed(background[r]) for r in (1, 2, 3, 4))
    assert [r for r in (1, 2, 3, 4) if "time/checkpoint_s" in background[r]] == [2, 4]
    # rollout 2's save completes after rollout 3 (written by then: its write takes well under a rollout here) or, at
    # the latest, at rollout 4's save, which waits for it; rollout 4's, the last, is written before the run ends
    assert [r for r in (1, 2, 3, 4) if "time/checkpoint_write_s" in background[r]] in ([3], [4])
    assert not any("time/checkpoint_write_s" in record for record in sync.values())
    stores = [CheckpointStore(runs[name]) for name in ("sync", "async")]
    for store in stores:  # keep_checkpoints 1, and the loop state of that checkpoint only
        assert sorted(p.name for p in store.root.iterdir()) == ["selfplay", "step_00000004"]
        assert sorted(p.name for p in store.states.iterdir()) == ["step_00000004.json"]
    assert stores[0].read_state(stores[0].latest()) == stores[1].read_state(stores[1].latest())
    saved = [_tensors(store.latest(), tmp_path / f"{i}.pt") for i, store in enumerate(stores)]
    assert saved[0].keys() == saved[1].keys() and any(k.startswith("optimizer.state.exp_avg") for k in saved[0])
    for key, value in saved[0].items():
        assert torch.equal(value, saved[1][key]) if isinstance(value, torch.Tensor) else value == saved[1][key], key


class _Failed(Exception):
    """A failure of the rollout after a background save began (an engine lost, a bug)."""


@pytest.mark.slow
def test_a_run_failing_while_its_save_is_written_leaves_it_incomplete_and_the_previous_one_newest(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    train = SelfPlay._train

    def fails_at_rollout_3(self: SelfPlay, trainer, samples, r):  # type: ignore[no-untyped-def]
        if r == 3:
            raise _Failed("rollout 3 failed")
        return train(self, trainer, samples, r)

    cfg = _config(tmp_path, "failed", "selfplay.async_save=true", "selfplay.save_interval=1")
    with pytest.MonkeyPatch.context() as patch, caplog.at_level(logging.WARNING, logger="spade_mega.megatron"):
        patch.setattr(SelfPlay, "_train", fails_at_rollout_3)
        with pytest.raises(_Failed):
            SelfPlay(cfg).run()
    run_dir = tmp_path / "failed"
    # rollout 2's save waited for rollout 1's (completed: the newest), then was being written when rollout 3 failed
    assert [r for r, record in _records(run_dir).items() if "time/checkpoint_write_s" in record] == [2]
    store = CheckpointStore(run_dir)
    assert store.latest() == store.root / "step_00000001" and store.read_state(store.latest()).rollout == 1
    # its writer was stopped rather than waited for, and its files removed: it could never be completed
    assert not list(store.root.glob(".step_00000002*")) and not (store.root / "step_00000002").exists()
    assert any(f"{store.root / 'step_00000002'}: not completed" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_a_run_stopped_by_sigusr1_while_its_save_is_written_completes_it_and_saves_the_stop_in_the_foreground(
        tmp_path: Path) -> None:
    train = SelfPlay._train

    def stop_asked_in_rollout_3(self: SelfPlay, trainer, samples, r):  # type: ignore[no-untyped-def]
        if r == 3:  # SLURM's time-limit warning, while rollout 2's save is written in the background
            os.kill(os.getpid(), signal.SIGUSR1)
        return train(self, trainer, samples, r)

    cfg = _config(tmp_path, "stopped", "selfplay.async_save=true", "selfplay.save_interval=1")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SelfPlay, "_train", stop_asked_in_rollout_3)
        summary = SelfPlay(cfg).run()
    assert summary.stopped and summary.rollouts == 3
    run_dir = tmp_path / "stopped"
    # each save waited for the one before; the stop's for rollout 2's, then its own was written before the run ended
    assert [r for r, record in _records(run_dir).items() if "time/checkpoint_write_s" in record] == [2, 3]
    store = CheckpointStore(run_dir)
    assert store.read_state(store.latest()).rollout == 3
    assert sorted(p.name for p in store.root.iterdir()) == ["selfplay", store.latest().name]  # no partial folder
    assert sorted(p.name for p in store.states.iterdir()) == [f"{store.latest().name}.json"]


@pytest.mark.slow
@pytest.mark.parametrize("left", [8192, 0], ids=["checkpoint", "loop_state"])
def test_a_run_whose_save_fails_on_a_full_disk_stops_keeping_its_data_and_says_how_to_go_on(tmp_path: Path,
                                                                                            left: int) -> None:
    """The checkpoints on a small tmpfs that fills during rollout 2 (``left`` bytes free): its save fails (the loop
    state or the checkpoint, for real; with nothing left, the loop state: the first file of the save), the run stops
    with an error naming the folder, the free space it needs and the checkpoint a rerun resumes from; rollout 2's
    metrics are logged, the transcripts stay, the first checkpoint is untouched."""
    import subprocess

    from spade_mega.megatron.checkpoint import CheckpointError
    from spade_mega.monitor.transcripts import rollouts_written

    run_dir = tmp_path / "full"
    disk = CheckpointStore(run_dir).root
    disk.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "spade-test", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a tmpfs cannot be mounted here (needs CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    train = SelfPlay._train

    def disk_fills_in_rollout_2(self: SelfPlay, trainer, samples, r):  # type: ignore[no-untyped-def]
        if r == 2:  # something else on the disk takes all of its space but a few KiB
            with open(disk / "filler", "wb") as f:
                stat = os.statvfs(disk)
                f.write(b"\0" * (stat.f_bavail * stat.f_frsize - left))
        return train(self, trainer, samples, r)

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(SelfPlay, "_train", disk_fills_in_rollout_2)
            with pytest.raises(CheckpointError) as failed:
                SelfPlay(_config(tmp_path, "full", "selfplay.save_interval=1")).run()
        store = CheckpointStore(run_dir)
        first = store.latest()
        assert first is not None and store.read_state(first).rollout == 1
        message = str(failed.value)
        assert "No space left on device" in message, message
        if left == 0:
            assert message.startswith(f"{store.states}: cannot write the loop state of this checkpoint ([Errno 28] No "
                                      "space left on device"), message
        assert f"The run stopped after rollout 2; its metrics and transcripts so far stay in {run_dir}. Free space " \
               f"on {disk} (or make it writable) and run the same command again: it resumes from {first.name}" \
               in message, message
        assert sorted(_records(run_dir)) == [1, 2]
        assert rollouts_written(run_dir) == [1, 2]
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "selfplay", first.name]  # no partial folder
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)
