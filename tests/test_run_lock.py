"""One trainer per run directory: a second one fails at start naming the holder; the lock dies with its process, so
a requeued job (the old one killed) takes it again. Real processes, a real `spade-mega train`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from spade_mega.selfplay.lock import LOCK_FILE, RunDirInUseError, RunDirLock

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"
SCRIPT = Path(sys.executable).with_name("spade-mega")
HOLD = """import sys, time
from spade_mega.selfplay.lock import RunDirLock
lock = RunDirLock(sys.argv[1])
print("HELD", flush=True)
time.sleep(600)
"""


def hold(run_dir: Path) -> subprocess.Popen:
    """Another process (a running trainer, as far as the lock goes) holding ``run_dir``'s lock."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "HELD"
    return proc


def test_a_second_holder_is_refused_naming_the_first_until_it_dies(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    holder = hold(run_dir)
    try:
        with pytest.raises(RunDirInUseError, match=f"pid {holder.pid} on host {socket.gethostname()}"):
            RunDirLock(run_dir)
    finally:
        holder.send_signal(signal.SIGKILL)  # as a job's kill or an OOM does: no clean-up runs
        holder.wait()
    lock = RunDirLock(run_dir)  # the requeued job
    assert f'"pid": {os.getpid()}' in (run_dir / LOCK_FILE).read_text()
    with pytest.raises(RunDirInUseError, match=f"pid {os.getpid()}"):
        RunDirLock(run_dir)  # another open file: flock excludes it even within one process
    lock.close()
    RunDirLock(run_dir).close()


def test_train_on_a_run_directory_in_use_fails_at_start_and_writes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "tiny_cpu"
    holder = hold(run_dir)
    try:
        proc = subprocess.run([str(SCRIPT), "train", str(TINY), f"run.output_dir={tmp_path}", "run.name=tiny_cpu"],
                              capture_output=True, text=True, timeout=300, cwd=ROOT,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert f"{run_dir} is in use by another trainer (pid {holder.pid} on host" in last, last
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # no config, memory, metrics or checkpoint


@pytest.mark.multiproc
def test_every_rank_of_a_job_on_a_run_directory_in_use_fails_naming_it(tmp_path: Path) -> None:
    """Two ranks started as srun starts its tasks (no torchrun agent to kill a survivor): rank 0 alone takes the
    lock, and rank 1 stops with rank 0's error instead of waiting for it in a collective. Both exit with the error's
    status, never a crash at exit: repeated, since a process group left to exit-time destructors aborted rank 0
    (SIGABRT) in about one exit in five."""
    from spade_mega.inference.server import free_port

    run_dir = tmp_path / "tiny_cpu"
    holder = hold(run_dir)
    try:
        for _ in range(6):
            port = str(free_port())
            ranks = [subprocess.Popen([str(SCRIPT), "train", str(TINY), f"run.output_dir={tmp_path}",
                                       "run.name=tiny_cpu"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                      env=dict(os.environ, OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r),
                                               WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                               MASTER_PORT=port))
                     for r in range(2)]
            errors = [rank.communicate(timeout=300)[1] for rank in ranks]
            assert [rank.returncode for rank in ranks] == [2, 2], errors
            assert f"{run_dir} is in use by another trainer (pid {holder.pid}" in errors[0].strip().splitlines()[-1]
            last = errors[1].strip().splitlines()[-1]
            assert "rank 0 failed, so rank 1 stops too: RunDirInUseError" in last and f"pid {holder.pid}" in last, last
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]


FULL_DISK = """import resource, signal, sys
from spade_mega.selfplay.lock import RunDirLock
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
lock = RunDirLock(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
lock.close()
RunDirLock(sys.argv[1]).close()  # released: nothing of the first attempt holds it
print("OK")
"""


def test_a_lock_whose_holder_record_cannot_be_written_still_holds_and_releases(tmp_path: Path) -> None:
    """The holder's record is informative: a file system that refuses the write (full, a quota) warns and the lock
    holds; the descriptor was left open, holding the lock, with a raw OSError."""
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-3000:]
    assert "cannot write the lock holder's record" in proc.stderr, proc.stderr[-3000:]
