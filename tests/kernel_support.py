"""Where the kernel tests run their kernels: compiled on the GPU when there is one, interpreted on CPU otherwise.

Inputs and float64 truths are built on CPU either way (one random stream, one reference); :func:`to_kernel_device`
moves an op's inputs to ``KERNEL_DEVICE`` and :func:`to_cpu` brings its outputs back. Both moves are differentiable,
so a gradient taken on a CPU leaf flows through the kernel and back. On a GPU machine the same assertions, launch
counts included, check the compiled kernels (conftest sets ``TRITON_INTERPRET`` only where there is no GPU).
"""

from __future__ import annotations

from typing import Any

import torch

KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple result
        return type(value)(*(_move(v, device) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_move(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    return value


def to_kernel_device(value: Any) -> Any:
    """A tensor (or a tuple, list, NamedTuple or dict of them, anything else kept) on the device the kernels run
    on."""
    return _move(value, KERNEL_DEVICE)


def to_cpu(value: Any) -> Any:
    """The same, back on CPU, where the truths are."""
    return _move(value, torch.device("cpu"))
