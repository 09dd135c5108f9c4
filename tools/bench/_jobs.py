"""Benchmark jobs that run their own script as one process or under torchrun, and read back its RESULT line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
