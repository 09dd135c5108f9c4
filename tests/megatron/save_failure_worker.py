"""Checkpoint saves that fail on one rank (test_checkpoint_save_failures.py), under torchrun on two expert-parallel
ranks (each writes shards of its own), with the checkpoint root --disk a small tmpfs of this process's own mount
namespace (the test starts it under ``unshare -m``): a full disk and a read-only folder for real. Rank 0 fills or
remounts the disk between the phases; each rank records what every save raised in --out/failures_rank<N>.json.

  replace   step 1 saved, then saved again while rank 0's rename of the new folder is refused (EROFS)
  staging   saved again while rank 1 cannot stage its tensors for the write (host memory exhausted: MemoryError)
  full      the disk filled to a few KiB: a foreground save fails writing its files
  full_end  a background save whose files are written, then the disk filled: rank 0's completion fails
  ro_end    the same with the disk remounted read-only; then a foreground save on the read-only disk
  killed    a background save whose writer rank 1 SIGKILLs (the OOM killer's signal)
  abandon   a background save with stalled writers, abandoned (an error exit): how long it took, what is left
  final     a foreground save on the freed disk
  synced    a foreground save of the next step whose sync of the root after the rename fails on rank 0 (EIO); then
            step 1 loaded: its weights as saved

With --no-mount (where no tmpfs can be mounted) --disk is a plain folder: full and the read-only phases are not run,
and in full_end rank 0's completion fails on a file-size limit of its own process (EFBIG) instead of a full disk, so
the agreement on rank 0's completion is still tested.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import multiprocessing
import os
import pickle
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from async_save_worker import stalled_writer, weights
from megatron_worker import config, make_batch

import torch
import torch.distributed as dist


def fill(disk: Path, leave: int) -> None:
    """Rank 0: a file taking all of the disk's free space but ``leave`` bytes."""
    with open(disk / "filler", "ab") as f:
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize - leave
        try:
            while free > 0:
                free -= f.write(b"\0" * min(free, 1 << 20))
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def files_of(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def listing(disk: Path) -> list[str]:
    return sorted(p.name for p in disk.iterdir())


def as_megatron_saves(trainer, saved: Path, own: Path) -> dict[str, bool]:
    """Whether the checkpoint spade-mega completed (``saved``) is what Megatron-Core's own save of the same state
    writes (into ``own``, on every rank: collective): the same data files and metadata.json byte for byte, and torch's
    .metadata with the same entries, every rank's write results merged (all but its storage_meta: the folder and a
    save id)."""
    from megatron.core import dist_checkpointing

    from spade_mega.megatron.checkpoint import MANIFEST, _sharded_state

    if dist.get_rank() == 0:
        own.mkdir()
    dist.barrier()
    dist_checkpointing.save(_sharded_state(trainer, is_loading=False, with_optimizer=True), str(own))
    ours, megatron = files_of(saved), files_of(own)
    metadata = [pickle.loads((path / ".metadata").read_bytes()) for path in (saved, own)]
    fields = ("state_dict_metadata", "storage_data", "planner_data")
    return {"files": {k: v for k, v in ours.items() if k not in (".metadata", MANIFEST)} ==
            {k: v for k, v in megatron.items() if k != ".metadata"},
            "metadata": all(getattr(metadata[0], f) == getattr(metadata[1], f) for f in fields),
            "two_ranks_written": sum(name.endswith(".distcp") for name in megatron) == 2}


def attempt(save: Callable[[], object]) -> str | None:
    from spade_mega.megatron import CheckpointError

    try:
        save()
    except CheckpointError as exc:
        return str(exc)
    return None


def written(disk: Path) -> None:
    """Wait until every rank's background writer has reported its files."""
    while len(list(disk.glob(".step_*.partial-*/.write_results.rank?"))) < dist.get_world_size():
        time.sleep(0.05)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["failures"])  # the launch helper's convention: one scenario here
    parser.add_argument("--out", type=Path)
    parser.add_argument("--disk", type=Path)
    parser.add_argument("--no-mount", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    torch.set_num_threads(1)
    from spade_mega.megatron import Trainer
    from spade_mega.megatron.parallel import shutdown

    disk, result = args.disk, {}
    trainer = Trainer(config(args.overrides))
    rank = dist.get_rank()
    trainer.train_step(make_batch(1))
    saved = weights(trainer)
    trainer.save(str(disk))
    first = disk / "step_00000001"
    result["first_files"] = files_of(first)
    result["as_megatron_saves"] = as_megatron_saves(trainer, first, args.out / "megatron_own")

    rename = os.rename

    def refused(src, dst):  # rank 0's rename of the new checkpoint's folder into place: the root turned read-only
        if ".partial-" in Path(src).name:  # not the files inside it (torch renames its .metadata into place)
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(src))
        return rename(src, dst)

    if rank == 0:
        os.rename = refused
    result["replace"] = attempt(lambda: trainer.save(str(disk)))
    os.rename = rename
    result["replace_listing"] = listing(disk)
    result["replace_first_files"] = files_of(first)

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    stage = FileSystemWriterAsync.prepare_write_data

    def exhausted(*stage_args, **stage_kwargs):
        raise MemoryError("host memory exhausted")

    if rank == 1:
        FileSystemWriterAsync.prepare_write_data = exhausted
    result["staging"] = attempt(lambda: trainer.save(str(disk)))
    FileSystemWriterAsync.prepare_write_data = stage
    result["staging_listing"] = listing(disk)

    trainer.train_step(make_batch(2))
    mounted = not args.no_mount
    if mounted:
        if rank == 0:
            fill(disk, 8192)
        dist.barrier()
        result["full"] = attempt(lambda: trainer.save(str(disk)))
        result["full_listing"] = listing(disk)
        if rank == 0:
            (disk / "filler").unlink()

    trainer.save(str(disk), background=True)
    written(disk)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 0 and mounted:
        fill(disk, 0)
    elif rank == 0:  # no file of rank 0's may grow past 1 byte: its .metadata fails as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (1, limits[1]))
    dist.barrier()
    result["full_end"] = attempt(lambda: trainer.finish_save(wait=True))
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    result["full_end_listing"] = listing(disk)
    if rank == 0 and mounted:
        (disk / "filler").unlink()
    if mounted:
        trainer.save(str(disk), background=True)
        written(disk)
        if rank == 0:
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        dist.barrier()
        result["ro_end"] = attempt(lambda: trainer.finish_save(wait=True))
        result["ro_start"] = attempt(lambda: trainer.save(str(disk)))
        result["ro_listing"] = listing(disk)
        dist.barrier()
        if rank == 0:
            subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
        dist.barrier()

    with stalled_writer(60, stall=rank == 1):
        trainer.save(str(disk), background=True)
    if rank == 1:
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGKILL)
    began = time.monotonic()
    result["killed"] = attempt(lambda: trainer.finish_save(wait=True))
    result["killed_s"] = time.monotonic() - began
    result["killed_listing"] = listing(disk)
    trainer.train_step(make_batch(3))  # the ranks go on together

    with stalled_writer(600):
        trainer.save(str(disk), background=True)
    writers = multiprocessing.active_children()
    began = time.monotonic()
    trainer.abandon_save()
    result["abandon_s"] = time.monotonic() - began
    result["abandon_writers_alive"] = [w.is_alive() for w in writers]
    dist.barrier()
    result["abandon_listing"] = listing(disk)

    result["final"] = trainer.save(str(disk))
    result["final_listing"] = listing(disk)

    from spade_mega.megatron import checkpoint

    trainer.train_step(make_batch(4))
    sync = checkpoint.fsync_path

    def failing(path):  # the root's sync, after the new checkpoint's rename into it
        if Path(path) == disk:
            raise OSError(errno.EIO, os.strerror(errno.EIO))  # as os.fsync raises it: no file name
        return sync(path)

    if rank == 0:
        checkpoint.fsync_path = failing
    result["synced"] = attempt(lambda: trainer.save(str(disk)))
    checkpoint.fsync_path = sync
    result["synced_listing"] = listing(disk)
    trainer.load(str(first))
    loaded = weights(trainer)
    result["first_as_saved"] = all(torch.equal(saved[n], loaded[n]) for n in saved)
    (args.out / f"failures_rank{rank}.json").write_text(json.dumps(result))
    shutdown()


if __name__ == "__main__":
    sys.exit(main())
