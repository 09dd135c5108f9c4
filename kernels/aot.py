"""Ahead-of-time compile of every kernel for sm_90 (Hopper), no GPU needed: registers and spills per kernel.

``python -m spade_mega.kernels.aot`` prints one JSON line per kernel. It must run without ``TRITON_INTERPRET=1`` (an
interpreted kernel cannot be compiled). Each op module lists what to compile in ``aot_specs()``, built from the same
launch configuration its dispatcher uses, so the check follows the real launches.

Why: the CPU test suite cannot time a kernel, but it can catch the usual way a Triton kernel silently loses its speed on
a GPU: a block size or a fused epilogue that makes ptxas spill registers to local memory.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

OPS = ("spade_mega.kernels.tis_logprob", "spade_mega.kernels.grpo_advantage")
ARCH = 90


@dataclass(frozen=True)
class AotSpec:
    """One compile: ``signature`` maps each argument to a Triton type, ``"type:16"`` marking a value (pointer or
    integer) that real launches pass 16-divisible, as Triton's launcher would specialise it; ``constexprs`` gives the
    compile-time arguments (``None`` for an optional pointer left out)."""

    name: str
    kernel: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int
    notes: str = ""


_USED = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_spec(spec: AotSpec) -> dict[str, Any]:
    """Compile ``spec`` for sm_90 and read registers and spills from ptxas's own report."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(spec.kernel.arg_names)  # the kernel's own order: attributes are keyed by argument position
    if set(names) != set(spec.signature):
        raise ValueError(f"{spec.name}: signature names {sorted(spec.signature)} are not the kernel's {names}")
    signature = {n: ("constexpr" if n in spec.constexprs else spec.signature[n].split(":")[0]) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in spec.signature.items() if t.endswith(":16")}
    source = ASTSource(spec.kernel, signature, constexprs=dict(spec.constexprs), attrs=attrs)
    log = io.StringIO()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache, knobs.cache.scope(), knobs.nvidia.scope():
        knobs.cache.dir = cache  # a cache hit would skip ptxas and its report
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(source, target=GPUTarget("cuda", ARCH, 32),
                                      options={"num_warps": spec.num_warps})
    report = log.getvalue()
    used, spill = _USED.findall(report), _SPILL.findall(report)
    if not used or not spill:
        raise RuntimeError(f"no ptxas resource report for {spec.name}:\n{report}")
    stack, stores, loads = (int(v) for v in spill[-1])
    return {"kernel": spec.name, "arch": f"sm_{ARCH}", "num_warps": spec.num_warps, "registers": int(used[-1]),
            "spill_stores": stores, "spill_loads": loads, "stack_frame": stack,
            "shared_bytes": compiled.metadata.shared, "compile_s": round(time.perf_counter() - started, 2),
            "notes": spec.notes}


def all_specs() -> list[AotSpec]:
    return [spec for op in OPS for spec in importlib.import_module(op).aot_specs()]


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("error: unset TRITON_INTERPRET: interpreted kernels cannot be compiled ahead of time", file=sys.stderr)
        return 2
    for spec in all_specs():
        print(json.dumps(compile_spec(spec)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
