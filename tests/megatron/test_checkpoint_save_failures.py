"""A checkpoint save that fails on one rank fails on every rank alike: no rank waits in a collective for a peer that
raised (until the collective timeout), every rank raises the same CheckpointError naming the failing rank and its
error, the failed save leaves no checkpoint that looks complete, and the earlier checkpoints stay as they were. A full
disk and a read-only folder for real (a small tmpfs in the workers' own mount namespace), on two gloo ranks."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from megatron_launch import read_json, worker_command, worker_env

WORKER = Path(__file__).with_name("save_failure_worker.py")


def _private_tmpfs(disk: Path) -> list[str] | None:
    """The command prefix that runs a command with a 48 MiB tmpfs on ``disk``, in a mount namespace of its own (gone
    with its processes, never seen outside); None where mounting is not allowed (needs CAP_SYS_ADMIN)."""
    prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
              'mount -t tmpfs -o size=48m spade-test "$0" && exec "$@"', str(disk)]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, text=True)
    except OSError:  # no unshare (util-linux) here
        return None
    return prefix if probe.returncode == 0 else None


@pytest.fixture(scope="module")
def failures(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """Where no tmpfs can be mounted, the phases that need none still run (--no-mount: a plain folder, rank 0's
    completion failing on a file-size limit instead of a full disk); the full-disk and read-only ones are skipped."""
    out = tmp_path_factory.mktemp("save_failures")
    disk = out / "disk"
    disk.mkdir()
    tmpfs = _private_tmpfs(disk)
    worker = worker_command(2, "failures", out, "--disk", str(disk), "parallel.expert=2",
                            "parallel.collective_timeout_min=1", *([] if tmpfs else ["--no-mount"]), worker=WORKER)
    command = [*tmpfs, *worker] if tmpfs else worker
    # a rank left waiting for a failed peer would wait out the collective timeout (1 min here) and fail the job
    proc = subprocess.run(command, capture_output=True, text=True, env=worker_env(), timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return disk, [read_json(out / f"failures_rank{rank}.json") for rank in (0, 1)]


def _same_on_both(results: list[dict], phase: str) -> str:
    assert results[0][phase] is not None, f"{phase}: no error"
    assert results[0][phase] == results[1][phase], phase  # rank 1 names rank 0's failure and vice versa
    return results[0][phase]


@pytest.mark.multiproc
def test_the_checkpoint_spade_mega_completes_is_the_one_megatron_completes(failures) -> None:
    """spade-mega completes a save in Megatron-Core's stead (checkpoint._SaveFiles): the same data files and
    metadata.json byte for byte as Megatron's own save of the same state on the same two ranks, and torch's .metadata
    with the same entries (each rank's write results merged), so Megatron and torch read it as their own."""
    _, results = failures
    assert results[0]["as_megatron_saves"] == {"files": True, "metadata": True, "two_ranks_written": True}


@pytest.mark.multiproc
def test_a_checkpoint_that_cannot_be_renamed_into_place_leaves_the_one_it_replaced(failures) -> None:
    disk, results = failures
    error = _same_on_both(results, "replace")
    assert error.startswith(f"{disk / 'step_00000001'}: the completion of this checkpoint failed (rank 0: OSError: "
                            f"[Errno 30] Read-only file system: '{disk}/.step_00000001.partial-"), error
    assert "its partial folder was removed), the previous checkpoint stays the newest" in error
    # the same step saved before was set aside for its replacement: back in place, every file as it was
    assert results[0]["replace_listing"] == ["step_00000001"]
    assert results[0]["replace_first_files"] == results[0]["first_files"]


@pytest.mark.multiproc
def test_a_rank_that_cannot_stage_its_tensors_fails_the_save_on_every_rank(failures) -> None:
    disk, results = failures
    error = _same_on_both(results, "staging")
    assert error == (f"{disk / 'step_00000001'}: preparing this checkpoint's files failed (rank 1: MemoryError: host "
                     "memory exhausted); nothing was written, no earlier checkpoint was removed"), error
    assert results[0]["staging_listing"] == ["step_00000001"]


@pytest.mark.multiproc
def test_a_full_disk_fails_the_save_on_every_rank_and_removes_its_partial_folder(failures) -> None:
    disk, results = failures
    if "full" not in results[0]:
        pytest.skip("no tmpfs can be mounted here (needs CAP_SYS_ADMIN)")
    error = _same_on_both(results, "full")
    assert error.startswith(f"{disk / 'step_00000002'}: the write of this checkpoint failed (rank "), error
    assert "OSError: [Errno 28] No space left on device" in error
    assert results[0]["full_listing"] == ["filler", "step_00000001"]


@pytest.mark.multiproc
def test_a_completion_that_fails_on_rank_0_fails_the_save_on_every_rank(failures) -> None:
    """Rank 0 alone writes torch's .metadata: on a full disk (the tmpfs), else past a file-size limit of its own."""
    disk, results = failures
    error = _same_on_both(results, "full_end")
    failure = "[Errno 28] No space left on device" if "full" in results[0] else "[Errno 27] File too large"
    assert error.startswith(f"{disk / 'step_00000002'}: the completion of this checkpoint failed (rank 0: OSError: "
                            f"{failure}"), error
    assert results[0]["full_end_listing"] == (["filler"] if "full" in results[0] else []) + ["step_00000001"]


@pytest.mark.multiproc
def test_a_read_only_folder_fails_the_save_on_every_rank(failures) -> None:
    disk, results = failures
    if "ro_end" not in results[0]:
        pytest.skip("no tmpfs can be mounted here (needs CAP_SYS_ADMIN)")
    error = _same_on_both(results, "ro_end")
    assert error.startswith(f"{disk / 'step_00000002'}: the completion of this checkpoint failed (rank 0: OSError: "
                            "[Errno 30] Read-only file system"), error
    assert "its files are left in the hidden folder .step_00000002.partial-" in error  # a read-only folder keeps them
    error = _same_on_both(results, "ro_start")
    assert error.startswith(f"{disk}: cannot save a checkpoint there (OSError: [Errno 30] Read-only file system"), error
    listing = results[0]["ro_listing"]
    assert len(listing) == 2 and listing[0].startswith(".step_00000002.partial-") and listing[1] == "step_00000001"


@pytest.mark.multiproc
def test_a_background_writer_killed_by_a_signal_is_named_on_every_rank(failures) -> None:
    disk, results = failures
    error = _same_on_both(results, "killed")
    assert error.startswith(f"{disk / 'step_00000002'}: the background write of this checkpoint failed (rank 1: its "
                            "background writer (pid "), error
    assert "was killed by SIGKILL: the kernel's OOM killer, unless someone sent it" in error
    assert all(result["killed_s"] < 30 for result in results)  # not rank 1's stalled 60 s, nor a timeout
    assert results[0]["killed_listing"] == ["step_00000001"]  # the read-only save's leftovers removed too


@pytest.mark.multiproc
def test_an_abandoned_background_save_stops_its_writer_and_removes_its_files(failures) -> None:
    disk, results = failures
    for result in results:
        assert result["abandon_s"] < 10  # its writer, stalled for 600 s, was killed, not waited for
        assert result["abandon_writers_alive"] == [False]
    assert results[0]["abandon_listing"] == ["step_00000001"]
    # the ranks saved on together once the disk had room, and the first checkpoint still holds what it saved
    assert results[0]["final"] == str(disk / "step_00000003")
    assert results[0]["final_listing"] == ["step_00000001", "step_00000003"]
    assert all(result["first_as_saved"] for result in results)


@pytest.mark.multiproc
def test_a_failure_after_the_rename_says_the_checkpoint_is_in_place(failures) -> None:
    """Rank 0's sync of the root fails once the new checkpoint is renamed into it: the error, on every rank, says the
    checkpoint is saved (it is the newest a resume finds), not that the previous one stays the newest."""
    disk, results = failures
    error = _same_on_both(results, "synced")
    assert error == (f"{disk / 'step_00000004'}: saved and in place, but syncing {disk} failed afterwards (OSError: "
                     "[Errno 5] Input/output error); check that file system"), error
    assert results[0]["synced_listing"] == ["step_00000001", "step_00000003", "step_00000004"]
