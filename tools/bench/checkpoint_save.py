"""How long a checkpoint save holds training: the foreground save (the baseline) against the blocking part of a
background save (`selfplay.async_save`), and the background write's own duration, in one process on one trained
checkpoint (model and Adam state), each save to a fresh folder.

    python -m tools.bench checkpoint_save [--layers 4] [--hidden 512] [--experts 8] [--repeats 3]

Prints the medians and the ratio background-blocking / foreground.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from tools.bench._jobs import add_model_args, run_script, write_model_config

SAVES = """import json, sys, time, torch
from spade_mega.config.loader import load_config
from spade_mega.megatron import Trainer, TrainSample
trainer = Trainer(load_config(sys.argv[1], []))
tokens = torch.randint(0, 512, (32,), generator=torch.Generator().manual_seed(0))
trainer.train_step([TrainSample(tokens, torch.arange(32) > 4, torch.ones(32))])
out = {"params": sum(p.numel() for p in trainer.model[0].parameters()), "foreground": [], "blocking": [], "write": []}
for i in range(int(sys.argv[3])):
    began = time.perf_counter()
    trainer.save(f"{sys.argv[2]}/fg{i}")
    out["foreground"].append(time.perf_counter() - began)
    began = time.perf_counter()
    trainer.save(f"{sys.argv[2]}/bg{i}", background=True)
    out["blocking"].append(time.perf_counter() - began)
    out["write"].append(trainer.finish_save(wait=True))
print(json.dumps(out))
"""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench checkpoint_save", description=__doc__)
    add_model_args(parser)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_save_") as tmp:
        result = json.loads(run_script(SAVES, str(write_model_config(Path(tmp), args)), tmp, str(args.repeats)))
    median = {k: statistics.median(result[k]) for k in ("foreground", "blocking", "write")}
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.experts} experts: {result['params'] / 1e6:.1f}M "
          f"parameters (float32), checkpoint with Adam state; median of {args.repeats}")
    print(f"  foreground save (baseline)       {median['foreground']:7.2f} s")
    print(f"  background save, blocking part   {median['blocking']:7.2f} s")
    print(f"  background save, its write       {median['write']:7.2f} s (training goes on meanwhile)")
    print(f"background blocking / foreground: {median['blocking'] / median['foreground']:.2f}")
    return 0
