"""Test harness: Triton interpreter on CPU, the ``gpu`` marker's skip, and the fixtures of the tests where a policy
plays programs in real sandbox workers (the solvability checks'): ``tokenizer`` and ``pool``.

TRITON_INTERPRET must be set before any Triton kernel is *defined* (at import of a kernel module), so it is decided
here, at collection start, before test modules import spade_mega.kernels.
"""

from __future__ import annotations

import os
from typing import Iterator

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


@pytest.fixture(scope="module")
def tokenizer():
    """The byte tokenizer of the demo model (no download)."""
    from spade_mega.tokenizer import byte_tokenizer

    return byte_tokenizer()


@pytest.fixture(scope="module")
def pool_warm_workers() -> int:
    """Warm workers of ``pool``: a module that plays more programs at once overrides this fixture."""
    return 2


@pytest.fixture(scope="module")
def pool(pool_warm_workers: int) -> Iterator["SandboxPool"]:
    """A sandbox pool with a 1 s call deadline, strict where the machine allows it (as in production), else
    best-effort; ``pool_warm_workers`` warm workers. A module with a pool of another kind defines its own ``pool``."""
    from sandbox_support import strict_config, strict_missing

    from spade_mega.envs.sandbox import SandboxPool

    isolation = "strict" if strict_missing() is None else "best-effort"
    with SandboxPool(strict_config(isolation=isolation, warm_workers=pool_warm_workers, call_timeout_s=1.0)) as p:
        yield p
