"""The built-in offline corpus: grounding documents that need no download (``builtin:maths|science|code``).

- ``maths``: written explanations with procedurally generated, correctly solved worked examples (algebra, number
  theory, sequences, counting, probability, bases, logic puzzles, orderings, grid routes).
- ``science``: written explanations of simple dynamical systems with parameters drawn at random and the simulation
  tables computed step by step (kinematics, decay, cooling, populations, predator-prey, epidemics, circuits, gases).
- ``code``: the docstrings and source of the Python standard library, read with ``ast`` (nothing is imported), one
  document per public class or per module's functions.

Every document is a pure function of (kind, index), so the corpus is identical on every machine with the same Python.
"""

from __future__ import annotations

import ast
import math
import random
import sysconfig
from fractions import Fraction
from itertools import product
from pathlib import Path
from typing import Callable, Iterator

MATHS_DOCUMENTS = 600
SCIENCE_DOCUMENTS = 300

# ------------------------------------------------------------------------------------------------------------ maths


def _linear(rng: random.Random) -> str:
    lines = ["A linear equation in one unknown has the form a*x + b = c. Subtract b from both sides, then divide by a."
             " Always check the answer by substituting it back."]
    for _ in range(rng.randint(3, 5)):
        a, x = rng.choice([i for i in range(-12, 13) if i]), rng.randint(-30, 30)
        b = rng.randint(-50, 50)
        c = a * x + b
        lines.append(f"Solve {a}*x + {b} = {c}. Subtracting {b} gives {a}*x = {c - b}; dividing by {a} gives x = {x}. "
                     f"Check: {a}*{x} + {b} = {c}.")
    return "\n\n".join(lines)


def _quadratic(rng: random.Random) -> str:
    lines = ["A quadratic x^2 + p*x + q = 0 with integer roots r and s factors as (x - r)(x - s): the roots add up "
             "to -p and multiply to q. Look for two integers with that sum and product."]
    for _ in range(rng.randint(3, 5)):
        r, s = rng.randint(-15, 15), rng.randint(-15, 15)
        p, q = -(r + s), r * s
        lines.append(f"Solve x^2 + ({p})*x + ({q}) = 0. We need two numbers with sum {-p} and product {q}: "
                     f"{r} and {s}. So (x - ({r}))(x - ({s})) = 0 and x = {r} or x = {s}. "
                     f"The vertex lies at x = {Fraction(-p, 2)}.")
    return "\n\n".join(lines)


def _modular(rng: random.Random) -> str:
    m = rng.choice([7, 9, 11, 13, 17, 19, 23, 29, 31, 37])
    a, k = rng.randint(2, m - 1), rng.randint(10, 200)
    lines = [f"Modular arithmetic works with remainders. Modulo {m}, two integers are equal when their difference is a"
             f" multiple of {m}. To compute a power a^k mod m, square repeatedly and multiply the squares selected by "
             f"the binary digits of k.", f"Compute {a}^{k} mod {m}. In binary, {k} = {bin(k)[2:]}."]
    square, result, bit = a % m, 1, 0
    while k >> bit:
        if (k >> bit) & 1:
            result = result * square % m
            lines.append(f"Bit {bit} is 1: multiply by {a}^{1 << bit} = {square} (mod {m}); running product {result}.")
        square, bit = square * square % m, bit + 1
    lines.append(f"So {a}^{k} = {result} (mod {m}); Python's pow({a}, {k}, {m}) agrees: {pow(a, k, m)}.")
    for _ in range(3):
        x, y = rng.randint(100, 999), rng.randint(100, 999)
        lines.append(f"{x} + {y} = {x + y} = {(x + y) % m} (mod {m}); {x} * {y} = {x * y} = {x * y % m} (mod {m}).")
    return "\n\n".join(lines)


def _euclid(rng: random.Random) -> str:
    lines = ["Euclid's algorithm finds the greatest common divisor: replace (a, b) by (b, a mod b) until b is zero. "
             "The least common multiple is a*b / gcd(a, b)."]
    for _ in range(rng.randint(2, 4)):
        g = rng.randint(2, 40)
        a, b = g * rng.randint(2, 60), g * rng.randint(2, 60)
        steps, x, y = [], a, b
        while y:
            steps.append(f"{x} = {x // y}*{y} + {x % y}")
            x, y = y, x % y
        lines.append(f"gcd({a}, {b}): " + "; ".join(steps) + f". The gcd is {x} and the lcm is {a * b // x}.")
    return "\n\n".join(lines)


def _sequences(rng: random.Random) -> str:
    a, d, n = rng.randint(-20, 20), rng.randint(-9, 9) or 3, rng.randint(8, 40)
    g, r, m = rng.randint(1, 9), rng.choice([2, 3, -2, 5]), rng.randint(5, 12)
    terms = ", ".join(str(a + i * d) for i in range(6))
    gterms = ", ".join(str(g * r ** i) for i in range(6))
    return (f"An arithmetic sequence adds a fixed difference d to each term: a_n = a_1 + (n - 1)*d, and the sum of the "
            f"first n terms is n*(a_1 + a_n)/2.\n\nThe sequence {terms}, ... has a_1 = {a} and d = {d}. Its term "
            f"number {n} is {a} + {n - 1}*{d} = {a + (n - 1) * d}, and the first {n} terms add up to "
            f"{n * (2 * a + (n - 1) * d) // 2}.\n\nA geometric sequence multiplies by a fixed ratio r: g_n = g_1*r^(n-1)"
            f", with sum g_1*(r^n - 1)/(r - 1) when r != 1.\n\nThe sequence {gterms}, ... has g_1 = {g} and r = {r}. Its"
            f" term number {m} is {g * r ** (m - 1)} and the first {m} terms add up to {g * (r ** m - 1) // (r - 1)}.")


def _counting(rng: random.Random) -> str:
    lines = ["Counting: the number of ordered arrangements of k items chosen from n is n!/(n-k)!, and the number of "
             "unordered selections is C(n, k) = n!/(k!(n-k)!). Pascal's rule C(n, k) = C(n-1, k-1) + C(n-1, k) "
             "builds the triangle row by row."]
    for _ in range(rng.randint(3, 5)):
        n = rng.randint(4, 20)
        k = rng.randint(1, n - 1)
        lines.append(f"From {n} people choose {k}: {math.comb(n, k)} committees, and {math.perm(n, k)} ordered line-ups"
                     f" (each committee can be ordered in {math.factorial(k)} ways).")
    row = rng.randint(5, 9)
    lines.append(f"Row {row} of Pascal's triangle: " + " ".join(str(math.comb(row, i)) for i in range(row + 1)) + ".")
    return "\n\n".join(lines)


def _dice(rng: random.Random) -> str:
    s1, s2 = rng.choice([4, 6, 8]), rng.choice([4, 6, 10, 12])
    counts: dict[int, int] = {}
    for x, y in product(range(1, s1 + 1), range(1, s2 + 1)):
        counts[x + y] = counts.get(x + y, 0) + 1
    total = s1 * s2
    table = "\n".join(f"sum {s:2d}: {c:2d}/{total} = {c / total:.3f}" for s, c in sorted(counts.items()))
    red, blue = rng.randint(2, 9), rng.randint(2, 9)
    both = Fraction(red, red + blue) * Fraction(red - 1, red + blue - 1)
    return (f"Probability of an event with equally likely outcomes = favourable outcomes / all outcomes. Rolling a "
            f"{s1}-sided and a {s2}-sided die gives {total} equally likely pairs; the distribution of the sum is:\n"
            f"{table}\n\nExpected sum: {(s1 + 1) / 2 + (s2 + 1) / 2}.\n\nAn urn holds {red} red and {blue} blue balls. "
            f"Drawing two without replacement, both are red with probability {red}/{red + blue} * {red - 1}/"
            f"{red + blue - 1} = {both}.")


def _bases(rng: random.Random) -> str:
    lines = ["To write n in base b, divide by b repeatedly; the remainders, read from last to first, are the digits. "
             "To read a base-b numeral, multiply the running value by b and add the next digit."]
    digits = "0123456789ABCDEF"
    for _ in range(rng.randint(2, 4)):
        n, b = rng.randint(50, 5000), rng.choice([2, 3, 5, 7, 8, 12, 16])
        x, steps, out = n, [], ""
        while x:
            steps.append(f"{x} = {x // b}*{b} + {x % b}")
            out = digits[x % b] + out
            x //= b
        lines.append(f"{n} in base {b}: " + "; ".join(steps) + f". Reading the remainders upwards: {out}.")
    return "\n\n".join(lines)


def _truth_table(rng: random.Random) -> str:
    ops = [("and", lambda a, b: a and b), ("or", lambda a, b: a or b), ("implies", lambda a, b: (not a) or b),
           ("xor", lambda a, b: a != b)]
    (n1, f1), (n2, f2) = rng.sample(ops, 2)
    neg = rng.random() < 0.5
    rows = []
    for p, q, r in product([False, True], repeat=3):
        left = f1(p, q)
        value = f2(not left if neg else left, r)
        rows.append(f"p={int(p)} q={int(q)} r={int(r)} -> {int(value)}")
    formula = f"({'not ' if neg else ''}(p {n1} q)) {n2} r"
    count = sum(row.endswith("1") for row in rows)
    return (f"A truth table lists a formula's value for every assignment of its variables. 'p implies q' is false "
            f"only when p is true and q is false; 'xor' is true when exactly one side is true.\n\nFormula: {formula}\n"
            + "\n".join(rows) + f"\n\nThe formula is true in {count} of 8 rows; it is "
            + ("a tautology." if count == 8 else "unsatisfiable." if count == 0 else "satisfiable but not valid."))


def _knights(rng: random.Random) -> str:
    names = rng.sample(["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus"], 3)
    truth = [rng.random() < 0.5 for _ in names]
    statements = []
    for i, name in enumerate(names):
        j = rng.choice([k for k in range(3) if k != i])
        claim_knight = truth[j] if truth[i] else not truth[j]
        statements.append((i, j, claim_knight))
    lines = ["On the island, knights always tell the truth and knaves always lie. Try every assignment of roles and "
             "keep those where each knight's statement is true and each knave's statement is false."]
    for i, j, claim in statements:
        lines.append(f"{names[i]} says: '{names[j]} is a {'knight' if claim else 'knave'}.'")
    solutions = [roles for roles in product([True, False], repeat=3)
                 if all(roles[i] == (roles[j] == claim) for i, j, claim in statements)]
    lines.append(f"{len(solutions)} assignment(s) fit: " + "; ".join(
        ", ".join(f"{n} {'knight' if k else 'knave'}" for n, k in zip(names, roles)) for roles in solutions) + ".")
    return "\n".join(lines)


def _ordering(rng: random.Random) -> str:
    people = rng.sample(["Ana", "Bo", "Cy", "Di", "Ed", "Flo", "Gil"], rng.randint(4, 5))
    order = people[:]
    rng.shuffle(order)
    clues = []
    for _ in range(len(order) + 1):
        a, b = rng.sample(order, 2)
        clues.append(f"{a} stands somewhere left of {b}." if order.index(a) < order.index(b)
                     else f"{a} stands somewhere right of {b}.")
    clues.append(f"{order[0]} is first in the row.")
    return ("Ordering puzzles are solved by turning each clue into a constraint between positions and narrowing the "
            "possibilities; a clue about the first or last place anchors the row.\n\nClues:\n" + "\n".join(clues)
            + f"\n\nOne order consistent with all clues: {', '.join(order)}.")


def _grid(rng: random.Random) -> str:
    h, w = rng.randint(5, 8), rng.randint(6, 10)
    while True:
        walls = {(r, c) for r in range(h) for c in range(w) if rng.random() < 0.25}
        walls -= {(0, 0), (h - 1, w - 1)}
        prev: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {(0, 0): None}
        frontier = [(0, 0)]
        for cell in frontier:  # breadth-first search: the list grows while we walk it
            for move, (dr, dc) in (("down", (1, 0)), ("right", (0, 1)), ("up", (-1, 0)), ("left", (0, -1))):
                nxt = (cell[0] + dr, cell[1] + dc)
                if 0 <= nxt[0] < h and 0 <= nxt[1] < w and nxt not in walls and nxt not in prev:
                    prev[nxt] = (cell, move)
                    frontier.append(nxt)
        if (h - 1, w - 1) in prev:
            break
    moves, cell = [], (h - 1, w - 1)
    while prev[cell] is not None:
        cell, move = prev[cell]  # type: ignore[misc]
        moves.append(move)
    moves.reverse()
    grid = "\n".join("".join("S" if (r, c) == (0, 0) else "G" if (r, c) == (h - 1, w - 1) else
                             "#" if (r, c) in walls else "." for c in range(w)) for r in range(h))
    return ("Grid navigation: '#' is a wall, '.' is free, S the start and G the goal; moves are up, down, left, "
            "right. Breadth-first search explores cells in order of distance, so the first time it reaches the goal "
            f"it has found a shortest route.\n\n{grid}\n\nThe shortest route takes {len(moves)} moves: "
            f"{', '.join(moves)}. Breadth-first search reached {len(prev)} of {h * w - len(walls)} free cells.")


def _fractions(rng: random.Random) -> str:
    lines = ["Fractions add over a common denominator; percentages are fractions of 100; compound growth multiplies "
             "by (1 + rate) once per period."]
    for _ in range(3):
        a, b = Fraction(rng.randint(1, 9), rng.randint(2, 12)), Fraction(rng.randint(1, 9), rng.randint(2, 12))
        lines.append(f"{a} + {b} = {a + b}; {a} - {b} = {a - b}; {a} * {b} = {a * b}; {a} / {b} = {a / b}.")
    principal, rate, years = rng.randint(100, 5000), rng.choice([2, 3, 4, 5, 8, 10]), rng.randint(2, 10)
    lines.append(f"{principal} at {rate}% a year for {years} years grows to "
                 f"{principal * (1 + rate / 100) ** years:.2f}; simple interest would give "
                 f"{principal * (1 + rate * years / 100):.2f}.")
    return "\n\n".join(lines)


MATHS_TOPICS: dict[str, Callable[[random.Random], str]] = {
    "linear equations": _linear, "quadratic equations": _quadratic, "modular arithmetic": _modular,
    "greatest common divisor": _euclid, "sequences and series": _sequences, "counting": _counting,
    "probability": _dice, "number bases": _bases, "truth tables": _truth_table, "knights and knaves": _knights,
    "ordering puzzles": _ordering, "grid routes": _grid, "fractions and interest": _fractions,
}

# ---------------------------------------------------------------------------------------------------------- science


def _table(header: str, rows: list[str]) -> str:
    return header + "\n" + "\n".join(rows)


def _projectile(rng: random.Random) -> str:
    v, angle, dt = rng.uniform(8, 40), rng.randint(15, 75), rng.choice([0.1, 0.2, 0.25])
    vx, vy = v * math.cos(math.radians(angle)), v * math.sin(math.radians(angle))
    rows, t, x, y = [], 0.0, 0.0, 0.0
    while y >= 0 and len(rows) < 40:
        rows.append(f"t={t:5.2f} s  x={x:7.2f} m  y={y:6.2f} m")
        t += dt
        x, y = vx * t, vy * t - 4.9 * t * t
    return (f"A projectile launched at {v:.1f} m/s and {angle} degrees above the ground moves with constant horizontal"
            f" speed {vx:.2f} m/s while gravity (9.8 m/s^2) slows its vertical speed {vy:.2f} m/s. Its flight lasts "
            f"2*vy/g = {2 * vy / 9.8:.2f} s, its range is {2 * vx * vy / 9.8:.2f} m and its peak height "
            f"{vy * vy / 19.6:.2f} m.\n\n" + _table(f"Positions every {dt} s:", rows))


def _decay(rng: random.Random) -> str:
    half, n0, dt = rng.choice([3, 5, 8, 12, 30]), rng.randint(1000, 100000), rng.choice([1, 2, 5])
    lam = math.log(2) / half
    rows = [f"t={t:3d}  N={n0 * math.exp(-lam * t):10.1f}" for t in range(0, 5 * half + 1, dt)][:30]
    return (f"Radioactive decay: each nucleus decays independently, so N(t) = N0 * exp(-lambda*t) with lambda = "
            f"ln 2 / half-life. With a half-life of {half} time units, lambda = {lam:.4f}; after one half-life "
            f"{n0 // 2} of {n0} nuclei remain.\n\n" + _table("Remaining nuclei:", rows))


def _cooling(rng: random.Random) -> str:
    t0, env, k, dt = rng.uniform(60, 95), rng.uniform(15, 25), rng.uniform(0.02, 0.2), rng.choice([1, 2, 5])
    rows, temp = [], t0
    for step in range(25):
        rows.append(f"minute {step * dt:3d}: {temp:6.2f} C")
        temp += -k * (temp - env) * dt
    return (f"Newton's law of cooling: a body loses heat at a rate proportional to the difference with its "
            f"surroundings, dT/dt = -k*(T - T_env). A cup at {t0:.1f} C in a {env:.1f} C room with k = {k:.3f} per "
            f"minute, stepped with Euler's method every {dt} minute(s):\n\n" + _table("Temperature:", rows))


def _logistic(rng: random.Random) -> str:
    r, cap, p = rng.uniform(0.1, 0.9), rng.randint(200, 5000), rng.randint(5, 50)
    rows = []
    for gen in range(20):
        rows.append(f"generation {gen:2d}: {p:9.1f}")
        p = p + r * p * (1 - p / cap)
    return (f"Logistic growth: a population grows by r*P*(1 - P/K) per generation; growth is nearly exponential while"
            f" P is small and stops at the carrying capacity K. Here r = {r:.3f} and K = {cap}.\n\n"
            + _table("Population:", rows))


def _predator_prey(rng: random.Random) -> str:
    a, b, c, d = rng.uniform(0.5, 1.2), rng.uniform(0.01, 0.05), rng.uniform(0.3, 0.9), rng.uniform(0.005, 0.02)
    prey, pred, dt = rng.uniform(20, 80), rng.uniform(5, 20), 0.1
    rows = []
    for step in range(30):
        rows.append(f"t={step * dt:4.1f}  prey={prey:7.2f}  predators={pred:6.2f}")
        prey, pred = prey + dt * (a * prey - b * prey * pred), pred + dt * (d * prey * pred - c * pred)
    return (f"Lotka-Volterra predator-prey model: prey grow at rate a and are eaten at rate b*prey*predators; "
            f"predators grow at d*prey*predators and die at rate c. Parameters a={a:.2f}, b={b:.3f}, c={c:.2f}, "
            f"d={d:.4f}; the populations cycle around prey = c/d = {c / d:.1f}, predators = a/b = {a / b:.1f}.\n\n"
            + _table("Euler steps:", rows))


def _sir(rng: random.Random) -> str:
    n, beta, gamma = rng.randint(1000, 100000), rng.uniform(0.2, 0.6), rng.uniform(0.05, 0.2)
    s, i, r = n - 10.0, 10.0, 0.0
    rows = []
    for day in range(0, 60, 3):
        rows.append(f"day {day:2d}: S={s:9.0f} I={i:8.0f} R={r:9.0f}")
        for _ in range(3):
            new_inf, new_rec = beta * s * i / n, gamma * i
            s, i, r = s - new_inf, i + new_inf - new_rec, r + new_rec
    return (f"The SIR epidemic model splits a population of {n} into susceptible, infected and recovered people. Each"
            f" day beta*S*I/N people are infected (beta = {beta:.2f}) and gamma*I recover (gamma = {gamma:.2f}). The "
            f"basic reproduction number is R0 = beta/gamma = {beta / gamma:.2f}: the outbreak grows only if R0 > 1.\n\n"
            + _table("Daily state:", rows))


def _circuit(rng: random.Random) -> str:
    volts = rng.choice([3, 5, 9, 12, 24])
    rs = [rng.choice([10, 22, 47, 100, 220, 330, 470, 1000]) for _ in range(rng.randint(2, 4))]
    series = sum(rs)
    parallel = 1 / sum(1 / x for x in rs)
    lines = [f"Ohm's law: current I = V/R. Resistors in series add; in parallel their conductances 1/R add. A "
             f"{volts} V battery drives resistors of {', '.join(map(str, rs))} ohms.",
             f"In series the total is {series} ohms and the current {volts / series * 1000:.2f} mA; the voltage drops "
             f"are " + ", ".join(f"{volts * x / series:.2f} V" for x in rs) + ".",
             f"In parallel the total is {parallel:.2f} ohms; branch currents are "
             + ", ".join(f"{volts / x * 1000:.1f} mA" for x in rs) + f", {volts / parallel * 1000:.1f} mA in all. "
             f"Power drawn: {volts * volts / parallel:.2f} W."]
    return "\n\n".join(lines)


def _gas(rng: random.Random) -> str:
    lines = ["The ideal gas law PV = nRT (R = 8.314 J/(mol K)) links pressure, volume, amount and temperature. At "
             "fixed n and T, pressure is inversely proportional to volume (Boyle); at fixed P, volume grows with "
             "temperature (Charles)."]
    for _ in range(3):
        n, temp, vol = rng.uniform(0.1, 5), rng.uniform(250, 600), rng.uniform(0.001, 0.1)
        p = n * 8.314 * temp / vol
        lines.append(f"{n:.2f} mol at {temp:.0f} K in {vol * 1000:.1f} L exerts {p / 1000:.1f} kPa; halving the "
                     f"volume gives {2 * p / 1000:.1f} kPa, heating to {temp * 1.5:.0f} K at fixed volume gives "
                     f"{1.5 * p / 1000:.1f} kPa.")
    return "\n\n".join(lines)


def _spring(rng: random.Random) -> str:
    m, k, x0, dt = rng.uniform(0.2, 3), rng.uniform(5, 80), rng.uniform(0.02, 0.3), 0.05
    x, v, rows = x0, 0.0, []
    for step in range(24):
        energy = 0.5 * m * v * v + 0.5 * k * x * x
        rows.append(f"t={step * dt:4.2f}  x={x:+.4f} m  v={v:+.4f} m/s  E={energy:.5f} J")
        v -= k / m * x * dt  # semi-implicit Euler keeps the energy bounded
        x += v * dt
    return (f"A mass of {m:.2f} kg on a spring of stiffness {k:.1f} N/m oscillates with period 2*pi*sqrt(m/k) = "
            f"{2 * math.pi * math.sqrt(m / k):.3f} s. Released from {x0:.3f} m, its energy 0.5*k*x^2 = "
            f"{0.5 * k * x0 * x0:.5f} J moves between the spring and the motion.\n\n" + _table("Semi-implicit Euler:", rows))


def _kinetics(rng: random.Random) -> str:
    k, a0 = rng.uniform(0.01, 0.5), rng.uniform(0.1, 2.0)
    rows = [f"t={t:3d} s  [A]={a0 * math.exp(-k * t):.4f} M  [B]={a0 - a0 * math.exp(-k * t):.4f} M"
            for t in range(0, 40, 2)]
    return (f"A first-order reaction A -> B proceeds at rate k*[A], so [A] = [A]0*exp(-k*t). With k = {k:.3f} per "
            f"second and [A]0 = {a0:.2f} M, half of A is gone after ln 2 / k = {math.log(2) / k:.2f} s.\n\n"
            + _table("Concentrations:", rows))


SCIENCE_TOPICS: dict[str, Callable[[random.Random], str]] = {
    "projectile motion": _projectile, "radioactive decay": _decay, "cooling": _cooling,
    "logistic growth": _logistic, "predator and prey": _predator_prey, "epidemics": _sir, "circuits": _circuit,
    "ideal gases": _gas, "oscillators": _spring, "reaction kinetics": _kinetics,
}

# ------------------------------------------------------------------------------------------------------------- code

STDLIB_MODULES = (
    "bisect", "heapq", "json/__init__", "json/decoder", "json/encoder", "collections/__init__", "functools",
    "textwrap", "string", "fractions", "_pydecimal", "statistics", "random", "calendar", "difflib", "shlex", "csv",
    "configparser", "argparse", "pathlib", "datetime", "enum", "dataclasses", "graphlib", "ipaddress", "queue",
    "sched", "urllib/parse", "html/parser", "fnmatch", "glob", "gzip", "base64", "copy", "pprint", "reprlib",
    "operator", "contextlib", "abc", "numbers", "colorsys", "tokenize", "ast", "inspect", "traceback", "typing",
    "weakref", "shutil", "tempfile", "zipfile", "tarfile", "logging/__init__", "unittest/case", "email/message",
    "http/cookies", "imaplib", "smtplib", "ftplib", "sqlite3/__init__", "uuid", "secrets", "hmac", "selectors",
    "threading", "concurrent/futures/_base", "asyncio/queues", "asyncio/locks", "plistlib", "wave", "quopri",
    "codecs", "locale", "gettext", "optparse", "getopt", "cmd", "code", "codeop", "timeit", "trace", "pdb",
    "zoneinfo/_zoneinfo", "tomllib/_parser", "xml/dom/minidom", "xml/etree/ElementTree", "mailbox", "netrc",
    "filecmp", "linecache", "stat", "os", "posixpath", "subprocess", "signal", "socket", "ssl", "struct",
)


def _code_documents() -> Iterator[tuple[str, str]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for module in STDLIB_MODULES:
        path = stdlib / f"{module}.py"
        if not path.is_file():
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        tree = ast.parse(source)
        lines = source.splitlines(keepends=True)

        def segment(node: ast.AST) -> str:
            return "".join(lines[node.lineno - 1:node.end_lineno])

        name = module.removesuffix("/__init__").replace("/", ".")
        functions = []
        for node in tree.body:
            public = not node.name.startswith("_") if hasattr(node, "name") else False
            if isinstance(node, ast.ClassDef) and public and ast.get_docstring(node):
                yield f"{name}.{node.name}", (f"Python standard library, module {name}, class {node.name}.\n\n"
                                              + segment(node))
            elif isinstance(node, ast.FunctionDef) and public and ast.get_docstring(node):
                functions.append(segment(node))
        doc = ast.get_docstring(tree) or ""
        if functions or doc:
            yield name, f"Python standard library, module {name}.\n\n{doc}\n\n" + "\n\n".join(functions)


def _procedural(topics: dict[str, Callable[[random.Random], str]], kind: str, count: int) -> Iterator[tuple[str, str]]:
    names = sorted(topics)
    for index in range(count):
        topic = names[index % len(names)]
        rng = random.Random(f"builtin:{kind}:{index}")
        parts = [topics[topic](rng) for _ in range(rng.randint(2, 3))]
        yield f"{index:05d}", f"{topic.capitalize()}.\n\n" + "\n\n".join(parts)


def builtin_documents(kind: str) -> Iterator[tuple[str, str]]:
    """(id, text) of every document of a built-in corpus kind: ``maths``, ``science`` or ``code``."""
    if kind == "maths":
        return _procedural(MATHS_TOPICS, kind, MATHS_DOCUMENTS)
    if kind == "science":
        return _procedural(SCIENCE_TOPICS, kind, SCIENCE_DOCUMENTS)
    if kind == "code":
        return _code_documents()
    from spade_mega.curriculum.corpus import CorpusError

    raise CorpusError(f"builtin:{kind}: unknown built-in corpus (choose builtin:maths, builtin:science or builtin:code)")
