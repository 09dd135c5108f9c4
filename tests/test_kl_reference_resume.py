"""rl.reference naming a checkpoint root that another run is still writing: the self-play loop reads the step its
start resolved, on every resume (the loop states record it), so a resumed run's KL term is the straight run's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_run_resources import _config

from spade_mega.megatron import Trainer
from spade_mega.selfplay.loop import SelfPlay
from spade_mega.selfplay.state import CheckpointStore


@pytest.mark.slow
def test_a_resumed_run_reads_the_reference_step_its_start_resolved_not_the_roots_newest(tmp_path: Path) -> None:
    other = _config(tmp_path, "other")
    trainer = Trainer(other)
    try:
        first = Path(trainer.save(str(tmp_path / "other" / "checkpoints")))
    finally:
        trainer.close()
    root = first.parent

    def run(rollouts: int) -> SelfPlay:
        cfg = _config(tmp_path, "kl")
        cfg.rl.kl_coef, cfg.rl.reference, cfg.selfplay.num_rollouts = 0.1, str(root), rollouts
        loop = SelfPlay(cfg)
        loop.run()
        return loop

    assert run(1).reference == str(first)
    newer = root / "step_00000099"  # the other run saves on
    shutil.copytree(first, newer)
    manifest = json.loads((newer / "spade_checkpoint.json").read_text())
    (newer / "spade_checkpoint.json").write_text(json.dumps({**manifest, "step": 99}))
    assert run(2).reference == str(first)  # resumed from rollout 1's checkpoint
    store = CheckpointStore(tmp_path / "kl")
    assert store.read_state(store.latest()).reference == str(first)
