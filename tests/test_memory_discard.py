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


def test_discard_after_undoes_a_later_verdict(tmp_path: Path) -> None:
    """A verdict written after the checkpoint's iteration (a program that broke in play, one re-proposed and judged
    again) is undone: the replay's designer prompts must find the program as the uninterrupted run did (a seed while
    it was valid). Two later verdicts go back to the one before both; a verdict at the iteration itself stays."""
    with EnvMemory(tmp_path / "m.sqlite") as memory:
        seed, kept = program(1, iteration=1), program(2, iteration=1)
        memory.propose_many([seed, kept])
        for p in (seed, kept):
            memory.set_validation(p.content_hash, True, iteration=1)
            memory.record_evaluation(p.content_hash, 1, win_rate=0.25, win_rate_hint=1.0, plays=4, hint_plays=2)
        memory.set_validation(kept.content_hash, False, "timeout", iteration=2)
        memory.set_validation(seed.content_hash, True, iteration=3)  # judged again when proposed again
        memory.set_validation(seed.content_hash, False, "program_error", iteration=3)  # then it broke in play
        assert [r.content_hash for r in memory.seeds("arithmetic", 5)] == []
        memory.discard_after(2)
        assert (memory.get(seed.content_hash).status, memory.get(seed.content_hash).reason) == ("valid", None)
        assert (memory.get(kept.content_hash).status, memory.get(kept.content_hash).reason) == ("invalid", "timeout")
        assert [r.content_hash for r in memory.seeds("arithmetic", 5)] == [seed.content_hash]
        memory.set_validation(seed.content_hash, False, "program_error", iteration=3)  # the replay breaks it again
        memory.discard_after(0)  # and a resume from before both: the environments themselves go
        assert len(memory) == 0


def test_set_validation_refuses_a_non_integer_iteration(tmp_path: Path) -> None:
    with EnvMemory(tmp_path / "m.sqlite") as memory:
        p = program(1)
        memory.propose(p)
        with pytest.raises(EnvMemoryError, match="iteration must be an integer"):
            memory.set_validation(p.content_hash, True, iteration=1.5)  # type: ignore[arg-type]


def test_a_memory_written_before_verdicts_were_kept_gets_them(tmp_path: Path) -> None:
    """A run directory from an older spade-mega (no verdicts table) resumes: its writer adds the table, its readers
    need none."""
    path = tmp_path / "m.sqlite"
    p = program(1, iteration=1)
    with EnvMemory(path) as memory:
        memory.propose(p)
        memory.set_validation(p.content_hash, True)
        memory.conn.execute("DROP TABLE verdicts")
    with EnvMemory(path, create=False) as reader:
        assert reader.get(p.content_hash).status == "valid"
    with EnvMemory(path) as memory:
        memory.set_validation(p.content_hash, False, "timeout", iteration=2)
        memory.discard_after(1)
        assert memory.get(p.content_hash).status == "valid"
