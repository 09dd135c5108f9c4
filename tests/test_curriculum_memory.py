"""The environment memory: a real SQLite file, crash safety under SIGKILL, the prompt-facing queries."""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from spade_mega.curriculum.memory import EnvMemory, EnvMemoryError, classify
from spade_mega.envs.program import EnvProgram

TEMPLATE = '''import random


class {name}:
    """{doc}"""

    max_turns = {turns}

    def reset(self, seed: int) -> str:
        self.rng = random.Random(seed)
        self.{field} = self.rng.randint(1, {top})
        self.turn = 0
        return "Guess a number between 1 and {top}."

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.turn += 1
        ok = action.strip() == str(self.{field})
        return "{word}" if ok else "no", float(ok), ok, self.turn >= self.max_turns, {{}}
'''


def program(i: int, skill: str = "arithmetic", **kw) -> EnvProgram:
    # Programs built from different operations so that distinct i are not near-duplicates of each other.
    body = "\n".join(f"    def helper_{j}_{i}(self, x):\n        return x {'+-*%'[j % 4]} {i * 7 + j}\n"
                     for j in range(i % 5 + 1))
    src = TEMPLATE.format(name=f"Game{i}", doc=f"game {i}", turns=3 + i % 7, field="secret", top=10 + i,
                          word=f"yes{i}") + "\n" + body + "\n" + "\n".join(f"CONST_{k} = '{i}-{k}' * {k}"
                                                                           for k in range(i % 13))
    return EnvProgram(src, f"hint {i}", skill, kw or {"origin": "designer", "iteration": i})


@pytest.fixture
def memory(tmp_path: Path) -> EnvMemory:
    with EnvMemory(tmp_path / "memory.sqlite") as mem:
        yield mem


def test_propose_stores_provenance_and_counts_reproposals(memory: EnvMemory) -> None:
    p = EnvProgram(TEMPLATE.format(name="G", doc="d", turns=5, field="s", top=9, word="w"), "h", "logic",
                   {"origin": "designer", "iteration": 4, "document_id": "builtin:maths:00012", "policy_version": 3})
    first = memory.propose(p)
    again = memory.propose(EnvProgram(p.source, p.hint, p.skill, {"iteration": 9}))
    assert first.new and not again.new and first.env_id == again.env_id
    rec = memory.get(p.content_hash)
    assert (rec.document_id, rec.designer_iteration, rec.policy_version) == ("builtin:maths:00012", 4, 3)
    assert rec.proposals == 2 and rec.status == "pending" and rec.program == p
    assert rec.provenance["origin"] == "designer"


def test_renamed_copy_is_a_near_duplicate_with_similarity_one(memory: EnvMemory) -> None:
    original = EnvProgram(TEMPLATE.format(name="Guess", doc="one", turns=5, field="secret", top=50, word="ok"),
                          "bisect", "arithmetic")
    renamed = EnvProgram(TEMPLATE.format(name="Oracle", doc="another docstring", turns=5, field="hidden", top=50,
                                         word="ok").replace("    def", "    # a comment\n    def"), "x", "logic")
    memory.propose(original)
    prop = memory.propose(renamed)
    assert prop.new and prop.duplicate_of == original.content_hash and prop.similarity == 1.0
    assert memory.near_duplicates(renamed.source)[0] == (original.content_hash, 1.0)


def test_similar_but_not_identical_program_is_found_by_similarity(memory: EnvMemory) -> None:
    base = TEMPLATE.format(name="Guess", doc="one", turns=5, field="secret", top=50, word="ok")
    memory.propose(EnvProgram(base, "h", "arithmetic"))
    variant = base.replace('"no"', '"no, try again"')
    matches = memory.near_duplicates(variant)
    assert matches and matches[0][0] == EnvProgram(base, "h", "arithmetic").content_hash and 0.9 <= matches[0][1] < 1
    unrelated = memory.near_duplicates("def f(a, b):\n    return sorted(a)[b]\n")
    assert unrelated == []


def test_distinct_programs_are_not_duplicates(memory: EnvMemory) -> None:
    props = memory.propose_many(program(i) for i in range(30))
    assert all(p.new for p in props)
    assert sum(p.duplicate_of is not None for p in props) == 0


def test_validation_and_evaluations(memory: EnvMemory) -> None:
    p = program(1)
    memory.propose(p)
    memory.set_validation(p.content_hash, False, "nondeterministic_reset")
    assert memory.get(p.content_hash).status == "invalid"
    memory.set_validation(p.content_hash, True)
    memory.record_evaluation(p.content_hash, 4, win_rate=0.25, win_rate_hint=0.75, plays=16, hint_plays=16)
    memory.record_evaluation(p.content_hash, 8, win_rate=0.5, win_rate_hint=0.625, plays=16, hint_plays=16)
    memory.record_evaluation(p.content_hash, 8, win_rate=0.5, win_rate_hint=0.625, plays=16, hint_plays=16)  # again
    memory.set_designer_reward(p.content_hash, 4, 0.9)
    rec = memory.get(p.content_hash[:10])
    assert [e.iteration for e in rec.evaluations] == [4, 8]
    assert rec.evaluations[0].regret == 0.5 and rec.evaluations[0].designer_reward == 0.9
    assert (rec.last_iteration, rec.win_rate, rec.regret, rec.plays, rec.hint_plays) == (8, 0.5, 0.125, 32, 32)
    assert rec.outcome == "frontier" and rec.status == "valid" and rec.reason is None
    with pytest.raises(EnvMemoryError, match="no evaluation at iteration 5"):
        memory.set_designer_reward(p.content_hash, 5, 0.1)


def test_classify_thresholds() -> None:
    assert classify(0.9, 0.95, 0.05) == "mastered"
    assert classify(0.1, 0.1, 0.0) == "unsolvable"
    assert classify(0.1, 0.6, 0.5) == "frontier"
    assert classify(0.5, 0.4, -0.1) == "other"


def _play(memory: EnvMemory, p: EnvProgram, iteration: int, w: float, wh: float, valid: bool = True) -> None:
    memory.propose(p)
    memory.set_validation(p.content_hash, valid, None if valid else "syntax")
    memory.record_evaluation(p.content_hash, iteration, w, wh, 8, 8)


def test_seeds_are_top_regret_valid_of_the_skill_within_the_window(memory: EnvMemory) -> None:
    regrets = {}
    for i in range(12):
        w, wh = 0.1, 0.1 + 0.05 * i
        _play(memory, program(i), iteration=i, w=w, wh=wh, valid=i != 11)  # i=11 has top regret but is invalid
        regrets[program(i).content_hash] = wh - w
    _play(memory, program(50, skill="logic"), 3, 0.0, 1.0)  # other skill
    seeds = memory.seeds("arithmetic", 3)
    assert [s.content_hash for s in seeds] == [program(i).content_hash for i in (10, 9, 8)]
    assert all(s.skill == "arithmetic" and s.status == "valid" for s in seeds)
    # A window of the 4 most recently played: iterations 11, 10, 9 and the logic one at 3 are out... 8 is in.
    windowed = memory.seeds("arithmetic", 10, window=4)
    assert {s.content_hash for s in windowed} == {program(i).content_hash for i in (10, 9, 8)}


def test_negatives_mix_mastered_and_unsolvable(memory: EnvMemory) -> None:
    for i in range(4):
        _play(memory, program(i), i, 0.95, 1.0)  # mastered
    for i in range(4, 6):
        _play(memory, program(i), i, 0.0, 0.05)  # unsolvable
    _play(memory, program(6), 6, 0.3, 0.8)  # frontier: never a negative
    neg = memory.negatives("arithmetic", 4)
    assert [n.outcome for n in neg] == ["mastered", "unsolvable", "mastered", "unsolvable"]
    assert memory.negatives("arithmetic", 6)[-2:][0].outcome == "mastered"
    assert len(memory.negatives("arithmetic", 20)) == 6
    assert memory.negatives("logic", 3) == []


def test_recent_stats_and_export(memory: EnvMemory) -> None:
    for i in range(5):
        _play(memory, program(i), i, [0.0, 0.5, 0.9, 1.0, 0.1][i], [0.2, 0.9, 0.9, 1.0, 0.1][i])
    memory.propose(program(99))
    assert [r.content_hash for r in memory.recent(2)] == [program(99).content_hash, program(4).content_hash]
    stats = memory.stats()
    assert stats["environments"] == 6 and stats["played"] == 5 and stats["by_status"] == {"valid": 5, "pending": 1}
    assert stats["learnable_fraction"] == pytest.approx(3 / 5)  # 0.5, 0.9, 0.1
    assert stats["positive_regret_fraction"] == pytest.approx(2 / 5)
    assert stats["difficulty"]["easy"] == pytest.approx(2 / 5) and stats["difficulty"]["hard"] == pytest.approx(2 / 5)
    out = io.StringIO()
    assert memory.export_jsonl(out) == 6
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["content_hash"] for r in rows] == [program(i).content_hash for i in (0, 1, 2, 3, 4, 99)]
    assert rows[1]["evaluations"] == [{"iteration": 1, "win_rate": 0.5, "win_rate_hint": 0.9,
                                       "regret": pytest.approx(0.4), "designer_reward": None, "plays": 8,
                                       "hint_plays": 8}]
    assert rows[5]["evaluations"] == [] and EnvProgram.from_dict(rows[5]) == program(99)


def test_reopen_keeps_everything_and_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "m.sqlite"
    with EnvMemory(path) as mem:
        _play(mem, program(1), 1, 0.2, 0.7)
    with EnvMemory(path, create=False) as mem:
        assert len(mem) == 1 and mem.get(program(1).content_hash).regret == pytest.approx(0.5)
        assert mem.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_for_run_uses_the_configured_path(tmp_path: Path) -> None:
    from spade_mega.config import load_config

    cfg = load_config(None, ["curriculum.memory.path=state/mem.sqlite", "curriculum.memory.synchronous=normal"])
    with EnvMemory.for_run(cfg.curriculum.memory, tmp_path) as mem:
        mem.propose(program(1))
        assert mem.conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    assert (tmp_path / "state" / "mem.sqlite").is_file()


def test_bad_files_and_hashes_give_clear_errors(tmp_path: Path, memory: EnvMemory) -> None:
    with pytest.raises(EnvMemoryError, match="no memory database"):
        EnvMemory(tmp_path / "absent.sqlite", create=False)
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(EnvMemoryError, match="not a usable memory database"):
        EnvMemory(junk)
    newer = tmp_path / "newer.sqlite"
    sqlite3.connect(newer).execute("PRAGMA user_version=99").connection.close()
    with pytest.raises(EnvMemoryError, match="newer"):
        EnvMemory(newer)
    memory.propose(program(1))
    for key, message in (("zz", "not a content hash"), ("0000", "no environment"), ("0" * 64, "no environment")):
        with pytest.raises(EnvMemoryError, match=message):
            memory.get(key)


def test_ambiguous_prefix_is_an_error(memory: EnvMemory) -> None:
    by_prefix: dict[str, EnvProgram] = {}
    for i in range(100_000):  # find two programs whose hashes share 4 leading hex digits (birthday bound ~300)
        p = EnvProgram("class A: pass\n", f"hint {i}", "logic")
        other = by_prefix.setdefault(p.content_hash[:4], p)
        if other is not p:
            break
    memory.propose_many([other, p])
    with pytest.raises(EnvMemoryError, match="ambiguous"):
        memory.get(p.content_hash[:4])
    assert memory.get(p.content_hash[:12]).hint == p.hint


WRITER = textwrap.dedent("""
    import sys
    from spade_mega.curriculum.memory import EnvMemory
    from spade_mega.envs.program import EnvProgram

    BATCH = 5
    memory = EnvMemory(sys.argv[1])
    for batch in range(100000):
        programs = [EnvProgram(f"class G{batch}_{k}:\\n    def reset(self, seed):\\n        return '{k}' * {batch}\\n"
                               f"    def step(self, a):\\n        return ('', 0.0, True, False, {{}})\\n" + "# pad\\n" * k,
                               f"hint {batch} {k}", "logic") for k in range(BATCH)]
        memory.propose_many(programs)  # one transaction of BATCH rows (plus LSH rows)
        memory.record_evaluation(programs[0].content_hash, batch, 0.25, 0.75, 4, 4)
        print(batch, *[p.content_hash for p in programs], flush=True)  # after both commits
""")


def test_sigkill_mid_write_loses_nothing_committed_and_never_corrupts(tmp_path: Path) -> None:
    db = tmp_path / "memory.sqlite"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    committed: list[list[str]] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            committed.append(line.split()[1:])
            if len(committed) >= 60:
                break
        time.sleep(0.013)  # let it get into the middle of further transactions
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL and len(committed) == 60

    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    with EnvMemory(db, create=False) as mem:
        for hashes in committed:
            assert all(h in mem for h in hashes)
            assert mem.get(hashes[0]).regret == pytest.approx(0.5)
        stored = len(mem)
        assert stored % 5 == 0 and stored >= 5 * len(committed)  # whole transactions only, never a partial one
        n_lsh = mem.conn.execute("SELECT COUNT(DISTINCT env_id) FROM lsh").fetchone()[0]
        assert n_lsh == stored
        mem.propose(EnvProgram("class After: pass\n", "h", "logic"))  # and it takes new writes
        assert len(mem) == stored + 1


@pytest.mark.parametrize("create", [True, False])
def test_another_programs_database_is_refused_and_left_untouched(tmp_path: Path, create: bool) -> None:
    # A mistyped --run or curriculum.memory.path pointing at someone else's SQLite file: refuse it by name, and do not
    # add our tables, stamp our schema version or switch it to WAL.
    foreign = tmp_path / "app.sqlite"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO users VALUES (1, 'ada')")
    conn.commit()
    conn.close()
    before = foreign.read_bytes()
    with pytest.raises(EnvMemoryError, match="not a spade-mega memory database.*users"):
        EnvMemory(foreign, create=create)
    assert foreign.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.sqlite"]


def test_reader_does_not_initialise_an_empty_file(tmp_path: Path) -> None:
    empty = tmp_path / "memory.sqlite"
    empty.touch()
    with pytest.raises(EnvMemoryError, match="holds no environment memory"):
        EnvMemory(empty, create=False)
    assert empty.read_bytes() == b""
    with EnvMemory(empty) as mem:  # the writer does initialise it
        mem.propose(program(1))
    with EnvMemory(empty, create=False) as mem:
        assert len(mem) == 1


def test_a_directory_in_place_of_the_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "memory.sqlite").mkdir()
    with pytest.raises(EnvMemoryError, match="memory.sqlite: cannot open the memory database"):
        EnvMemory(tmp_path / "memory.sqlite")


def test_stats_read_while_the_trainer_writes_are_one_consistent_snapshot(tmp_path: Path) -> None:
    # `spade-mega memory stats` runs beside the trainer: a write landing between its queries must not make the totals
    # disagree (environments vs per-status and per-skill counts). The write is injected between the reader's queries.
    path = tmp_path / "memory.sqlite"
    with EnvMemory(path) as writer, EnvMemory(path, create=False) as reader:
        writer.propose_many([program(i) for i in range(3)])
        queries = []

        def write_between_queries(sql: str) -> None:
            if sql.lstrip().upper().startswith("SELECT"):
                queries.append(sql)
                if len(queries) == 2:
                    writer.propose(program(50, skill="logic"))

        reader.conn.set_trace_callback(write_between_queries)
        stats = reader.stats()
        reader.conn.set_trace_callback(None)
        assert len(queries) > 2 and len(writer) == 4  # the write did land in the middle
        assert sum(stats["by_status"].values()) == sum(stats["by_skill"].values()) == stats["environments"]
        record = reader.get(program(0).content_hash)
        assert reader.stats()["environments"] == 4 and record.proposals == 1


def test_non_finite_play_results_are_refused_by_name_and_store_nothing(memory: EnvMemory) -> None:
    # A win rate over zero plays is 0/0 = nan upstream; SQLite would store nan as NULL (a raw IntegrityError here, a
    # silently missing designer reward there). Refuse it with the field's name; the stored history stays as it was.
    p = program(1)
    memory.propose(p)
    _play(memory, p, 1, 0.25, 0.75)
    for kwargs, name in (({"win_rate": float("nan")}, "win_rate"), ({"win_rate_hint": float("inf")}, "win_rate_hint"),
                         ({"regret": float("nan")}, "regret"), ({"designer_reward": float("-inf")}, "designer_reward"),
                         ({"plays": -1}, "plays")):
        args = {"win_rate": 0.5, "win_rate_hint": 0.5, "plays": 4, "hint_plays": 4, **kwargs}
        with pytest.raises(EnvMemoryError, match=f"{name} must be"):
            memory.record_evaluation(p.content_hash, 2, **args)
    with pytest.raises(EnvMemoryError, match="designer_reward must be"):
        memory.set_designer_reward(p.content_hash, 1, float("nan"))
    record = memory.get(p.content_hash)
    assert [e.iteration for e in record.evaluations] == [1] and record.designer_reward is None
    assert record.win_rate == 0.25 and record.regret == pytest.approx(0.5)


def test_a_seed_is_never_also_a_negative(memory: EnvMemory) -> None:
    # Seeds are frontier environments ("hard alone, solvable with the hint"). A mastered one whose hint still adds a
    # little (0.85 -> 1.0) or an unsolvable one with a sliver of regret (0.05 -> 0.15) has positive regret too, but
    # showing it both as an example to follow and as one "not to repeat" contradicts the prompt.
    _play(memory, program(1), 1, 0.85, 1.0)  # mastered, regret 0.15
    _play(memory, program(2), 2, 0.05, 0.15)  # unsolvable, regret 0.10
    _play(memory, program(3), 3, 0.3, 0.4)  # frontier, regret 0.10
    seeds = memory.seeds("arithmetic", 5)
    negatives = memory.negatives("arithmetic", 5)
    assert [s.content_hash for s in seeds] == [program(3).content_hash]
    assert {n.content_hash for n in negatives} == {program(1).content_hash, program(2).content_hash}
    assert [s.content_hash for s in memory.seeds("arithmetic", 5, window=200)] == [program(3).content_hash]


def test_a_failed_commit_rolls_back_and_later_writes_still_commit(tmp_path: Path) -> None:
    # When COMMIT itself fails (disk full, I/O error; injected here by denying it once), SQLite can leave the
    # transaction open. Every later write would then join it and never commit: invisible to readers, lost on a crash.
    path = tmp_path / "memory.sqlite"
    denied = []

    def deny_first_commit(action: int, arg1: str | None, *_: object) -> int:
        if action == sqlite3.SQLITE_TRANSACTION and arg1 == "COMMIT" and not denied:
            denied.append(arg1)
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK

    with EnvMemory(path) as mem, EnvMemory(path, create=False) as reader:
        mem.conn.set_authorizer(deny_first_commit)
        with pytest.raises(sqlite3.DatabaseError):
            mem.propose(program(1))  # the write in flight is lost...
        assert denied and not mem.conn.in_transaction
        mem.propose(program(2))  # ...and the next one commits
        assert program(2).content_hash in reader and program(1).content_hash not in reader


def test_a_file_in_place_of_the_parent_folder_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("not a folder")
    with pytest.raises(EnvMemoryError, match="cannot create the folder"):
        EnvMemory(tmp_path / "run" / "memory.sqlite")


def test_a_second_process_reads_while_the_trainer_writes(tmp_path: Path) -> None:
    # `spade-mega memory stats` beside a running trainer: never "database is locked", never a partial transaction
    # (environments arrive in whole batches of 5), totals only grow, and the writer is never held up.
    db = tmp_path / "memory.sqlite"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # the database exists and holds a first batch
        seen = []
        for _ in range(30):
            with EnvMemory(db, create=False) as reader:
                stats = reader.stats()
                seen.append(stats["environments"])
                assert stats["environments"] % 5 == 0 and sum(stats["by_status"].values()) == stats["environments"]
                assert len(reader.recent(5)) == 5
        assert proc.poll() is None  # the writer kept going all along
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert seen == sorted(seen) and seen[-1] > seen[0]


def test_numpy_play_results_are_stored_as_numbers_not_bytes(memory: EnvMemory) -> None:
    # Play results usually come out of numpy (np.sum of wins, np.float32 rates, an np.int64 iteration counter).
    # sqlite3 binds numpy scalars through the buffer protocol, as BLOBs: plays became 8 raw bytes, an iteration
    # blob sorted after every integer (so it posed as the latest evaluation), a float32 rate crashed the refresh.
    p = program(1)
    memory.propose(p)
    memory.set_validation(p.content_hash, True)
    memory.record_evaluation(p.content_hash, np.int64(3), np.float32(0.25), np.float64(0.75), np.int64(16),
                             np.int32(16), designer_reward=np.float32(0.5))
    memory.record_evaluation(p.content_hash, 4, 0.5, 0.5, 16, 16)
    memory.set_designer_reward(p.content_hash, np.int64(4), np.float32(-0.25))
    record = memory.get(p.content_hash)
    assert [(e.iteration, e.win_rate, e.plays, e.hint_plays, e.designer_reward) for e in record.evaluations] == [
        (3, 0.25, 16, 16, 0.5), (4, 0.5, 16, 16, -0.25)]
    assert all(type(e.iteration) is int and type(e.plays) is int for e in record.evaluations)
    assert (record.last_iteration, record.plays, record.hint_plays, record.outcome) == (4, 32, 32, "other")
    for bad in (1.5, True, "3", None):
        with pytest.raises(EnvMemoryError, match="iteration must be an integer"):
            memory.record_evaluation(p.content_hash, bad, 0.5, 0.5, 16, 16)
    assert len(memory.get(p.content_hash).evaluations) == 2


def test_provenance_numbers_of_any_kind_fill_the_columns_or_stay_in_the_json(memory: EnvMemory) -> None:
    # The provenance iteration may be an np.int64 (kept as a number) or a value that is no SQLite integer
    # (nan, 2**70): the proposal must still be stored, with the value kept in the provenance JSON.
    a = program(1, origin="designer", iteration=np.int64(7), policy_version=np.int32(2))
    b = program(2, origin="designer", iteration=float("nan"), policy_version=2 ** 70)
    memory.propose_many([a, b])
    ra, rb = memory.get(a.content_hash), memory.get(b.content_hash)
    assert (ra.designer_iteration, ra.policy_version) == (7, 2)
    assert (rb.designer_iteration, rb.policy_version) == (None, None) and rb.provenance["policy_version"] == 2 ** 70


@pytest.mark.parametrize("version", [1, 7])
def test_a_foreign_database_with_a_user_version_is_refused_and_left_untouched(tmp_path: Path, version: int) -> None:
    # Many programs stamp PRAGMA user_version; one that uses 1 looked like our schema (WAL switched on, then a raw
    # "no such table" on the first write), one above 1 was told to upgrade spade-mega.
    foreign = tmp_path / "app.sqlite"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute(f"PRAGMA user_version = {version}")
    conn.commit()
    conn.close()
    before = foreign.read_bytes()
    for create in (True, False):
        with pytest.raises(EnvMemoryError, match="not a spade-mega memory database.*users"):
            EnvMemory(foreign, create=create)
    assert foreign.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.sqlite"]


def test_an_evaluation_without_a_measured_hint_play_records_no_hint_rate_and_no_regret(memory: EnvMemory) -> None:
    """No hint play measured the agent (none configured, or every one broken by its program): the win rate with the
    hint and the regret are not known and stored NULL. Before, the loop copied the agent's win rate into the hint's
    and recorded a regret of 0, which classified an environment the agent never won as unsolvable even with the hint
    (the designer's negative example) and entered the stats' hint and regret means."""
    p = program(1)
    memory.propose(p)
    memory.set_validation(p.content_hash, True)
    memory.record_evaluation(p.content_hash, 2, win_rate=0.0, win_rate_hint=None, plays=4, hint_plays=0)
    record = memory.get(p.content_hash)
    (evaluation,) = record.evaluations
    assert (evaluation.win_rate, evaluation.win_rate_hint, evaluation.regret) == (0.0, None, None)
    assert (record.win_rate, record.win_rate_hint, record.regret, record.outcome) == (0.0, None, None, "other")
    assert memory.negatives("arithmetic", 5) == [] and memory.seeds("arithmetic", 5) == []
    assert memory.stats()["mean_win_rate_hint"] is None and memory.stats()["mean_regret"] is None
    assert classify(0.0, None, None) == "other" and classify(0.9, None, None) == "mastered"
    for regret, hint_plays in ((0.0, 0), (None, 2)):  # a regret or hint plays without a rate with the hint
        with pytest.raises(EnvMemoryError, match="without a win rate with the hint"):
            memory.record_evaluation(p.content_hash, 3, 0.0, None, 4, hint_plays, regret=regret)


def test_a_database_written_before_gets_nullable_hint_columns_and_keeps_its_rows(tmp_path: Path) -> None:
    """Its evaluations table held the hint columns NOT NULL: a writer opening it rebuilds the table without the
    constraint (rows unchanged) and can record an evaluation without hint plays; a reader leaves it as it is."""
    from spade_mega.curriculum import memory as module

    path, p = tmp_path / "old.sqlite", program(1)
    with EnvMemory(path) as memory:
        memory.propose(p)
        memory.record_evaluation(p.content_hash, 1, 0.25, 0.75, 4, 4)
        before = memory.get(p.content_hash)
    table = module._EVALUATIONS_NULLABLE[1]
    old = table.replace("win_rate_hint REAL,", "win_rate_hint REAL NOT NULL,").replace("regret REAL,",
                                                                                       "regret REAL NOT NULL,")
    assert old != table
    conn = sqlite3.connect(path)  # the table as an older spade-mega wrote it
    conn.executescript("BEGIN; " + old.replace("IF NOT EXISTS evaluations", "old_evaluations") +
                       "INSERT INTO old_evaluations SELECT * FROM evaluations; DROP TABLE evaluations; "
                       "ALTER TABLE old_evaluations RENAME TO evaluations; COMMIT;")
    conn.close()

    def constrained() -> list[str]:
        with sqlite3.connect(path) as conn:
            return [row[1] for row in conn.execute("PRAGMA table_info(evaluations)") if row[3]]

    assert "win_rate_hint" in constrained() and "regret" in constrained()
    with EnvMemory(path, create=False) as reader:
        assert reader.get(p.content_hash) == before
    assert "win_rate_hint" in constrained()  # a reader writes nothing
    with EnvMemory(path) as memory:
        assert memory.get(p.content_hash) == before
        memory.record_evaluation(p.content_hash, 2, 0.5, None, 4, 0)
        assert [(e.win_rate_hint, e.regret) for e in memory.get(p.content_hash).evaluations] == \
            [(0.75, 0.5), (None, None)]
    assert constrained() == ["env_id", "iteration", "win_rate", "plays", "hint_plays"]
