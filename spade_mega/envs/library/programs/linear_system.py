"""Solve a system of linear equations with an integer solution; feedback names the wrong variables."""

import random
from fractions import Fraction

# difficulty (rendered by the library; each range reads easy..hard)
N_VARS = 2  # 2..4: unknowns (and equations)
MAX_COEF = 5  # 3..9: largest coefficient
MAX_VALUE = 6  # 5..15: each unknown lies in -MAX_VALUE..MAX_VALUE
ATTEMPTS = 3  # 3..1: answers allowed
# end difficulty

NAMES = ["x", "y", "z", "w"]


def _singular(rows):
    m = [[Fraction(v) for v in row] for row in rows]
    n = len(m)
    for col in range(n):
        pivot = next((r for r in range(col, n) if m[r][col] != 0), None)
        if pivot is None:
            return True
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            m[r] = [a - f * b for a, b in zip(m[r], m[col])]
    return False


def _equation(coefs, rhs):
    out = ""
    for coef, name in zip(coefs, NAMES):
        if coef == 0:
            continue
        mag = "" if abs(coef) == 1 else str(abs(coef))
        if not out:
            out = ("-" if coef < 0 else "") + mag + name
        else:
            out += (" - " if coef < 0 else " + ") + mag + name
    return f"{out} = {rhs}"


class LinearSystem:
    max_turns = ATTEMPTS

    def reset(self, seed):
        rng = random.Random(seed)
        self.names = NAMES[:N_VARS]
        self.solution = [rng.randint(-MAX_VALUE, MAX_VALUE) for _ in self.names]
        while True:
            rows = [[rng.randint(-MAX_COEF, MAX_COEF) for _ in self.names] for _ in self.names]
            if all(any(row) for row in rows) and not _singular(rows):
                break
        self.equations = [_equation(row, sum(c * v for c, v in zip(row, self.solution))) for row in rows]
        self.attempt = 0
        self.done = False
        fmt = ", ".join(f"{n}=<integer>" for n in self.names)
        return ("Solve the system (the solution is integers):\n" + "\n".join(self.equations)
                + f"\nReply in the form: {fmt}. You have {ATTEMPTS} attempt(s).")

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        self.attempt += 1
        given = {}
        for part in action.replace(";", ",").split(","):
            if "=" in part:
                key, _, value = part.partition("=")
                try:
                    given[key.strip().lower()] = int(value.strip())
                except ValueError:
                    pass
        wrong = [n for n, v in zip(self.names, self.solution) if given.get(n) != v]
        if not wrong:
            self.done = True
            return "Correct!", 1.0 / 2 ** (self.attempt - 1), True, False, {"attempts": self.attempt}
        left = ATTEMPTS - self.attempt
        if left == 0:
            self.done = True
            answer = ", ".join(f"{n}={v}" for n, v in zip(self.names, self.solution))
            return f"Wrong. The solution was {answer}.", 0.0, True, False, {"attempts": self.attempt}
        right = [n for n in self.names if n not in wrong]
        return (f"Wrong values for: {', '.join(wrong)}" + (f"; correct: {', '.join(right)}" if right else "")
                + f". Attempts left: {left}.", 0.0, False, False, {})
