"""Kernel or reference: the one decision every op in this package makes, and a count of the kernel launches.

A Triton kernel runs where it can: compiled, on CUDA tensors; interpreted (the kernel was defined while
``TRITON_INTERPRET=1``), on CPU tensors. Anywhere else the op's plain-torch reference runs instead, so a CPU-only
process without the interpreter still trains. ``LAUNCHES`` lets tests and benchmarks prove which path ran.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import torch
from triton.runtime.interpreter import InterpretedFunction

LAUNCHES: Counter[str] = Counter()


def interpreted(kernel: Any) -> bool:
    """Whether ``kernel`` was defined under the Triton interpreter (it then runs on CPU tensors only)."""
    return isinstance(kernel, InterpretedFunction)


def use_kernel(kernel: Any, tensor: torch.Tensor, enabled: bool = True) -> bool:
    """Whether to run ``kernel`` on ``tensor``: when ``enabled`` (``kernels.enabled``) and the device allows it;
    otherwise the caller runs its reference."""
    return enabled and (tensor.device.type == "cpu" if interpreted(kernel) else tensor.is_cuda)


def launch(name: str, kernel: Any, grid: Sequence[int], *args: Any, **meta: Any) -> None:
    """Launch ``kernel`` on ``grid`` and count it under ``name`` (``op.stage``)."""
    LAUNCHES[name] += 1
    kernel[tuple(grid)](*args, **meta)
