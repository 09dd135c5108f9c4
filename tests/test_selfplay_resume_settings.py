"""A run resumed with another regeneration interval: the loop state records the interval it was saved under, and the
change is applied on the run's regeneration schedule and said (the buffer's side, another designer_delay, is in
test_delayed.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spade_mega.selfplay.state import CheckpointStore, LoopState, ResumeError, regeneration_change


def _store_with(tmp_path: Path, data: dict) -> tuple[CheckpointStore, Path]:
    store = CheckpointStore(tmp_path)
    store.states.mkdir(parents=True, exist_ok=True)
    store.state_path(4).write_text(json.dumps(data))
    return store, store.root / "step_00000004"


def test_the_loop_state_records_its_regeneration_interval(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.write_state(4, LoopState(rollout=4, regen_interval=2))
    assert store.read_state(store.root / "step_00000004").regen_interval == 2
    old = {k: v for k, v in LoopState(rollout=4).to_dict().items() if k != "regen_interval"}
    store, checkpoint = _store_with(tmp_path / "old", old)  # saved before the interval was recorded
    assert store.read_state(checkpoint).regen_interval is None
    store, checkpoint = _store_with(tmp_path / "bad", {**old, "regen_interval": 0})
    with pytest.raises(ResumeError, match="regen_interval must be an int >= 1"):
        store.read_state(checkpoint)


@pytest.mark.parametrize("saved, configured, rollout, following", [(2, 3, 4, 7), (4, 2, 4, 5), (2, 4, 6, 9)])
def test_a_changed_interval_regenerates_at_the_next_rollout_of_the_new_schedule(
        saved: int, configured: int, rollout: int, following: int) -> None:
    """The loop regenerates at rollouts r with (r - 1) % regen_interval == 0; the message names the rollout."""
    note = regeneration_change(LoopState(rollout=rollout, regen_interval=saved), configured)
    assert note is not None and f"selfplay.regen_interval {saved} -> {configured}" in note
    assert f"next regeneration at rollout {following}," in note
    assert (following - 1) % configured == 0 and rollout < following <= rollout + configured
    assert regeneration_change(LoopState(rollout=rollout, regen_interval=configured), configured) is None
    assert regeneration_change(LoopState(rollout=rollout), configured) is None
