"""Every Triton kernel compiles ahead of time for sm_90 (Hopper) without a GPU, with no register spills.

The compile runs in a subprocess without TRITON_INTERPRET: this process has the interpreter on, and an interpreted
kernel cannot be compiled. Register counts are printed (``pytest -s``) and recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from spade_mega.kernels.aot import OPS


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "spade_mega.kernels.aot"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines()]
    names = {r["kernel"] for r in reports}
    for op in OPS:  # every op module contributes at least its forward kernel
        assert any(n.startswith(op.rsplit(".", 1)[1] + ".") for n in names), (op, names)
    for r in reports:
        print(f"{r['kernel']:28s} sm_90 registers={r['registers']:3d} spills={r['spill_stores']}/{r['spill_loads']} "
              f"stack={r['stack_frame']} num_warps={r['num_warps']} ({r['notes']})")
        assert r["arch"] == "sm_90"
        assert (r["spill_stores"], r["spill_loads"], r["stack_frame"]) == (0, 0, 0), r
        assert 0 < r["registers"] <= 255, r


def test_refuses_to_run_under_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "spade_mega.kernels.aot"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "TRITON_INTERPRET" in proc.stderr


def test_every_kernel_of_every_op_has_a_compile_spec() -> None:
    """The compile above covers what ``aot_specs()`` lists, and checks only that each op lists something: a kernel
    added to an op (``_<stage>_kernel``, what its dispatcher launches) without a spec would never be compiled, its
    spills never seen. Each must be some spec's kernel (the device helpers they call compile with them)."""
    import importlib

    for op in OPS:
        module = importlib.import_module(op)
        kernels = {name: value for name, value in vars(module).items() if name.endswith("_kernel")}
        assert kernels, op
        compiled = [spec.kernel for spec in module.aot_specs()]
        assert [name for name, kernel in kernels.items() if not any(kernel is k for k in compiled)] == [], op
