"""Context-parallel scenario for tests/megatron/test_megatron_context.py (gloo, CPU, one thread per process).

  step  any layout: with --load, the checkpoint --load (else build and save the initial weights to --out/init);
        the plan's row compositions, the log-probs of the batch, one GRPO step, the log-probs after it, and with
        --weights (one process, or context parallelism alone, where every rank holds all weights) the weights
        before and after; with --resave also the log-probs after a save in this layout and its reload, then a
        second step (batch 2) and the log-probs after it. Written to --out/<tag>.json and <tag>_*.pt; nothing is
        asserted here.
  resume  any layout: load --load (model and optimizer), the second step (batch 2), the log-probs after it.

The batch: six samples of different lengths, several in a row, none a multiple of 4, so that under CP2 every sample
is padded inside its row segment (and the reference, one process, has no padding at all).
"""

from __future__ import annotations

import argparse

import samples
from megatron_worker import config, is_rank0, worker_main, write_json

LENGTHS = (14, 11, 10, 7, 6, 5)
TURNS = ((2, 4), (5, -1))  # a model turn, then an observation at 4, then the second turn


def make_batch(seed: int):
    return samples.make_batch(seed, LENGTHS, TURNS)


def scenario_step(args) -> None:
    import torch

    from spade_mega.megatron import Trainer

    trainer = Trainer(config(args.overrides))
    if args.load:
        trainer.load(args.load)
    else:
        trainer.save(str(args.out / "init"))
    batch = make_batch(1)
    from spade_mega.megatron.batch import samples_from

    plan = trainer._plan(samples_from(batch))
    rows = [[mb.samples for mb in rank] for rank in plan.micro_batches]
    padding = [sum(int(mb.padding_mask.sum()) for mb in rank) for rank in plan.micro_batches]
    def weights() -> dict:
        return {n: p.detach().clone() for n, p in trainer.model[0].module.named_parameters()}

    initial = weights()
    before = trainer.logprobs(batch)
    result = trainer.train_step(batch)
    after = trainer.logprobs(batch)
    trained = weights()
    logprobs = {"before": before, "after": after}
    if args.resave:  # saved in this layout; the initial weights loaded over it, then the saved ones again
        saved = trainer.save(str(args.out / f"{args.tag}_checkpoint"))
        trainer.load(args.load)
        logprobs["initial_reloaded"] = trainer.logprobs(batch)
        trainer.load(saved)
        logprobs["reloaded"] = trainer.logprobs(batch)
        second = trainer.train_step(make_batch(2)).metrics
        logprobs["second"] = trainer.logprobs(batch)
    if is_rank0():
        torch.save(logprobs, args.out / f"{args.tag}_logprobs.pt")
        if args.weights:
            torch.save({"before": initial, "after": trained}, args.out / f"{args.tag}_weights.pt")
    from spade_mega.kernels.dispatch import LAUNCHES

    write_json(args.out / f"{args.tag}.json", {"step": result.metrics, "rows": rows, "padding": padding,
                                               "kernel_launches": dict(LAUNCHES),
                                               **({"second": second} if args.resave else {})})


def scenario_resume(args) -> None:
    import torch

    from spade_mega.megatron import Trainer

    trainer = Trainer(config(args.overrides))
    trainer.load(args.load)
    result = trainer.train_step(make_batch(2))
    after = trainer.logprobs(make_batch(1))
    if is_rank0():
        torch.save({"second": after}, args.out / f"{args.tag}_logprobs.pt")
    write_json(args.out / f"{args.tag}.json", {"second": result.metrics})


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load")
    parser.add_argument("--weights", action="store_true", help="write this rank's (the full) weights after the step")
    parser.add_argument("--resave", action="store_true", help="with --load: save after the step, load --load and "
                        "the saved checkpoint again, log-probs after each")


if __name__ == "__main__":
    worker_main(globals(), options)
