"""The environment memory: every environment ever proposed, its validation, its per-iteration play results.

The reference SPADE code keeps the last 200 environments in a JSON file; a crash while writing it loses the file and
the history is gone for good. Here it is a SQLite database in WAL mode: each public write is one transaction, so a
crash (even SIGKILL) loses at most the write in flight and never corrupts the file; storage is unlimited and the
prompt-facing queries are served by indexes (a few milliseconds at millions of rows, see tools/bench/memory.py).

WAL readers and the writer share an index through shared memory (the ``-shm`` file), which network filesystems
(NFS, Lustre) do not keep coherent across hosts: run ``spade-mega memory`` on the trainer's node, or on a copy of the
database taken there with ``sqlite3 memory.sqlite ".backup copy.sqlite"``, never from another host against the live
file.

What the designer prompt sees is a *window*: seeds and negatives are drawn from the ``prompt_window`` most recently
played environments (reference: 200), so the prompt follows the moving frontier while nothing is ever deleted.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Literal, Sequence

import numpy as np

from spade_mega.config.schema import MemoryConfig
from spade_mega.curriculum.diversity import EASY_ABOVE, HARD_BELOW
from spade_mega.curriculum.fingerprint import MinHasher, program_fingerprint
from spade_mega.envs.program import EnvProgram
from spade_mega.errors import SpadeError

SCHEMA_VERSION = 1
Outcome = Literal["frontier", "mastered", "unsolvable", "other"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS environments (
    id INTEGER PRIMARY KEY,
    content_hash TEXT NOT NULL UNIQUE,
    ast_hash TEXT,
    skill TEXT NOT NULL,
    source TEXT NOT NULL,
    hint TEXT NOT NULL,
    document_id TEXT,
    designer_iteration INTEGER,
    policy_version INTEGER,
    provenance TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'valid', 'invalid')),
    reason TEXT,
    proposals INTEGER NOT NULL DEFAULT 1,
    duplicate_of TEXT,
    similarity REAL,
    created_at REAL NOT NULL,
    signature BLOB NOT NULL,
    last_iteration INTEGER,
    win_rate REAL,
    win_rate_hint REAL,
    regret REAL,
    designer_reward REAL,
    plays INTEGER NOT NULL DEFAULT 0,
    hint_plays INTEGER NOT NULL DEFAULT 0,
    outcome TEXT
);
CREATE TABLE IF NOT EXISTS evaluations (
    env_id INTEGER NOT NULL REFERENCES environments(id),
    iteration INTEGER NOT NULL,
    win_rate REAL NOT NULL,
    win_rate_hint REAL,
    regret REAL,
    designer_reward REAL,
    plays INTEGER NOT NULL,
    hint_plays INTEGER NOT NULL,
    PRIMARY KEY (env_id, iteration)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS lsh (
    band_key INTEGER NOT NULL,
    env_id INTEGER NOT NULL,
    PRIMARY KEY (band_key, env_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS env_seeds ON environments (skill, regret) WHERE status = 'valid' AND regret > 0;
CREATE INDEX IF NOT EXISTS env_outcome ON environments (skill, outcome, last_iteration);
CREATE INDEX IF NOT EXISTS env_recent ON environments (last_iteration, id) WHERE last_iteration IS NOT NULL;
CREATE INDEX IF NOT EXISTS env_ast ON environments (ast_hash);
"""

# The verdict each later one replaced (set_validation with an iteration), for discard_after. Every writer creates it
# when it opens the database, so that one written by an older spade-mega gets it too (a table added: it still reads).
_VERDICTS = """
CREATE TABLE IF NOT EXISTS verdicts (
    env_id INTEGER NOT NULL REFERENCES environments(id),
    iteration INTEGER NOT NULL,
    prior_status TEXT NOT NULL,
    prior_reason TEXT
)"""

# An evaluation no hint play measured (none configured, or every one broken by its program) has no win rate with the
# hint and no regret: NULL, not the agent's win rate copied and a regret of 0. A database written before kept them
# NOT NULL; every writer opening it rebuilds the table without the constraint (its rows unchanged), as it adds
# verdicts: an older spade-mega still reads it.
_EVALUATIONS_NULLABLE = ("evaluations_nullable", _SCHEMA[_SCHEMA.index("CREATE TABLE IF NOT EXISTS evaluations"):
                                                          _SCHEMA.index("CREATE TABLE IF NOT EXISTS lsh")])

# Every column but the MinHash signature: what records carry.
_COLUMNS = ("id, content_hash, ast_hash, skill, source, hint, document_id, designer_iteration, policy_version, "
            "provenance, status, reason, proposals, duplicate_of, similarity, created_at, last_iteration, win_rate, "
            "win_rate_hint, regret, designer_reward, plays, hint_plays, outcome")


class EnvMemoryError(SpadeError):
    """The memory database cannot be opened or does not hold what was asked for."""


@dataclass(frozen=True)
class Evaluation:
    iteration: int
    win_rate: float
    win_rate_hint: float | None  # None (and regret None): no hint play measured the agent
    regret: float | None
    designer_reward: float | None
    plays: int
    hint_plays: int


@dataclass(frozen=True)
class EnvRecord:
    """One stored environment; the play columns hold its latest evaluation (None until it is played)."""

    id: int
    content_hash: str
    ast_hash: str | None
    skill: str
    source: str
    hint: str
    document_id: str | None
    designer_iteration: int | None
    policy_version: int | None
    provenance: dict[str, Any]
    status: str
    reason: str | None
    proposals: int
    duplicate_of: str | None
    similarity: float | None
    created_at: float
    last_iteration: int | None
    win_rate: float | None
    win_rate_hint: float | None
    regret: float | None
    designer_reward: float | None
    plays: int
    hint_plays: int
    outcome: str | None
    evaluations: tuple[Evaluation, ...] = field(default=())

    @property
    def program(self) -> EnvProgram:
        return EnvProgram(self.source, self.hint, self.skill, dict(self.provenance))

    def to_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in _COLUMNS.split(", ")}
        data["evaluations"] = [vars(e) for e in self.evaluations]
        return data


@dataclass(frozen=True)
class Proposal:
    """What :meth:`EnvMemory.propose` found: the row, whether it is new, and its nearest earlier near-duplicate."""

    env_id: int
    content_hash: str
    new: bool
    duplicate_of: str | None
    similarity: float | None


def classify(win_rate: float, win_rate_hint: float | None, regret: float | None) -> Outcome:
    """Mastered: the agent alone wins (win rate > 0.8). Unsolvable: it fails even with the hint (< 0.2 both).
    Frontier: the hint helps (positive regret). The thresholds are the difficulty buckets of ``diversity.py``; the
    rates are win rates (episodes with a reward >= ``rewards.win_threshold``, see ``curriculum/rewards.py``), regret
    a difference of mean returns, so shaped rewards classify by wins, as 0/1 rewards do. Not measured with the hint
    (None): neither unsolvable nor frontier."""
    if win_rate > EASY_ABOVE:
        return "mastered"
    if win_rate_hint is None or regret is None:
        return "other"
    if win_rate < HARD_BELOW and win_rate_hint < HARD_BELOW:
        return "unsolvable"
    return "frontier" if regret > 0 else "other"


def _record(row: sqlite3.Row, evaluations: Sequence[Evaluation] = ()) -> EnvRecord:
    data = dict(row)
    data["provenance"] = json.loads(data["provenance"])
    return EnvRecord(**data, evaluations=tuple(evaluations))


class EnvMemory:
    """The memory database of one run. One writer (the trainer) and any number of readers (``spade-mega memory``)."""

    def __init__(self, path: str | Path, synchronous: str = "full", near_duplicate_threshold: float = 0.9,
                 create: bool = True) -> None:
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise EnvMemoryError(f"{self.path}: no memory database here (a run writes it as "
                                 "curriculum.memory.path inside its run directory)")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EnvMemoryError(f"{self.path}: cannot create the folder of the memory database ({exc})") from None
        self.threshold = near_duplicate_threshold
        self.hasher = MinHasher(num_perm=64, bands=8)
        try:
            # the loop's background rollout (selfplay.async_rollouts) writes from another thread than the one that
            # opened it; the loop never lets two threads use it at once
            self.conn = sqlite3.connect(self.path, isolation_level=None, timeout=30.0, check_same_thread=False)
        except sqlite3.DatabaseError as exc:
            raise EnvMemoryError(f"{self.path}: cannot open the memory database ({exc})") from None
        try:
            self.conn.row_factory = sqlite3.Row
            if self._version() < SCHEMA_VERSION:
                self._initialise(create)
            if create:
                self.conn.execute(_VERDICTS)
                self._evaluations_nullable()
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute(f"PRAGMA synchronous={'FULL' if synchronous == 'full' else 'NORMAL'}")
            self.conn.execute("PRAGMA foreign_keys=ON")
        except sqlite3.DatabaseError as exc:
            self.conn.close()
            raise EnvMemoryError(f"{self.path}: not a usable memory database ({exc})") from None
        except BaseException:
            self.conn.close()
            raise

    def _version(self) -> int:
        version = int(self.conn.execute("PRAGMA user_version").fetchone()[0])
        if version > 0 and "environments" not in self._tables():  # many programs stamp a user_version of their own
            raise self._foreign(version)
        if version > SCHEMA_VERSION:
            raise EnvMemoryError(f"{self.path}: memory schema version {version} is newer than this spade-mega "
                                 f"understands ({SCHEMA_VERSION}); upgrade spade-mega")
        return version

    def _initialise(self, create: bool) -> None:
        """Create the schema in an empty database, under the write lock; never touch a database that holds tables
        of some other program (a mistyped path must not get our tables, our version stamp or WAL mode)."""
        self.conn.execute("BEGIN IMMEDIATE" if create else "BEGIN")  # a reader never takes the write lock
        try:
            if self._version() < SCHEMA_VERSION:  # re-read under the lock: another process may have just created it
                if self._tables():
                    raise self._foreign(0)
                if not create:
                    raise EnvMemoryError(f"{self.path}: holds no environment memory yet (empty database)")
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        self.conn.execute(statement)
                self.conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def _evaluations_nullable(self) -> None:
        """Rebuild an older database's evaluations table without NOT NULL on the hint columns (_EVALUATIONS_NULLABLE),
        under the write lock, in one transaction."""
        def constrained() -> bool:
            return any(row["name"] == "win_rate_hint" and row["notnull"]
                       for row in self.conn.execute("PRAGMA table_info(evaluations)"))

        if not constrained():
            return
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            if constrained():  # re-read under the lock: another writer may have just rebuilt it
                name, create = _EVALUATIONS_NULLABLE
                self.conn.execute(create.replace("IF NOT EXISTS evaluations", name).rstrip().rstrip(";"))
                self.conn.execute(f"INSERT INTO {name} SELECT * FROM evaluations")
                self.conn.execute("DROP TABLE evaluations")
                self.conn.execute(f"ALTER TABLE {name} RENAME TO evaluations")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def _tables(self) -> list[str]:
        return [r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]

    def _foreign(self, version: int) -> EnvMemoryError:
        what = f"schema version {version} is not ours" if version else "no memory schema version"
        return EnvMemoryError(f"{self.path}: not a spade-mega memory database (it holds tables "
                              f"{', '.join(self._tables()[:10])}, {what}); point at the run's memory file "
                              "(curriculum.memory.path)")

    @classmethod
    def for_run(cls, cfg: MemoryConfig, run_dir: str | Path) -> "EnvMemory":
        """The memory of a run: ``curriculum.memory.path`` inside the run directory (or absolute)."""
        return cls(Path(run_dir) / cfg.path, synchronous=cfg.synchronous,
                   near_duplicate_threshold=cfg.near_duplicate_threshold)

    # -------------------------------------------------------------------------------------------------- plumbing
    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "EnvMemory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    class _Transaction:
        def __init__(self, conn: sqlite3.Connection, begin: str | None) -> None:
            self.conn, self.begin = conn, begin  # begin: None joins the transaction already open

        def __enter__(self) -> sqlite3.Connection:
            if self.begin:
                self.conn.execute(self.begin)
            return self.conn

        def __exit__(self, exc_type: Any, *_: object) -> None:
            if not self.begin:
                return
            if exc_type is None:
                try:
                    self.conn.execute("COMMIT")
                    return
                except BaseException:
                    # A failed COMMIT (disk full, I/O error) can leave the transaction open; every later write
                    # would join it and never commit. Lose only this one.
                    if self.conn.in_transaction:
                        self.conn.execute("ROLLBACK")
                    raise
            if self.conn.in_transaction:  # SQLite may already have rolled back on the error
                self.conn.execute("ROLLBACK")

    def _write(self) -> "EnvMemory._Transaction":
        """One write transaction (BEGIN IMMEDIATE ... COMMIT): all of it lands, or none of it."""
        return self._Transaction(self.conn, None if self.conn.in_transaction else "BEGIN IMMEDIATE")

    def _snapshot(self) -> "EnvMemory._Transaction":
        """One read transaction: its queries all see the same committed state while the trainer writes (WAL)."""
        return self._Transaction(self.conn, None if self.conn.in_transaction else "BEGIN")

    def _resolve(self, key: str) -> int:
        """Row id for a full content hash or a unique prefix (at least 4 characters), like git."""
        if len(key) == 64:
            row = self.conn.execute("SELECT id FROM environments WHERE content_hash = ?", (key,)).fetchone()
        elif len(key) >= 4 and all(c in "0123456789abcdef" for c in key):
            rows = self.conn.execute("SELECT id FROM environments WHERE content_hash >= ? AND content_hash < ? "
                                     "LIMIT 2", (key, key + "g")).fetchall()
            if len(rows) > 1:
                raise EnvMemoryError(f"hash prefix {key!r} is ambiguous; give more characters")
            row = rows[0] if rows else None
        else:
            raise EnvMemoryError(f"{key!r} is not a content hash (64 hex characters, or a prefix of at least 4)")
        if row is None:
            raise EnvMemoryError(f"no environment with hash {key!r} in {self.path}")
        return int(row[0])

    # ----------------------------------------------------------------------------------------------------- writes
    def propose(self, program: EnvProgram) -> Proposal:
        """Store a proposed environment (or count a re-proposal) and report its nearest earlier near-duplicate."""
        return self.propose_many([program])[0]

    def propose_many(self, programs: Iterable[EnvProgram]) -> list[Proposal]:
        """Store many proposals in one transaction (one regeneration's worth)."""
        out = []
        with self._write() as conn:
            for program in programs:
                out.append(self._propose(conn, program))
        return out

    def _propose(self, conn: sqlite3.Connection, program: EnvProgram) -> Proposal:
        digest = program.content_hash
        row = conn.execute("SELECT id, duplicate_of, similarity FROM environments WHERE content_hash = ?",
                           (digest,)).fetchone()
        if row is not None:
            conn.execute("UPDATE environments SET proposals = proposals + 1 WHERE id = ?", (row[0],))
            return Proposal(row[0], digest, False, row[1], row[2])
        fp = program_fingerprint(program.source)
        sig = self.hasher.signature(fp.shingles)
        keys = self.hasher.band_keys(sig)
        dup, sim = self._nearest(conn, fp.ast_hash, sig, keys)
        return Proposal(self._insert(conn, program, fp.ast_hash, sig, keys, dup, sim), digest, True, dup, sim)

    def _insert(self, conn: sqlite3.Connection, program: EnvProgram, ast_hash: str | None, sig: np.ndarray,
                keys: Sequence[int], dup: str | None, sim: float | None) -> int:
        prov = program.provenance
        cur = conn.execute(
            "INSERT INTO environments (content_hash, ast_hash, skill, source, hint, document_id, designer_iteration, "
            "policy_version, provenance, duplicate_of, similarity, created_at, signature) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (program.content_hash, ast_hash, program.skill, program.source, program.hint,
             _opt_str(prov.get("document_id")), _opt_int(prov.get("iteration")), _opt_int(prov.get("policy_version")),
             json.dumps(prov, sort_keys=True, default=str), dup, sim, time.time(), sig.tobytes()))
        env_id = int(cur.lastrowid)
        conn.executemany("INSERT OR IGNORE INTO lsh (band_key, env_id) VALUES (?, ?)", [(k, env_id) for k in keys])
        return env_id

    def _nearest(self, conn: sqlite3.Connection, ast_hash: str | None, sig: np.ndarray,
                 keys: Sequence[int]) -> tuple[str | None, float | None]:
        """Earliest stored program with the same normalised AST, else the most similar LSH candidate >= threshold."""
        if ast_hash is not None:
            row = conn.execute("SELECT content_hash FROM environments WHERE ast_hash = ? ORDER BY id LIMIT 1",
                               (ast_hash,)).fetchone()
            if row is not None:
                return row[0], 1.0
        best: tuple[str | None, float | None] = (None, None)
        marks = ",".join("?" * len(keys))
        for content_hash, blob in conn.execute(
                f"SELECT content_hash, signature FROM environments WHERE id IN "
                f"(SELECT DISTINCT env_id FROM lsh WHERE band_key IN ({marks})) ORDER BY id", list(keys)):
            sim = self.hasher.similarity(sig, np.frombuffer(blob, dtype=np.uint32))
            if sim >= self.threshold and (best[1] is None or sim > best[1]):
                best = (content_hash, sim)
        return best

    def set_validation(self, content_hash: str, valid: bool, reason: str | None = None,
                       iteration: int | None = None) -> None:
        """Record the validator's verdict (``reason``: its reason code when invalid). With ``iteration`` (the loop's)
        the verdict it replaces is kept, so that :meth:`discard_after` can restore it."""
        v = _play_results(iteration=iteration) if iteration is not None else {}
        with self._write() as conn:
            env_id = self._resolve(content_hash)
            if v:
                conn.execute("INSERT INTO verdicts (env_id, iteration, prior_status, prior_reason) "
                             "SELECT id, ?, status, reason FROM environments WHERE id = ?", (v["iteration"], env_id))
            conn.execute("UPDATE environments SET status = ?, reason = ? WHERE id = ?",
                         ("valid" if valid else "invalid", reason, env_id))

    def record_evaluation(self, content_hash: str, iteration: int, win_rate: float, win_rate_hint: float | None,
                          plays: int, hint_plays: int, designer_reward: float | None = None,
                          regret: float | None = None) -> None:
        """Store one iteration's play results (idempotent per iteration): win rates (fractions of episodes won) alone
        and with the hint. ``regret`` defaults to the hint gain ``win_rate_hint - win_rate``; the loop passes SPADE's
        regret, hint minus no-hint mean return (equal for 0/1 rewards). ``win_rate_hint`` None: no hint play measured
        the agent (``hint_plays`` 0), so there is no regret either (stored NULL)."""
        v = _play_results(iteration=iteration, win_rate=win_rate, win_rate_hint=win_rate_hint,
                          designer_reward=designer_reward, plays=plays, hint_plays=hint_plays)
        if v["win_rate_hint"] is None:
            if regret is not None or v["hint_plays"]:
                raise EnvMemoryError(f"an evaluation without a win rate with the hint has no regret and no hint plays, "
                                     f"got regret {regret!r}, hint_plays {v['hint_plays']}")
            v["regret"] = None
        else:
            v |= _play_results(regret=v["win_rate_hint"] - v["win_rate"] if regret is None else regret)
        with self._write() as conn:
            env_id = self._resolve(content_hash)
            conn.execute("INSERT OR REPLACE INTO evaluations VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (env_id, v["iteration"], v["win_rate"], v["win_rate_hint"], v["regret"],
                          v["designer_reward"], v["plays"], v["hint_plays"]))
            self._refresh(conn, env_id)

    def set_designer_reward(self, content_hash: str, iteration: int, designer_reward: float) -> None:
        """Attach the (delayed) designer reward to an evaluation recorded earlier."""
        v = _play_results(iteration=iteration, designer_reward=designer_reward)
        with self._write() as conn:
            env_id = self._resolve(content_hash)
            cur = conn.execute("UPDATE evaluations SET designer_reward = ? WHERE env_id = ? AND iteration = ?",
                               (v["designer_reward"], env_id, v["iteration"]))
            if cur.rowcount == 0:
                raise EnvMemoryError(f"environment {content_hash[:12]} has no evaluation at iteration {iteration}")
            self._refresh(conn, env_id)

    def discard_after(self, iteration: int) -> dict[str, int]:
        """Forget what iterations after ``iteration`` wrote: a run resumed from the checkpoint of that iteration
        replays them, and the database, unlike the checkpoint, cannot be rolled back to the save.

        Deletes their evaluations and the environments first proposed after it (their ``designer_iteration``),
        then restores each remaining environment's latest-evaluation columns and the verdict it had then (one given
        later with its iteration: a program that broke in play, one proposed and judged again). Row ids of the
        deleted environments are reused by the replay, so prompts built from the memory come out as in the
        uninterrupted run. Not undone: the ``proposals`` count of an older environment proposed again after
        ``iteration`` (a statistic no prompt reads). Returns the counts deleted."""
        v = _play_results(iteration=iteration)
        with self._write() as conn:
            touched = [r[0] for r in conn.execute("SELECT DISTINCT env_id FROM evaluations WHERE iteration > ?",
                                                  (v["iteration"],))]
            evaluations = conn.execute("DELETE FROM evaluations WHERE iteration > ?", (v["iteration"],)).rowcount
            doomed = [r[0] for r in conn.execute("SELECT id FROM environments WHERE designer_iteration > ?",
                                                 (v["iteration"],))]
            # the first verdict given after it holds the one before
            prior = conn.execute("SELECT env_id, prior_status, prior_reason FROM verdicts WHERE rowid IN "
                                 "(SELECT MIN(rowid) FROM verdicts WHERE iteration > ? GROUP BY env_id)",
                                 (v["iteration"],)).fetchall()
            conn.execute("DELETE FROM verdicts WHERE iteration > ?", (v["iteration"],))
            conn.executemany("UPDATE environments SET status = ?, reason = ? WHERE id = ?",
                             [(status, reason, env_id) for env_id, status, reason in prior])
            conn.executemany("DELETE FROM verdicts WHERE env_id = ?", [(i,) for i in doomed])
            conn.executemany("DELETE FROM evaluations WHERE env_id = ?", [(i,) for i in doomed])
            conn.executemany("DELETE FROM lsh WHERE env_id = ?", [(i,) for i in doomed])
            conn.executemany("DELETE FROM environments WHERE id = ?", [(i,) for i in doomed])
            for env_id in sorted(set(touched) - set(doomed)):
                self._refresh(conn, env_id)
        return {"evaluations": evaluations, "environments": len(doomed)}

    def _refresh(self, conn: sqlite3.Connection, env_id: int) -> None:
        """Copy the latest evaluation and the play totals onto the environment row (what the indexes serve)."""
        last = conn.execute("SELECT * FROM evaluations WHERE env_id = ? ORDER BY iteration DESC LIMIT 1",
                            (env_id,)).fetchone()
        if last is None:  # every evaluation was discarded: back to never played
            conn.execute("UPDATE environments SET last_iteration = NULL, win_rate = NULL, win_rate_hint = NULL, "
                         "regret = NULL, designer_reward = NULL, plays = 0, hint_plays = 0, outcome = NULL "
                         "WHERE id = ?", (env_id,))
            return
        plays, hint_plays = conn.execute("SELECT SUM(plays), SUM(hint_plays) FROM evaluations WHERE env_id = ?",
                                         (env_id,)).fetchone()
        conn.execute("UPDATE environments SET last_iteration = ?, win_rate = ?, win_rate_hint = ?, regret = ?, "
                     "designer_reward = ?, plays = ?, hint_plays = ?, outcome = ? WHERE id = ?",
                     (last["iteration"], last["win_rate"], last["win_rate_hint"], last["regret"],
                      last["designer_reward"], plays, hint_plays,
                      classify(last["win_rate"], last["win_rate_hint"], last["regret"]), env_id))

    # ------------------------------------------------------------------------------------------------------ reads
    def get(self, content_hash: str) -> EnvRecord:
        """One environment with all its evaluations; accepts a unique hash prefix."""
        with self._snapshot():
            env_id = self._resolve(content_hash)
            row = self.conn.execute(f"SELECT {_COLUMNS} FROM environments WHERE id = ?", (env_id,)).fetchone()
            evals = [Evaluation(*r[1:]) for r in self.conn.execute(
                "SELECT * FROM evaluations WHERE env_id = ? ORDER BY iteration", (env_id,))]
        return _record(row, evals)

    def evaluated(self, content_hash: str, iteration: int) -> bool:
        """Whether the environment has an evaluation at ``iteration`` (none where no play measured the agent)."""
        v = _play_results(iteration=iteration)
        return self.conn.execute("SELECT 1 FROM evaluations JOIN environments ON environments.id = env_id "
                                 "WHERE content_hash = ? AND iteration = ?",
                                 (content_hash, v["iteration"])).fetchone() is not None

    def __contains__(self, content_hash: object) -> bool:
        return isinstance(content_hash, str) and self.conn.execute(
            "SELECT 1 FROM environments WHERE content_hash = ?", (content_hash,)).fetchone() is not None

    def __len__(self) -> int:
        return int(self.conn.execute("SELECT COUNT(*) FROM environments").fetchone()[0])

    def _window(self, window: int | None) -> tuple[str, list[Any]]:
        if window is None:
            return "environments", []
        return (f"(SELECT {_COLUMNS} FROM environments WHERE last_iteration IS NOT NULL "
                "ORDER BY last_iteration DESC, id DESC LIMIT ?)", [window])

    def seeds(self, skill: str, k: int, window: int | None = None) -> list[EnvRecord]:
        """Top-``k`` valid frontier environments of ``skill`` by regret (> 0): few-shot seeds. Mastered and
        unsolvable ones are negatives even with some regret, never both. ``window``: only among the most recently
        played ``window`` environments (the prompt window); None searches all storage."""
        source, args = self._window(window)
        rows = self.conn.execute(
            f"SELECT {_COLUMNS} FROM {source} WHERE skill = ? AND status = 'valid' AND regret > 0 "
            "AND outcome = 'frontier' ORDER BY regret DESC, id DESC LIMIT ?", [*args, skill, k]).fetchall()
        return [_record(r) for r in rows]

    def negatives(self, skill: str, k: int, window: int | None = None) -> list[EnvRecord]:
        """Up to ``k`` recent mastered and unsolvable environments of ``skill``, alternating: "do not repeat"."""
        source, args = self._window(window)
        groups = [self.conn.execute(
            f"SELECT {_COLUMNS} FROM {source} WHERE skill = ? AND outcome = ? "
            "ORDER BY last_iteration DESC, id DESC LIMIT ?", [*args, skill, outcome, k]).fetchall()
            for outcome in ("mastered", "unsolvable")]
        mixed = [row for pair in zip(*groups) for row in pair]
        longer = max(groups, key=len)
        mixed += longer[len(mixed) // 2:]
        return [_record(r) for r in mixed[:k]]

    def recent(self, limit: int) -> list[EnvRecord]:
        """The ``limit`` most recently proposed environments, newest first."""
        rows = self.conn.execute(f"SELECT {_COLUMNS} FROM environments ORDER BY id DESC LIMIT ?", (limit,))
        return [_record(r) for r in rows]

    def near_duplicates(self, source: str, limit: int = 5) -> list[tuple[str, float]]:
        """Stored programs similar to ``source``: same normalised AST (similarity 1.0) or MinHash similarity at or
        above the threshold; (content hash, similarity), most similar first."""
        fp = program_fingerprint(source)
        sig = self.hasher.signature(fp.shingles)
        keys = self.hasher.band_keys(sig)
        found: dict[str, float] = {}
        if fp.ast_hash is not None:
            for (h,) in self.conn.execute("SELECT content_hash FROM environments WHERE ast_hash = ? LIMIT ?",
                                          (fp.ast_hash, limit)):
                found[h] = 1.0
        marks = ",".join("?" * len(keys))
        for h, blob in self.conn.execute(
                f"SELECT content_hash, signature FROM environments WHERE id IN "
                f"(SELECT DISTINCT env_id FROM lsh WHERE band_key IN ({marks}))", list(keys)):
            sim = self.hasher.similarity(sig, np.frombuffer(blob, dtype=np.uint32))
            if sim >= self.threshold:
                found[h] = max(found.get(h, 0.0), sim)
        return sorted(found.items(), key=lambda item: -item[1])[:limit]

    def stats(self) -> dict[str, Any]:
        """Totals for ``spade-mega memory stats`` and the run's metrics (one snapshot, even beside a writer)."""
        with self._snapshot():
            return self._stats()

    def _stats(self) -> dict[str, Any]:
        q = self.conn.execute
        total, proposals, dups = q("SELECT COUNT(*), COALESCE(SUM(proposals), 0), COUNT(duplicate_of) "
                                   "FROM environments").fetchone()
        played = q("SELECT COUNT(*), AVG(win_rate), AVG(win_rate_hint), AVG(regret), "
                   "SUM(win_rate > 0 AND win_rate < 1), SUM(regret > 0), SUM(win_rate > ?), SUM(win_rate < ?), "
                   "MAX(last_iteration) FROM environments WHERE last_iteration IS NOT NULL",
                   (EASY_ABOVE, HARD_BELOW)).fetchone()
        n_played = played[0]
        frac = (lambda x: (x or 0) / n_played if n_played else 0.0)
        return {
            "path": str(self.path),
            "environments": total,
            "proposals": proposals,
            "near_duplicates": dups,
            "by_status": dict(q("SELECT status, COUNT(*) FROM environments GROUP BY status").fetchall()),
            "by_skill": dict(q("SELECT skill, COUNT(*) FROM environments GROUP BY skill").fetchall()),
            "invalid_reasons": dict(q("SELECT reason, COUNT(*) FROM environments WHERE status = 'invalid' "
                                      "GROUP BY reason ORDER BY COUNT(*) DESC").fetchall()),
            "played": n_played,
            "outcomes": dict(q("SELECT outcome, COUNT(*) FROM environments WHERE outcome IS NOT NULL "
                               "GROUP BY outcome").fetchall()),
            "mean_win_rate": played[1], "mean_win_rate_hint": played[2], "mean_regret": played[3],
            "learnable_fraction": frac(played[4]), "positive_regret_fraction": frac(played[5]),
            "difficulty": {"easy": frac(played[6]), "hard": frac(played[7]),
                           "medium": 1.0 - frac(played[6]) - frac(played[7]) if n_played else 0.0},
            "last_iteration": played[8],
        }

    def iter_records(self) -> Iterator[EnvRecord]:
        """Every environment with its evaluations, in proposal order, streamed (constant memory)."""
        evals = self.conn.cursor().execute("SELECT * FROM evaluations ORDER BY env_id, iteration")
        pending = evals.fetchone()
        for row in self.conn.cursor().execute(f"SELECT {_COLUMNS} FROM environments ORDER BY id"):
            mine = []
            while pending is not None and pending[0] <= row["id"]:
                if pending[0] == row["id"]:
                    mine.append(Evaluation(*pending[1:]))
                pending = evals.fetchone()
            yield _record(row, mine)

    def export_jsonl(self, out: IO[str]) -> int:
        """Write every environment (with its evaluations) as one JSON object per line; returns the count."""
        n = 0
        for record in self.iter_records():
            out.write(json.dumps(record.to_dict(), sort_keys=True) + "\n")
            n += 1
        return n


def _play_results(**values: float | int | None) -> dict[str, float | int | None]:
    """The values as Python ints and floats, by name: sqlite3 binds numpy scalars as BLOBs (raw bytes that sort after
    every number). Refuses non-finite rates and rewards (SQLite would store nan as NULL), negative play counts and
    non-integer iterations."""
    out: dict[str, float | int | None] = {}
    for name, value in values.items():
        if name == "iteration" or name.endswith("plays"):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not _INT64[0] <= value \
                    <= _INT64[1] or (name != "iteration" and value < 0):
                kind = "an integer" if name == "iteration" else "a non-negative integer"
                raise EnvMemoryError(f"{name} must be {kind}, got {value!r}")
            out[name] = int(value)
        elif value is None:
            out[name] = None
        elif isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                or not math.isfinite(value):
            raise EnvMemoryError(f"{name} must be a finite number, got {value!r}")
        else:
            out[name] = float(value)
    return out


_INT64 = (-(1 << 63), (1 << 63) - 1)


def _opt_int(value: Any) -> int | None:
    """A provenance number for its SQLite column; anything else stays only in the provenance JSON."""
    if isinstance(value, (float, np.floating)) and math.isfinite(value):
        value = int(value)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and _INT64[0] <= value <= _INT64[1]:
        return int(value)
    return None


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)
