"""One trainer per run directory: rank 0 holds an OS lock on ``run_dir/.spade-mega.lock`` while the run lives.

Two trainers writing one run directory (the memory's SQLite file, the checkpoints, the metrics) interleave their
writes; nothing downstream could tell. The lock is ``flock`` on a file in the run directory, so the kernel releases it
when the holding process dies however it dies (SIGKILL, OOM, a node's job cancelled): a requeued SLURM job takes it
again without a stale-lock clean-up, while a second ``spade-mega train`` on a run in use fails at start naming the
holder. Only global rank 0 takes it, since only rank 0 writes the run directory (the other ranks write nothing there).
The file stays after the run (deleting it would race with a process about to lock it); its content names the last
holder and is only informative. The descriptor is close-on-exec, so no sandbox worker or engine server inherits it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Optional

from spade_mega.errors import SpadeError

LOCK_FILE = ".spade-mega.lock"
log = logging.getLogger("spade_mega.selfplay")


class RunDirInUseError(SpadeError):
    """Another live process trains in this run directory."""


def _holder(fd: int) -> str:
    try:
        info: Any = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "null")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        info = None
    if not isinstance(info, dict):
        return "a process that is still starting (its pid is not written yet)"
    job = f", SLURM job {info['slurm_job']}" if info.get("slurm_job") else ""
    return f"pid {info.get('pid')} on host {info.get('host')}{job}, since {info.get('since')}"


class RunDirLock:
    """Held from construction until :meth:`close` (or the process's end)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: Optional[int] = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd) if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
            os.close(fd)
            if holder is None:  # a file system without flock (Lustre mounted without -o flock, some NFS setups)
                log.warning("%s: cannot lock the run directory (%s); a second trainer started on it would not be "
                            "detected", self.path, exc.strerror or exc)
                return
            raise RunDirInUseError(
                f"{self.path.parent} is in use by another trainer ({holder}; lock {self.path}): two runs would "
                "write one memory, its checkpoints and metrics. Stop that run, or give this one another run.name "
                "(or run.output_dir)") from None
        self._fd = fd
        record = {"pid": os.getpid(), "host": socket.gethostname(), "slurm_job": os.environ.get("SLURM_JOB_ID"),
                  "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        try:  # the record only informs a refused trainer; the lock holds without it
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode("utf-8"), 0)
        except OSError as exc:
            log.warning("%s: cannot write the lock holder's record (%s); the run directory is locked all the same",
                        self.path, exc.strerror or exc)

    def close(self) -> None:
        """Release the lock (the file stays)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
