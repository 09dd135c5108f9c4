"""Durable file replacement, the one mechanism every writer of run state uses (loop states, rollout transcripts,
checkpoint folders): a crash or a full disk leaves the previous file whole, never a torn one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable


def fsync_path(path: str | Path) -> None:
    """Flush a file's or a folder's entry to disk (a folder: so a rename into it survives power loss)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(target: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """``write`` into ``target.tmp``, flushed to disk, then renamed over ``target``; the temporary file is removed if
    anything fails (the exception propagates)."""
    target = Path(target)
    tmp = target.with_name(target.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(target.parent)
    return target
