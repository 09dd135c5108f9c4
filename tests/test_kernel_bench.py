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
