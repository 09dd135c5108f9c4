"""The trainer offload (parallel.offload_trainer) on every rank of a layout, under torchrun (gloo, CPU, one thread per
process): a step on batch A, the trainer's state offloaded (each storage's size then) and reloaded (each tensor
compared with its value before), a step on batch B; then a twin trainer of the same layout takes the same two steps
without offloading. Each rank writes what it saw to --out/offload_rank<R>.json; tests/megatron/test_megatron_offload.py
asserts on them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from megatron_worker import config, make_batch


def state(trainer) -> dict[str, torch.Tensor]:
    """This rank's parameters, grad buffers, and every optimizer's (each chained one's) parameters and state."""
    out = {f"param.{i}": p for i, p in enumerate(p for chunk in trainer.model for p in chunk.module.parameters())}
    buffers = [b for chunk in trainer.model for b in chunk.buffers + chunk.expert_parallel_buffers]
    out.update({f"grad_buffer.{i}": b.grad_data for i, b in enumerate(buffers)})
    optimizers = [o.optimizer for o in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])]
    for o, opt in enumerate(optimizers):
        for i, p in enumerate(p for group in opt.param_groups for p in group["params"]):
            out[f"opt{o}.{i}"] = p
            out.update({f"opt{o}.{i}.{k}": v for k, v in opt.state.get(p, {}).items() if isinstance(v, torch.Tensor)})
    return out


def two_steps(overrides: list[str], offload: bool) -> dict:
    from spade_mega.megatron import Trainer

    trainer = Trainer(config(overrides))
    result: dict = {}
    try:
        first = trainer.train_step(make_batch(1)).metrics
        if offload:
            tensors = state(trainer)
            before = {k: v.detach().clone() for k, v in tensors.items()}
            done = trainer.offloader.offload()
            result["optimizers"] = len(getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]))
            result["moments"] = sum(k.endswith("exp_avg_sq") for k in tensors)
            result["offloaded_bytes"] = done.nbytes
            result["live_bytes_offloaded"] = sum(v.untyped_storage().size() for v in tensors.values())
            trainer.offloader.reload()
            result["not_restored"] = [k for k, v in tensors.items() if not torch.equal(
                v, torch.zeros_like(before[k]) if k.startswith("grad_buffer") else before[k])]
        second = trainer.train_step(make_batch(2)).metrics
        result["metrics"] = [{k: v for k, v in m.items() if k not in ("tokens_per_s", "step_time_s")}
                             for m in (first, second)]
        result["weights"] = [p.detach().clone() for chunk in trainer.model for p in chunk.module.parameters()]
    finally:
        trainer.close()
    return result


def main() -> None:
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["offload"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    torch.set_num_threads(1)
    offloaded = two_steps(args.overrides, offload=True)
    straight = two_steps(args.overrides, offload=False)
    same = [torch.equal(a, b) for a, b in zip(offloaded.pop("weights"), straight.pop("weights"))]
    report = {**offloaded, "weights_equal": all(same) and len(same) > 0,
              "metrics_equal": offloaded.pop("metrics") == straight["metrics"]}
    (args.out / f"offload_rank{dist.get_rank()}.json").write_text(json.dumps(report, indent=1))
    from spade_mega.megatron.parallel import shutdown

    shutdown()


if __name__ == "__main__":
    main()
