"""How long a checkpoint save holds training: the foreground save (the baseline) against the blocking part of a
background save (`selfplay.async_save`), and the background write's own duration, in one process on one trained
checkpoint (model and Adam state), each save to a fresh folder.

    python -m tools.bench checkpoint_save [--layers 4] [--hidden 512] [--experts 8] [--repeats 3]

Prints the medians and the ratio background-blocking / foreground.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

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
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_save_") as tmp:
        config = Path(tmp) / "run.yaml"
        config.write_text(json.dumps({
            "base": str(root / "examples" / "configs" / "tiny_cpu.yaml"),
            "model": {"num_layers": args.layers, "hidden_size": args.hidden, "ffn_hidden_size": 2 * args.hidden,
                      "num_attention_heads": 8, "num_query_groups": 4, "kv_channels": args.hidden // 8,
                      "num_experts": args.experts, "moe_ffn_hidden_size": args.hidden}}))
        proc = subprocess.run([sys.executable, "-c", SAVES, str(config), tmp, str(args.repeats)], capture_output=True,
                              text=True, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
        if proc.returncode != 0:
            raise SystemExit(f"benchmark failed:\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    median = {k: statistics.median(result[k]) for k in ("foreground", "blocking", "write")}
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.experts} experts: {result['params'] / 1e6:.1f}M "
          f"parameters (float32), checkpoint with Adam state; median of {args.repeats}")
    print(f"  foreground save (baseline)       {median['foreground']:7.2f} s")
    print(f"  background save, blocking part   {median['blocking']:7.2f} s")
    print(f"  background save, its write       {median['write']:7.2f} s (training goes on meanwhile)")
    print(f"background blocking / foreground: {median['blocking'] / median['foreground']:.2f}")
    return 0
