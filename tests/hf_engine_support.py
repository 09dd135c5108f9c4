"""Fixtures of the hf engine tests on the tiny demo model (imported by the test files that use them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spade_mega.config.loader import load_config

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny_cpu.yaml"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Decoding the tiny model is a chain of small ops: a second intra-op thread only adds hand-offs (and, on a
    loaded machine, spin-waits that made these files 10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cfg():
    return load_config(CONFIG, ["inference.device=cpu"])
