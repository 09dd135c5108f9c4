"""Benchmark jobs that run their own script as one process or under torchrun, and read back its RESULT line."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

TP2_SP = ["parallel.tensor=2", "parallel.sequence_parallel=true"]
# the parallel layouts the multi-process benchmarks time: name -> (ranks, config overrides)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "tp1": (1, []),
    "tp2_sp": (2, TP2_SP),
    "ep2": (2, ["parallel.expert=2"]),
    "pp2": (2, ["parallel.pipeline=2"]),
    "tp2_ep2": (4, [*TP2_SP, "parallel.expert=2"]),
}


def launch(script: str, nproc: int, argv: list[str]) -> dict[str, Any]:
    """Run ``script --worker ARGV`` on ``nproc`` ranks (one torch thread each) and return the JSON its rank 0
    printed after ``RESULT``; a failed job stops the benchmark with its error output."""
    worker = [script, "--worker", *argv]
    command = [sys.executable, *worker] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *worker]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"benchmark job failed ({' '.join(command)}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The size of the Qwen3-MoE-shaped model the checkpoint benchmarks build (tiny_cpu.yaml widened)."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)


def write_model_config(folder: Path, args: argparse.Namespace) -> Path:
    """A run config in ``folder``: tiny_cpu.yaml with the model of :func:`add_model_args`."""
    root = Path(__file__).resolve().parents[2]
    config = folder / "run.yaml"
    config.write_text(json.dumps({
        "base": str(root / "examples" / "configs" / "tiny_cpu.yaml"),
        "model": {"num_layers": args.layers, "hidden_size": args.hidden, "ffn_hidden_size": 2 * args.hidden,
                  "num_attention_heads": 8, "num_query_groups": 4, "kv_channels": args.hidden // 8,
                  "num_experts": args.experts, "moe_ffn_hidden_size": args.hidden}}))
    return config


def run_script(script: str, *args: str) -> str:
    """The last line ``python -c script ARGS`` printed (one torch thread); a failure stops the benchmark."""
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    if proc.returncode != 0:
        raise SystemExit(f"benchmark step failed:\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]
