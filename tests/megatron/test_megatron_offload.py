"""parallel.offload_trainer on two expert-parallel ranks (also two data-parallel ranks for the dense weights, the
distributed optimizer sharding over them, a chained optimizer for the expert weights): on every rank, offloading
releases every storage of the trainer's state and reloading restores it bit for bit, and the next step equals the
step of a trainer that never offloaded (metrics and this rank's weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from megatron_launch import run_worker

OFFLOAD_WORKER = Path(__file__).with_name("offload_worker.py")


@pytest.mark.slow
@pytest.mark.multiproc
def test_offload_and_reload_are_bit_exact_on_every_expert_parallel_rank(tmp_path: Path) -> None:
    run_worker(2, "offload", tmp_path, "parallel.expert=2", "parallel.max_tokens_per_gpu=40", worker=OFFLOAD_WORKER)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"offload_rank{rank}.json").read_text())
        assert report["optimizers"] == 2 and report["moments"] > 0, report  # dense and expert, Adam's state made
        assert report["offloaded_bytes"] > 0 and report["live_bytes_offloaded"] == 0, report
        assert report["not_restored"] == [], report
        assert report["metrics_equal"] and report["weights_equal"], report
