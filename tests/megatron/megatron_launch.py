"""Launch helper for the Megatron tests: scenarios of megatron_worker.py under torchrun (gloo, one thread each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("megatron_worker.py")


def worker_command(nproc: int, scenario: str, out: Path, *args: str, worker: Path = WORKER) -> list[str]:
    launcher = [sys.executable] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, str(worker), scenario, "--out", str(out), *args]


def worker_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def run_worker(nproc: int, scenario: str, out: Path, *args: str, timeout: float = 300, worker: Path = WORKER) -> None:
    """Run one scenario of ``worker`` (megatron_worker.py by default) to completion; on failure the test fails with
    the end of its output."""
    proc = subprocess.run(worker_command(nproc, scenario, out, *args, worker=worker), env=worker_env(),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).splitlines()
        errors = [line for line in lines if "Error" in line and "ChildFailedError" not in line][:10]
        tail = "\n".join(errors + ["..."] + lines[-25:])
        pytest.fail(f"worker '{scenario} {' '.join(args)}' on {nproc} processes exited {proc.returncode}:\n{tail}")


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
