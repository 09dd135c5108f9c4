"""EnvMemory.discard_after: a resumed run forgets what the iterations after its checkpoint wrote, so the replay finds
the database as the uninterrupted run had it (a real SQLite file)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_curriculum_memory import program

from spade_mega.curriculum.memory import EnvMemory, EnvMemoryError


def _fill(memory: EnvMemory, iterations: range) -> None:
    """Iteration i proposes program i (and re-proposes program 0), evaluates everything proposed so far."""
    for i in iterations:
        memory.propose(program(i, iteration=i))
        memory.set_validation(program(i, iteration=i).content_hash, True)
        for j in range(i + 1):
            memory.record_evaluation(program(j).content_hash, i, win_rate=0.1 * (i % 4), win_rate_hint=0.5,
                                     plays=4, hint_plays=2, designer_reward=0.25 * j)


def _snapshot(memory: EnvMemory) -> list[dict]:
    rows = [r.to_dict() for r in memory.iter_records()]
    for r in rows:
        r.pop("created_at")
        r.pop("proposals")
    return rows


def test_discard_after_restores_the_state_of_that_iteration(tmp_path: Path) -> None:
    with EnvMemory(tmp_path / "a.sqlite") as straight, EnvMemory(tmp_path / "b.sqlite") as resumed:
        _fill(straight, range(0, 3))
        _fill(resumed, range(0, 5))
        counts = resumed.discard_after(2)
        assert counts == {"environments": 2, "evaluations": 4 + 5}
        assert _snapshot(resumed) == _snapshot(straight)
        assert resumed.stats()["last_iteration"] == 2
        assert [r.id for r in resumed.seeds("arithmetic", 10)] == [r.id for r in straight.seeds("arithmetic", 10)]
        # the replay reuses the row ids and finds no near-duplicate left by the discarded iterations
        _fill(straight, range(3, 5))
        _fill(resumed, range(3, 5))
        assert _snapshot(resumed) == _snapshot(straight)
        assert [r.duplicate_of for r in resumed.iter_records()] == [r.duplicate_of for r in straight.iter_records()]


def test_an_environment_whose_every_evaluation_is_discarded_is_unplayed_again(tmp_path: Path) -> None:
    with EnvMemory(tmp_path / "m.sqlite") as memory:
        old = program(1, iteration=0)
        memory.propose(old)
        memory.record_evaluation(old.content_hash, 3, win_rate=1.0, win_rate_hint=1.0, plays=2, hint_plays=2)
        assert memory.get(old.content_hash).outcome == "mastered"
        memory.discard_after(2)
        record = memory.get(old.content_hash)
        assert (record.last_iteration, record.win_rate, record.plays, record.outcome, record.evaluations) == \
            (None, None, 0, None, ())
        assert memory.negatives("arithmetic", 5) == []


def test_discard_after_refuses_a_non_integer_iteration(tmp_path: Path) -> None:
    with EnvMemory(tmp_path / "m.sqlite") as memory:
        with pytest.raises(EnvMemoryError, match="iteration must be an integer"):
            memory.discard_after(2.5)  # type: ignore[arg-type]
