"""Kernel or reference: the one decision every op in this package makes, where kernels launch, and a count of them.

A Triton kernel runs where it can: compiled, on CUDA tensors; interpreted (the kernel was defined while
``TRITON_INTERPRET=1``), on CPU tensors. Anywhere else the op's plain-torch reference runs instead, so a CPU-only
process without the interpreter still trains. ``LAUNCHES`` lets tests and benchmarks prove which path ran.

Triton is optional: each op module (``<op>.py``: its kernels beside its references) imports it guarded and defines
its kernels only when it imports, else leaves them None. With ``kernels.enabled: false`` no kernel is asked for, so
training runs where Triton is missing (macOS has no build of it; some clusters lack it); enabled without it, the
first use is a :class:`KernelsUnavailable` naming the package to install. This module never imports Triton itself.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional, Sequence

import torch

from spade_mega.errors import SpadeError

LAUNCHES: Counter[str] = Counter()


class KernelsUnavailable(SpadeError):
    """kernels.enabled, but Triton cannot be imported."""


def interpreted(kernel: Any) -> bool:
    """Whether ``kernel`` was defined under the Triton interpreter (it then runs on CPU tensors only)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def kernel_for(kernel: Optional[Any], tensor: torch.Tensor, enabled: bool = True) -> Optional[Any]:
    """``kernel`` (from its op module: None where that module could not import Triton) when it is to run on
    ``tensor``: ``enabled`` (``kernels.enabled``) and the device allows it. None otherwise: the caller runs its
    reference. Enabled without Triton: :class:`KernelsUnavailable`."""
    if not enabled:
        return None
    if kernel is None:
        raise KernelsUnavailable("kernels.enabled is true but Triton is not installed (pip install triton; it comes "
                                 "with spade-mega on Linux, there is no build for macOS or Windows; if it is installed, "
                                 "python -c 'import triton' says why it does not import), or set kernels.enabled: "
                                 "false to run the plain-torch references")
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
