"""Weight-bridge throughput: MB/s of export_hf (Megatron shards -> full Hugging Face tensors in buckets on rank 0)
and of sync_weights into the in-process HFEngine, per parallel layout.

    python -m tools.bench bridge [--layouts tp1 tp2_sp ep2 pp2] [--repeats 5] [--bucket-mb 64] [KEY=VALUE ...]
    python tools/bench/bridge.py ...

Each layout runs in its own torchrun job (gloo on CPU, NCCL on GPU) on a Qwen3-MoE of about 250 MB in float32
(4 layers, hidden 512, 8 experts, vocabulary 32,000; KEY=VALUE overrides change it). The baseline, measured in the
same job, is a plain copy of rank 0's own ``state_dict`` (``detach().clone()`` of every tensor): what a weight
update costs with no gathering, renaming or re-layout at all. Export bytes count the full model (what rank 0
receives and yields); the baseline counts rank 0's own tensors. Times are medians of ``--repeats`` rounds after a
warm-up round, the three measures interleaved in each round. On CPU the processes share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import _jobs as jobs  # noqa: E402  (after the path set-up of a script run)

LAYOUTS = {name: jobs.LAYOUTS[name] for name in ("tp1", "tp2_sp", "ep2", "pp2")}
MODEL = ["model.num_layers=4", "model.hidden_size=512", "model.num_attention_heads=8", "model.num_query_groups=4",
         "model.kv_channels=64", "model.num_experts=8", "model.moe_ffn_hidden_size=512", "model.vocab_size=32000"]


def timed(fns: dict[str, Any], repeats: int) -> dict[str, float]:
    """Median seconds of each function, the functions interleaved in every round so that load from other jobs on the
    machine hits them alike; one warm-up round first."""
    import statistics

    import torch.distributed as dist

    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(repeats + 1):
        for name, fn in fns.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from spade_mega.bridge import export_hf, sync_weights
    from spade_mega.config.loader import apply_overrides, build, to_dict
    from spade_mega.config.schema import SpadeConfig
    from spade_mega.inference.hf import HFEngine
    from spade_mega.megatron import Trainer

    torch.set_num_threads(1 if not torch.cuda.is_available() else torch.get_num_threads())
    cfg = build(SpadeConfig, apply_overrides(to_dict(SpadeConfig()), [*MODEL, *args.overrides]))
    cfg.check()
    trainer = Trainer(cfg)
    rank0 = dist.get_rank() == 0
    exported = [0]

    def export() -> None:
        exported[0] = sum(t.numel() * t.element_size() for bucket in export_hf(trainer, args.bucket_mb)
                          for t in bucket.values())

    def state_dict_copy() -> None:
        copies = [{k: v.detach().clone() for k, v in chunk.state_dict().items() if isinstance(v, torch.Tensor)}
                  for chunk in trainer.model]
        del copies

    local = sum(v.numel() * v.element_size() for chunk in trainer.model for v in chunk.state_dict().values()
                if isinstance(v, torch.Tensor))
    engine = HFEngine(trainer.model_cfg, eos_token_id=0, device=str(trainer.backend.device)) if rank0 else None
    versions = iter(range(1, 10**6))
    seconds = timed({"export": export, "baseline": state_dict_copy,
                     "sync": lambda: sync_weights(trainer, engine, next(versions), bucket_mb=args.bucket_mb)},
                    args.repeats)
    if rank0:
        mb = exported[0] / 2**20
        print("RESULT " + json.dumps({"model_mb": mb, "local_mb": local / 2**20, "export_mb_s": mb / seconds["export"],
                                      "sync_mb_s": mb / seconds["sync"],
                                      "baseline_mb_s": local / 2**20 / seconds["baseline"],
                                      "layout": trainer.layout.describe()}), flush=True)


def launch(nproc: int, argv: list[str]) -> dict[str, Any]:
    return jobs.launch(str(Path(__file__).resolve()), nproc, argv)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench bridge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="model overrides, e.g. model.num_layers=8")
    args = parser.parse_intermixed_args(argv)
    if args.worker:
        worker(args)
        return 0

    import torch

    gpus = torch.cuda.device_count()
    device = f"{gpus} x {torch.cuda.get_device_name()}, NCCL" if gpus else "CPU (gloo, one thread per process)"
    common = ["--repeats", str(args.repeats), "--bucket-mb", str(args.bucket_mb), *args.overrides]
    print(f"Weight bridge, Qwen3-MoE {' '.join(MODEL + args.overrides)}, buckets of {args.bucket_mb:g} MiB, "
          f"{args.repeats} repeats, {device}")
    print("| layout | model (MB) | export_hf (MB/s) | sync_weights into HFEngine (MB/s) | baseline: rank-0 state_dict "
          "copy (MB/s, of its MB) | export vs baseline |")
    print("|---|---|---|---|---|---|")
    for name in args.layouts:
        nproc, overrides = LAYOUTS[name]
        if gpus and nproc > gpus:
            print(f"| {name} | not run: needs {nproc} GPUs, this machine has {gpus} | | | | |", flush=True)
            continue
        r = launch(nproc, [*common, *overrides])
        print(f"| {name} ({r['layout']}) | {r['model_mb']:.0f} | {r['export_mb_s']:,.0f} | {r['sync_mb_s']:,.0f} | "
              f"{r['baseline_mb_s']:,.0f} (of {r['local_mb']:.0f}) | x{r['export_mb_s'] / r['baseline_mb_s']:.2f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
