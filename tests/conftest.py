"""Test harness: Triton interpreter on CPU, and the ``gpu`` marker's skip.

TRITON_INTERPRET must be set before any Triton kernel is *defined* (at import of a kernel module), so it is decided
here, at collection start, before test modules import spade_mega.kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
