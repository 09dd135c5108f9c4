"""Kernel or reference: the one decision every op in this package makes, where kernels launch, and a count of them.

A Triton kernel runs where it can: compiled, on CUDA tensors; interpreted (the kernel was defined while
``TRITON_INTERPRET=1``), on CPU tensors. Anywhere else the op's plain-torch reference runs instead, so a CPU-only
process without the interpreter still trains. ``LAUNCHES`` lets tests and benchmarks prove which path ran.

Triton is imported only here, and only when a kernel is to run: each op's kernels live in ``<op>_triton.py``, imported
by :func:`kernel_for` when ``kernels.enabled`` asks for them. With the kernels disabled nothing imports Triton (macOS
has no build of it; some clusters lack it); enabled without Triton, the first use is a :class:`KernelsUnavailable`
naming the package to install.
"""

from __future__ import annotations

import importlib
from collections import Counter
from types import ModuleType
from typing import Any, Optional, Sequence

import torch

from spade_mega.errors import SpadeError

LAUNCHES: Counter[str] = Counter()


class KernelsUnavailable(SpadeError):
    """kernels.enabled, but Triton cannot be imported."""


def triton_kernels(op: str) -> ModuleType:
    """The Triton kernels of ``op`` (module ``spade_mega.kernels.<op>_triton``), importing Triton on first use."""
    try:
        return importlib.import_module(f"spade_mega.kernels.{op}_triton")
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "triton":
            raise
        raise KernelsUnavailable("kernels.enabled is true but Triton is not installed (pip install triton; it comes "
                                 "with spade-mega on Linux, there is no build for macOS or Windows), or set "
                                 "kernels.enabled: false to run the plain-torch references") from None


def interpreted(kernel: Any) -> bool:
    """Whether ``kernel`` was defined under the Triton interpreter (it then runs on CPU tensors only)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def kernel_for(op: str, name: str, tensor: torch.Tensor, enabled: bool = True) -> Optional[Any]:
    """The kernel ``name`` of ``op`` when it is to run on ``tensor``: ``enabled`` (``kernels.enabled``) and the device
    allows it. None otherwise: the caller runs its reference (and Triton is not imported when not ``enabled``)."""
    if not enabled:
        return None
    kernel = getattr(triton_kernels(op), name)
    return kernel if (tensor.device.type == "cpu" if interpreted(kernel) else tensor.is_cuda) else None


def launch(name: str, kernel: Any, grid: Sequence[int], *args: Any, **meta: Any) -> None:
    """Launch ``kernel`` on ``grid`` and count it under ``name`` (``op.stage``).

    On the device of its first tensor argument: Triton launches on the current CUDA device, which on a rank whose
    current device is not its tensors' (a process driving several GPUs, a library that moved it) would run the
    kernel on the wrong GPU or fail with an illegal address."""
    LAUNCHES[name] += 1
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if device is not None and device.type == "cuda":
        with torch.cuda.device(device):
            kernel[tuple(grid)](*args, **meta)
    else:
        kernel[tuple(grid)](*args, **meta)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids (triton.cdiv, without importing Triton)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (triton.next_power_of_2, without importing Triton)."""
    return 1 << max(n - 1, 0).bit_length()
