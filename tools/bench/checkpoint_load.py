"""Peak memory of loading a checkpoint for an export (`convert to-hf`): the weights alone against the full load
(weights and Adam state) that to-hf did before, each in a fresh process, on one trained checkpoint.

    python -m tools.bench checkpoint_load [--layers 4] [--hidden 512] [--experts 8]

Prints each load's peak RSS (the process's whole high-water mark: Python, torch, the built model and optimizer
included) and the ratio weights-only / full.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tools.bench._jobs import add_model_args, run_script, write_model_config

LOAD = """import json, resource, sys
from spade_mega.config.loader import load_config
from spade_mega.megatron import Trainer
trainer = Trainer(load_config(sys.argv[1], []))
step = trainer.load(sys.argv[2], weights_only=sys.argv[3] == "weights")
print(json.dumps({"step": step, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

SAVE = """import sys, torch
from spade_mega.config.loader import load_config
from spade_mega.megatron import Trainer, TrainSample
trainer = Trainer(load_config(sys.argv[1], []))
tokens = torch.randint(0, 512, (32,), generator=torch.Generator().manual_seed(0))
trainer.train_step([TrainSample(tokens, torch.arange(32) > 4, torch.ones(32))])
trainer.save(sys.argv[2])
print(sum(p.numel() for p in trainer.model[0].parameters()))
"""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench checkpoint_load", description=__doc__)
    add_model_args(parser)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_load_") as tmp:
        config = write_model_config(Path(tmp), args)
        params = int(run_script(SAVE, str(config), str(Path(tmp) / "ckpt")))
        print(f"model: {args.layers} layers, hidden {args.hidden}, {args.experts} experts: {params / 1e6:.1f}M "
              f"parameters (float32), checkpoint with Adam state")
        peak = {}
        for mode in ("full", "weights"):
            result = json.loads(run_script(LOAD, str(config), str(Path(tmp) / "ckpt"), mode))
            peak[mode] = result["peak_rss_mb"]
            print(f"  load {mode:<8} peak RSS {peak[mode]:8.0f} MB")
        print(f"weights-only / full (the baseline: what convert to-hf loaded before): "
              f"{peak['weights'] / peak['full']:.2f}")
    return 0
