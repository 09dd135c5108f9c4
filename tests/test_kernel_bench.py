"""`python -m tools.bench kernels` without a GPU: it says it checks correctness only, checks it, and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_kernels_bench_on_cpu_checks_correctness_only() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the bench must turn it on itself
    proc = subprocess.run([sys.executable, "-m", "tools.bench", "kernels"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "checking correctness only" in out and "no timings" in out and "all checks passed" in out
    assert "FAIL" not in out and "GB/s" not in out
    assert "tis_logprob.logits_grad" in out and "grpo_advantage.forward" in out  # the kernels themselves ran
    assert "ok   tis_logprob loss (no TIS) vs Liger's triton_grpo_loss" in out  # the GPU table's Liger baseline


@pytest.mark.slow
def test_the_gpu_benchmark_code_runs_on_cpu_at_toy_shapes() -> None:
    """--cpu-dry-run: the timing code itself (inputs, baselines, Liger's call, graph replay switch, table) runs end to
    end, so a GPU session does not spend its device time finding a wiring bug. No time is asserted."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tools.bench", "kernels", "--cpu-dry-run", "--tokens", "16",
                           "--vocab", "1000", "--samples", "4096", "--tiles", "256", "1024", "--copy-bytes", "1048576"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "OOM/failed" not in out and "failed:" not in out, out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| op")]
    ops = {line.split(" | ")[0].lstrip("| ").split("; loss differs")[0].split(", 1 launch")[0].split(", 2 launches")[0]
           for line in rows}
    assert ops == {"tis_logprob fwd+bwd (TIS)", "tis_logprob fwd+bwd (no TIS", "logprob+entropy fwd",
                   "grpo_advantage (end to end)",
                   "grpo_advantage (kernel alone, graph replay, tile 256",
                   "grpo_advantage (kernel alone, graph replay, tile 1024"}, ops
    # agents alone in groups of 16 fill every tile exactly: one launch; designers' skills cross tiles: two
    assert "tile 256, 1 launch) | 4096 samples, agents only" in out and "tile 256, 2 launches) | 4096 samples, 10%" in out
    assert "16 x 1000: loss" in out  # the agreement line before the timings
