"""Environment memory at scale: insert and query throughput with 1e5 and 1e6 stored environments.

    python -m tools.bench memory [--sizes 100000 1000000] [--db-dir DIR]
    python tools/bench/memory.py ...

For each size the database is first filled to that many environments, then measured with the real API:
- insert: ``propose_many`` of one regeneration (24 new programs: fingerprint, near-duplicate lookup, insert), against
  the baseline of fingerprinting alone (the CPU floor of a proposal, no database);
- ``record_evaluation`` per environment;
- the prompt-facing queries (seeds, negatives, recent history, near-duplicate check, hash lookup), median and p99,
  against the baseline of the same seed query forced to a full table scan (``NOT INDEXED``).
Target (issue 4): seed queries under 10 ms at 1e6.

The fill uses the memory's own insert path (``EnvMemory._insert``) with synthetic fingerprints: fingerprinting a
million programs in Python takes ~20 minutes on 2 cores and measures nothing new. Filler rows get realistic sources
(~900 characters), a random MinHash signature, 8 LSH rows and play results (``classify`` decides their outcome).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spade_mega.curriculum.fingerprint import program_fingerprint  # noqa: E402
from spade_mega.curriculum.memory import EnvMemory, classify  # noqa: E402
from spade_mega.envs.program import EnvProgram  # noqa: E402

SKILLS = ("arithmetic", "logic", "navigation", "science", "code_tracing", "tool_use")
OPS = ("self.x += {a}", "self.y = (self.y * {a}) % {b}", "self.grid[{a} % 5] = {b}", "self.log.append('{w}')",
       "if self.x > {a}:\n            self.x -= {b}", "self.score = max(self.score, self.x - {a})",
       "for i in range({a} % 4):\n            self.y += i", "self.state = '{w}' if self.x % {a} else '{w}{b}'")
WORDS = "north south east west red blue gold iron salt wave fire leaf stone cloud river".split()
FILL_CHUNK = 20_000


def make_program(i: int) -> EnvProgram:
    """A distinct, valid-looking environment program (the designer's output shape)."""
    r = random.Random(i)

    def lines(n: int) -> str:
        return "\n        ".join(r.choice(OPS).format(a=r.randint(1, 99), b=r.randint(1, 99), w=r.choice(WORDS))
                                 for _ in range(n))

    source = (f"import random\n\n\nclass Env{i}:\n    max_turns = {r.randint(2, 30)}\n\n    def reset(self, seed):\n"
              f"        self.rng = random.Random(seed)\n        self.x, self.y, self.score = 0, 1, 0\n"
              f"        self.grid, self.log, self.state = [0] * 5, [], ''\n        {lines(r.randint(2, 5))}\n"
              f"        return 'start {r.choice(WORDS)}'\n\n    def step(self, action):\n        {lines(r.randint(3, 8))}\n"
              f"        return self.state, float(self.score > {r.randint(5, 50)}), self.x > {r.randint(10, 90)}, "
              "False, {}\n")
    return EnvProgram(source, f"hint {i}", SKILLS[i % len(SKILLS)], {"origin": "designer", "iteration": i // 24})


def fill(memory: EnvMemory, start: int, stop: int) -> float:
    """Bulk-insert environments ``start..stop-1`` with synthetic fingerprints and play results; returns rows/s."""
    rng = np.random.default_rng(start)
    pool = [make_program(i).source for i in range(2000)]
    t0 = time.perf_counter()
    for lo in range(start, stop, FILL_CHUNK):
        hi = min(stop, lo + FILL_CHUNK)
        sigs = rng.integers(0, 1 << 32, size=(hi - lo, memory.hasher.num_perm), dtype=np.uint64).astype(np.uint32)
        plays = []
        with memory._write() as conn:
            for i in range(lo, hi):
                p = EnvProgram(pool[i % len(pool)] + f"# variant {i}\n", f"hint {i}", SKILLS[i % len(SKILLS)],
                               {"origin": "designer", "iteration": i // 24})
                sig = sigs[i - lo]
                ast_hash = hashlib.sha256(str(i).encode()).hexdigest()
                env_id = memory._insert(conn, p, ast_hash, sig, memory.hasher.band_keys(sig), None, None)
                w, wh = rng.random(), rng.random()
                plays.append(("valid" if i % 10 else "invalid", i // 24, w, wh, wh - w, classify(w, wh, wh - w),
                              env_id))
            conn.executemany("UPDATE environments SET status = ?, last_iteration = ?, win_rate = ?, "
                             "win_rate_hint = ?, regret = ?, outcome = ?, plays = 16, hint_plays = 16 WHERE id = ?",
                             plays)
        print(f"  filled {hi:>9,} rows", end="\r", flush=True)
    print(" " * 40, end="\r")
    return (stop - start) / (time.perf_counter() - t0)


def timed(fn: Callable[[int], object], reps: int) -> tuple[float, float]:
    """(median, p99) of ``fn(rep)`` in milliseconds."""
    times = []
    for rep in range(reps):
        t0 = time.perf_counter()
        fn(rep)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(round(0.99 * (len(times) - 1))))]


def measure(memory: EnvMemory, size: int, next_id: int) -> int:
    print(f"\n== {size:,} stored environments ({memory.path.stat().st_size / 2**20:,.0f} MiB database file)")
    programs = [make_program(next_id + i) for i in range(24 * 10)]
    t0 = time.perf_counter()
    for p in programs:
        program_fingerprint(p.source)
    fp_us = (time.perf_counter() - t0) / len(programs) * 1e6
    t0 = time.perf_counter()
    for b in range(0, len(programs), 24):
        memory.propose_many(programs[b:b + 24])
    propose_us = (time.perf_counter() - t0) / len(programs) * 1e6
    print(f"insert   propose_many(24): {propose_us:8.0f} us/program = {1e6 / propose_us:7.0f} programs/s "
          f"({propose_us * 24 / 1e3:.1f} ms per regeneration); baseline fingerprint only {fp_us:.0f} us "
          f"-> database share x{propose_us / fp_us:.2f}")
    t0 = time.perf_counter()
    for it, p in enumerate(programs[:100]):
        memory.record_evaluation(p.content_hash, 10_000_000 + it, 0.3, 0.7, 16, 16)
    eval_us = (time.perf_counter() - t0) / 100 * 1e6
    print(f"update   record_evaluation:  {eval_us:8.0f} us/call    = {1e6 / eval_us:7.0f} calls/s")

    hashes = [p.content_hash for p in programs]
    queries: list[tuple[str, Callable[[int], object], int]] = [
        ("seeds(skill, 2) all storage", lambda r: memory.seeds(SKILLS[r % 6], 2), 200),
        ("seeds(skill, 2, window=200)", lambda r: memory.seeds(SKILLS[r % 6], 2, window=200), 200),
        ("negatives(skill, 4) all storage", lambda r: memory.negatives(SKILLS[r % 6], 4), 200),
        ("negatives(skill, 4, window=200)", lambda r: memory.negatives(SKILLS[r % 6], 4, window=200), 200),
        ("recent(200)", lambda r: memory.recent(200), 50),
        ("near_duplicates(source)", lambda r: memory.near_duplicates(programs[r % 240].source), 100),
        ("get(hash prefix)", lambda r: memory.get(hashes[r % 240][:10]), 200),
    ]
    seed_median = 0.0
    for name, fn, reps in queries:
        med, p99 = timed(fn, reps)
        seed_median = med if name.startswith("seeds(skill, 2) all") else seed_median
        flag = "  (target < 10 ms)" if name.startswith("seeds") else ""
        print(f"query    {name:34s} median {med:8.3f} ms  p99 {p99:8.3f} ms{flag}")
    scan = ("SELECT id FROM environments NOT INDEXED WHERE skill = ? AND status = 'valid' AND regret > 0 "
            "ORDER BY regret DESC LIMIT 2")
    med, _ = timed(lambda r: memory.conn.execute(scan, (SKILLS[r % 6],)).fetchall(), 5)
    print(f"baseline seed query as a full table scan (NOT INDEXED): median {med:8.1f} ms -> index speed-up "
          f"x{med / seed_median:,.0f}")
    return next_id + len(programs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--db-dir", help="where to put the database (default: a temporary folder, removed after)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.db_dir) as tmp:
        memory = EnvMemory(Path(tmp) / "memory.sqlite", synchronous="full")
        stored, next_id = 0, 10_000_000
        for size in sorted(args.sizes):
            rate = fill(memory, stored, size)
            print(f"fill     {size - stored:,} rows at {rate:,.0f} rows/s")
            next_id = measure(memory, len(memory), next_id)
            stored = len(memory)
        memory.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
