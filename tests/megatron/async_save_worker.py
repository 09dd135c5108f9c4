"""Scenarios of the asynchronous checkpoint tests (test_async_checkpoint.py) under torchrun (gloo, CPU, one thread per
process), on megatron_worker.py's model and batches. Results go to --out as JSON and .pt files that the test compares;
nothing is asserted here.

  equal       step 1, then the same state saved in the foreground (sync/) and in the background (async/); step 2 runs
              while the background write is pending (its writer stalled 2 s), then it completes. Each checkpoint is loaded back: its weights,
              then one more step and the logits after it, per rank. Then two background saves in a row (chain/),
              a step between them; then one whose writer stalls on rank 1, polled with finish_save(wait=False)
              until complete. With --fail-rank, then a background save whose writer on that rank runs under a file-size limit it
              exceeds (a full disk, for real): the error each rank gets when completing it, then one more step;
              then a background save whose writer the other rank cannot fork: each rank's error, one more step
  killpending with no checkpoint under --out/ckpt: step 1 saved in the foreground, step 2 saved in the background,
              then "PENDING" and a wait that the test ends with SIGKILL; with one: load the newest, save, exit
  orphan      the run directory --out/run locked as the loop's rank 0 locks it, step 1 saved in the background by a
              writer on a file system that stalls (its write sleeps first), then "PENDING <writer pid>" and a wait
              that the test ends by SIGKILLing this process alone
"""

from __future__ import annotations

import contextlib
import json
import resource
import time
from typing import Iterator

from megatron_worker import config, make_batch, worker_main

import torch
import torch.distributed as dist


@contextlib.contextmanager
def stalled_writer(seconds: float, stall: bool = True) -> Iterator[None]:
    """Background writers of the saves started inside stall ``seconds`` before they write (a slow disk)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    write = FileSystemWriterAsync.write_preloaded_data  # each file's write (checkpoint._write_files)

    def stalled(*write_args, **write_kwargs):
        time.sleep(seconds)
        return write(*write_args, **write_kwargs)

    if stall:
        FileSystemWriterAsync.write_preloaded_data = staticmethod(stalled)
    try:
        yield
    finally:
        FileSystemWriterAsync.write_preloaded_data = staticmethod(write)


def weights(trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.model[0].module.named_parameters()}


def scenario_equal(args) -> None:
    from spade_mega.megatron import Trainer, find_latest
    from spade_mega.megatron.checkpoint import is_complete

    trainer = Trainer(config(args.overrides))
    rank = dist.get_rank()
    trainer.train_step(make_batch(1))
    saved = weights(trainer)
    trainer.save(str(args.out / "sync"))
    began = time.perf_counter()
    with stalled_writer(2):  # step 2 surely runs before the write
        path = trainer.save(str(args.out / "async"), background=True)
    result = {"blocking_s": time.perf_counter() - began, "path": path,
              "visible_while_pending": find_latest(args.out / "async") is not None}
    trainer.train_step(make_batch(2))  # changes the weights the background write is saving
    result["written_before_step_2"] = bool(list((args.out / "async").glob(f".step_*/.write_results.rank{rank}")))
    result["write_s"] = trainer.finish_save(wait=True)
    result["complete"] = is_complete(path)
    for tag in ("sync", "async"):
        trainer.load(str(args.out / tag))
        loaded = weights(trainer)
        result[f"{tag}_weights_as_saved"] = all(torch.equal(saved[n], loaded[n]) for n in saved)
        result[f"{tag}_step"] = trainer.train_step(make_batch(3)).metrics
        torch.save(torch.cat(trainer.logits(make_batch(4))), args.out / f"{tag}_logits_rank{rank}.pt")
    # a save while another is being written completes that one first
    trainer.save(str(args.out / "chain"), background=True)
    trainer.train_step(make_batch(5))
    trainer.save(str(args.out / "chain"), background=True)
    result["chain_first_complete_before_finish"] = sorted(p.name for p in (args.out / "chain").iterdir()
                                                          if is_complete(p))
    trainer.finish_save(wait=True)
    result["polls"] = poll(trainer, args)
    (args.out / f"equal_rank{rank}.json").write_text(json.dumps(result))
    if args.fail_rank is not None:
        fail(trainer, args)
        fork_refused(trainer, args)


def poll(trainer, args) -> list:
    """A background save whose writer stalls for 3 s on rank 1 (a slow disk there), completed by the loop's
    non-blocking check: rank 0 checks once its own files are written, rank 1 at once. What each check returned, per
    rank (every rank must decide the same at each: a rank completing alone would wait in a collective for ever)."""
    rank = dist.get_rank()
    with stalled_writer(3, stall=rank == 1):
        trainer.save(str(args.out / "poll"), background=True)
    while rank == 0 and not list((args.out / "poll").glob(f".step_*.partial-*/.write_results.rank{rank}")):
        time.sleep(0.05)
    polls = []
    while not polls or polls[-1] is None:
        polls.append(trainer.finish_save(wait=False))
        time.sleep(0.2)
    return polls


def fail(trainer, args) -> None:
    from spade_mega.megatron import CheckpointError

    rank = dist.get_rank()
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == args.fail_rank:  # the forked writer inherits the limit; this process gets its own back at once
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
    trainer.save(str(args.out / "ckpt"), background=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    try:
        trainer.finish_save(wait=True)
        error = None
    except CheckpointError as exc:
        error = str(exc)
    trainer.train_step(make_batch(5))  # the ranks go on together after the error
    (args.out / f"fail_rank{rank}.json").write_text(json.dumps({"error": error, "pending": trainer.pending_save
                                                                is not None}))


def fork_refused(trainer, args) -> None:
    """A background save whose writer the other rank than --fail-rank cannot fork (the kernel refuses the memory for
    the copy: ENOMEM), the error each rank gets from the save, then one more step together."""
    import errno
    import os

    from spade_mega.megatron import CheckpointError

    rank = dist.get_rank()
    fork = os.fork

    def refused():
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    if rank != args.fail_rank:
        os.fork = refused
    try:
        trainer.save(str(args.out / "refused"), background=True)
        error = None
    except CheckpointError as exc:
        error = str(exc)
    finally:
        os.fork = fork
    trainer.train_step(make_batch(6))
    (args.out / f"refused_rank{rank}.json").write_text(json.dumps({"error": error, "pending": trainer.pending_save
                                                                   is not None}))


def scenario_killpending(args) -> None:
    from spade_mega.megatron import Trainer, find_latest

    trainer = Trainer(config(args.overrides))
    root = args.out / "ckpt"
    if find_latest(root) is not None:
        step = trainer.load(str(root))
        torch.save(weights(trainer), args.out / "resumed_weights.pt")
        trainer.save(str(root))
        print("RESUMED", step, flush=True)
        return
    trainer.train_step(make_batch(1))
    trainer.save(str(root))
    torch.save(weights(trainer), args.out / "step1_weights.pt")
    trainer.train_step(make_batch(2))
    trainer.save(str(root), background=True)
    print("PENDING", flush=True)
    time.sleep(600)


def scenario_orphan(args) -> None:
    import multiprocessing

    from spade_mega.megatron import Trainer
    from spade_mega.selfplay.lock import RunDirLock

    lock = RunDirLock(args.out / "run")
    trainer = Trainer(config(args.overrides))
    trainer.train_step(make_batch(1))
    with stalled_writer(600):
        trainer.save(str(args.out / "ckpt"), background=True)
    print("PENDING", *[child.pid for child in multiprocessing.active_children()], flush=True)
    time.sleep(600)
    lock.close()


if __name__ == "__main__":
    worker_main(globals(), lambda parser: parser.add_argument("--fail-rank", type=int))
