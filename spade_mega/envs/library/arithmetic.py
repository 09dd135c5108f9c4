"""Arithmetic and algebra environments and their oracles."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Generator

from spade_mega.envs.library.entry import LibraryEntry

Script = Generator[str, str, None]


def running_total_oracle(obs: str) -> Script:
    total = int(re.search(r"Start with (-?\d+)", obs)[1])
    while True:
        kind, n = re.search(r"Operation \d+ of \d+: (add|subtract|multiply by|divide by) (-?\d+)", obs).groups()
        n = int(n)
        total = {"add": total + n, "subtract": total - n, "multiply by": total * n, "divide by": total // n}[kind]
        obs = yield str(total)


def _linear_side(side: str) -> tuple[Fraction, Fraction]:
    """(coefficient of x, constant) of one side such as '-2x + 7 - x'."""
    coef, const = Fraction(0), Fraction(0)
    for token in re.findall(r"[+-]?[^+-]+", side.replace(" ", "")):
        if token.endswith("x"):
            body = token[:-1]
            coef += int(body + "1") if body in ("", "+", "-") else int(body)
        else:
            const += int(token)
    return coef, const


def linear_equation_oracle(obs: str) -> Script:
    left, right = re.search(r"Solve for x: (.+)", obs)[1].split("=")
    (a, b), (c, d) = _linear_side(left), _linear_side(right)
    x = (d - b) / (a - c)
    while True:
        yield str(x.numerator)


def _solve(matrix: list[list[Fraction]], rhs: list[Fraction]) -> list[Fraction]:
    """Gauss-Jordan elimination over the rationals (the system is square and non-singular)."""
    n = len(matrix)
    rows = [row[:] + [b] for row, b in zip(matrix, rhs)]
    for col in range(n):
        pivot = next(r for r in range(col, n) if rows[r][col] != 0)
        rows[col], rows[pivot] = rows[pivot], rows[col]
        rows[col] = [v / rows[col][col] for v in rows[col]]
        for r in range(n):
            if r != col and rows[r][col] != 0:
                rows[r] = [a - rows[r][col] * b for a, b in zip(rows[r], rows[col])]
    return [row[-1] for row in rows]


def linear_system_oracle(obs: str) -> Script:
    names = re.findall(r"(\w)=<integer>", obs)
    matrix, rhs = [], []
    for line in re.findall(r"^(.*=\s*-?\d+)$", obs, re.M):
        left, right = line.split("=")
        row = [Fraction(0)] * len(names)
        for token in re.findall(r"[+-]?[^+-]+", left.replace(" ", "")):
            body, name = token[:-1], token[-1]
            row[names.index(name)] += int(body + "1") if body in ("", "+", "-") else int(body)
        matrix.append(row)
        rhs.append(Fraction(int(right)))
    answer = ", ".join(f"{n}={v.numerator}" for n, v in zip(names, _solve(matrix, rhs)))
    while True:
        yield answer


def _next_term(seq: list[int]) -> int:
    """First rule that fits the whole sequence, tried in the environment's rule order."""
    diffs = [b - a for a, b in zip(seq, seq[1:])]
    if len(set(diffs)) == 1:
        return seq[-1] + diffs[0]
    if seq[0] and all(b == a * (seq[1] // seq[0]) for a, b in zip(seq, seq[1:])):
        return seq[-1] * (seq[1] // seq[0])
    second = [b - a for a, b in zip(diffs, diffs[1:])]
    if len(set(second)) == 1:
        return seq[-1] + diffs[-1] + second[0]
    if all(c == a + b for a, b, c in zip(seq, seq[1:], seq[2:])):
        return seq[-1] + seq[-2]
    even, odd = seq[0::2], seq[1::2]
    if len(set(b - a for a, b in zip(even, even[1:]))) == 1 and len(set(b - a for a, b in zip(odd, odd[1:]))) == 1:
        same = even if len(seq) % 2 == 0 else odd
        return same[-1] + same[1] - same[0]
    third = [b - a for a, b in zip(second, second[1:])]
    return seq[-1] + diffs[-1] + second[-1] + third[0]


def sequence_next_oracle(obs: str) -> Script:
    while True:
        shown = re.findall(r"(?:sequence: |so far: )([-\d, ]+), \?", obs)[-1]
        obs = yield str(_next_term([int(v) for v in shown.split(",")]))


ENTRIES = [
    LibraryEntry(
        name="running_total",
        skill="arithmetic",
        summary="exact mental arithmetic over a chain of operations announced one per turn; one slip ends the game",
        hint="Write the running total down after every operation and compute only from that number. "
             "'divide by' is always exact here, and 'subtract' may take the total below zero.",
        oracle=running_total_oracle,
        target_return=1.0,
        action_examples=("{int}", "{int}", "total: {int}"),
    ),
    LibraryEntry(
        name="linear_equation",
        skill="arithmetic",
        summary="solving a linear equation with x terms and constants on both sides; too high / too low feedback",
        hint="Collect every x term on the left and every constant on the right (flip the sign of a term when it "
             "crosses '='), then divide by the x coefficient. Substitute your x back into both sides to check it.",
        oracle=linear_equation_oracle,
        target_return=1.0,
        action_examples=("{int}", "x = {int}", "{int}"),
    ),
    LibraryEntry(
        name="linear_system",
        skill="arithmetic",
        summary="solving a 2-4 variable linear system exactly; feedback names the wrong variables",
        hint="Eliminate one variable at a time by adding multiples of one equation to the others, then "
             "back-substitute. The solution is all integers, so a fraction means an arithmetic slip: recheck it.",
        oracle=linear_system_oracle,
        target_return=1.0,
        action_examples=("x={int}, y={int}", "x={int}, y={int}, z={int}", "{int}"),
    ),
    LibraryEntry(
        name="sequence_next",
        skill="arithmetic",
        summary="inducing the rule of an integer sequence and extrapolating it term by term",
        hint="Take differences of consecutive terms: constant means arithmetic, constant second (or third) "
             "differences mean quadratic (cubic). Also test a constant ratio (geometric), each term being the sum "
             "of the two before it, and the odd and even positions as two separate arithmetic sequences.",
        oracle=sequence_next_oracle,
        target_return=1.0,
        action_examples=("{int}", "{int}", "next: {int}"),
    ),
]
