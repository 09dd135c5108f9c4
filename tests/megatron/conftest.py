"""What several Megatron test modules start from, run once per session."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import pytest
from megatron_launch import run_worker


@pytest.fixture(scope="session")
def _reference_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    run_worker(1, "reference", out)
    return out


@pytest.fixture(scope="session")
def reference_run(_reference_run: Path) -> Callable[[Path], Path]:
    """``copy(out)`` puts megatron_worker.py's one-process reference scenario with the default config into ``out``
    (init/ and reference/ checkpoints, reference.json) and returns ``out``: started once, copied for each module,
    which writes its own runs beside it."""

    def copy(out: Path) -> Path:
        shutil.copytree(_reference_run, out, dirs_exist_ok=True)
        return out

    return copy
