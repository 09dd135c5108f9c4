"""Time of the boxed scorer's equation comparison (spade_mega/evaluation/symbolic.py ``_proportional``) on its worst
inputs: seeded random equations of binomials, factorials, logarithms, roots and powers in up to three variables, each
against the same equation scaled by a constant (equal) and against one with a term changed (not equal).

    python -m tools.bench answer_equivalence [--equations 40] [--seed 0]

Baseline, measured in the same run on the same pairs: the comparison as it was before this bench (no term-by-term
factor; the pairs of points decided by sympy's strict evaluation of ``a(p) b(q) - a(q) b(p)``, which runs to its last
digit when the sides are proportional). The verdicts of both must agree; the bench exits 1 when they do not.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

from spade_mega.evaluation import symbolic
from spade_mega.evaluation.scoring import SCORERS

VARIABLES = ("x", "y", "z")
SCALES = ("2", "\\sqrt{3}", "\\pi", "\\frac{3}{7}", "e")


def _atom(rng: random.Random) -> str:
    u, v = rng.sample(VARIABLES, 2)
    return rng.choice((f"\\binom{{{u}}}{{{v}}}", f"{u}!", f"\\sqrt{{{u}^2 + {v}^2}}", f"\\log({u}^2 + 1)",
                       f"\\sin({u} {v})", f"({u} + {v})^{{{rng.randint(2, 4)}}}", f"{rng.randint(2, 9)}{u}",
                       f"\\binom{{{u}}}{{{v}}}^{{{rng.randint(2, 3)}}}"))


def equations(count: int, seed: int) -> list[tuple[str, str, bool]]:
    """(equation, other, equal?): each equation against itself scaled (terms grouped, so only values can tell) and
    against itself with its last term changed."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        left = " + ".join(_atom(rng) for _ in range(rng.randint(1, 3)))
        right = " + ".join(_atom(rng) for _ in range(rng.randint(1, 2)))
        scale = rng.choice(SCALES)
        pairs.append((f"{left} = {right}", f"{scale}({left}) - {scale}({right}) = 0", True))
        pairs.append((f"{left} = {right}", f"{left} = {right} + {_atom(rng)}", False))
    return pairs


def _strict_pairs(sympy: Any, a: Any, b: Any, variables: Sequence[Any]) -> bool:
    """The baseline's last step: ``a(p) b(q) = a(q) b(p)`` at each two points through the identity test (``_agree``,
    whose strict evaluation of a zero difference runs to the last digit it may try)."""
    copies = {v: sympy.Dummy(v.name) for v in variables}
    pairs = [{**dict(zip(variables, p)), **dict(zip(copies.values(), q))}
             for p, q in itertools.combinations(symbolic.POINTS, 2)]
    return symbolic._agree(sympy, a * b.xreplace(copies), a.xreplace(copies) * b, pairs)


def _timed(pairs: list[tuple[str, str, bool]]) -> list[tuple[float, bool, str, str]]:
    equal: Callable[[str, str], bool] = SCORERS["boxed"].equal
    rows = []
    for a, b, _ in pairs:
        for x, y in ((a, b), (b, a)):
            began = time.process_time()
            verdict = equal(x, y)
            rows.append((time.process_time() - began, verdict, x, y))
    return rows


def _baseline(run: Callable[[], Any]) -> Any:
    """``run()`` with the comparison as it was: no term-by-term factor, strict pairs."""
    saved = symbolic._term_factor, symbolic._same_ratio
    no_factor: Callable[..., Optional[Any]] = lambda *args: None  # noqa: E731
    symbolic._term_factor, symbolic._same_ratio = no_factor, _strict_pairs
    try:
        return run()
    finally:
        symbolic._term_factor, symbolic._same_ratio = saved


def _summary(name: str, rows: list[tuple[float, bool, str, str]]) -> tuple[float, float]:
    times = sorted(row[0] for row in rows)
    slowest = max(rows)
    print(f"{name:<9} total {sum(times):7.2f} s, median {statistics.median(times) * 1e3:7.1f} ms, "
          f"p99 {times[int(0.99 * (len(times) - 1))] * 1e3:7.1f} ms, max {slowest[0] * 1e3:7.1f} ms "
          f"({slowest[2]!r} against {slowest[3]!r})")
    return sum(times), slowest[0]


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench answer_equivalence",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--equations", type=int, default=40, help="random equations (each compared 4 times)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(list(argv))
    pairs = equations(args.equations, args.seed)
    SCORERS["boxed"].equal("x + 1 = 2", "2x + 2 = 4")  # sympy imported and warm before timing
    baseline = _baseline(lambda: _timed(pairs))
    current = _timed(pairs)
    base_total, base_max = _summary("baseline", baseline)
    total, worst = _summary("current", current)
    print(f"current / baseline: total x{total / base_total:.2f}, slowest comparison x{worst / base_max:.2f} "
          f"({len(current)} comparisons)")
    expected = [right for _, _, right in pairs for _ in range(2)]
    wrong = [(row[2], row[3]) for row, right in zip(current, expected) if row[1] != right]
    differ = [(x[2], x[3]) for x, y in zip(baseline, current) if x[1] != y[1]]
    for a, b in wrong:
        print(f"unexpected verdict: {a!r} against {b!r}")
    for a, b in differ:
        print(f"verdict differs from the baseline: {a!r} against {b!r}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
