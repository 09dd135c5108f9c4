"""Science simulation environments and their oracles."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Generator, Union

from spade_mega.envs.library.entry import LibraryEntry

Script = Generator[str, str, None]


def _simulated_range(speed: float, angle: float, g: float, drag: float) -> float:
    """Range under g and quadratic drag, by classic Runge-Kutta (the oracle's own model of the stated physics)."""
    def accel(vx: float, vy: float) -> tuple[float, float]:
        s = math.hypot(vx, vy)
        return -drag * s * vx, -g - drag * s * vy

    dt = 2 * speed * math.sin(angle) / g / 400
    x, y, vx, vy = 0.0, 0.0, speed * math.cos(angle), speed * math.sin(angle)
    while True:
        k1 = accel(vx, vy)
        k2 = accel(vx + k1[0] * dt / 2, vy + k1[1] * dt / 2)
        k3 = accel(vx + k2[0] * dt / 2, vy + k2[1] * dt / 2)
        k4 = accel(vx + k3[0] * dt, vy + k3[1] * dt)
        nx = x + dt * (vx + dt / 6 * (k1[0] + k2[0] + k3[0]))
        ny = y + dt * (vy + dt / 6 * (k1[1] + k2[1] + k3[1]))
        vx += dt / 6 * (k1[0] + 2 * k2[0] + 2 * k3[0] + k4[0])
        vy += dt / 6 * (k1[1] + 2 * k2[1] + 2 * k3[1] + k4[1])
        if ny < 0.0:
            return x + (nx - x) * y / (y - ny)
        x, y = nx, ny


def projectile_oracle(obs: str) -> Script:
    """Solve the stated physics by simulation and bisection, then correct by the secant method on the feedback."""
    g = float(re.search(r"g = ([\d.]+)", obs)[1])
    angle = math.radians(float(re.search(r"fixed (\d+) degrees", obs)[1]))
    target = float(re.search(r"target is (\d+) m away", obs)[1])
    drag = float(m[1]) if (m := re.search(r"k = ([\d.]+) per metre", obs)) else 0.0
    low, high = 0.1, 500.0
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if _simulated_range(mid, angle, g, drag) < target else (low, mid)
    speed = (low + high) / 2
    shots: list[tuple[float, float]] = []
    while True:
        obs = yield f"{speed:.4f}"
        shots.append((speed, float(re.search(r"landed at ([\d.]+) m", obs)[1])))
        if len(shots) == 1:  # range grows about as speed squared
            speed *= math.sqrt(target / shots[0][1])
            continue
        (v0, r0), (v1, r1) = shots[-2:]
        speed = v1 + (target - r1) * (v1 - v0) / (r1 - r0) if r1 != r0 else v1 * math.sqrt(target / r1)


Network = Union[str, tuple[str, "Network", "Network"]]


def _parse_network(text: str) -> Network:
    """'R1 + (R2 || R3)' -> ('+', 'R1', ('||', 'R2', 'R3')); every operator joins exactly two parts."""
    tokens = re.findall(r"R\d+|\|\||\+|\(|\)", text)
    pos = 0

    def part() -> Network:
        nonlocal pos
        token = tokens[pos]
        pos += 1
        if token != "(":
            return token
        inner = expression()
        pos += 1  # ')'
        return inner

    def expression() -> Network:
        nonlocal pos
        node = part()
        while pos < len(tokens) and tokens[pos] in ("+", "||"):
            op = tokens[pos]
            pos += 1
            node = (op, node, part())
        return node

    return expression()


def _ohms(node: Network, values: dict[str, float]) -> float:
    if isinstance(node, str):
        return values[node]
    a, b = _ohms(node[1], values), _ohms(node[2], values)
    return a + b if node[0] == "+" else 1.0 / (1.0 / a + 1.0 / b)


def _currents(node: Network, current: float, values: dict[str, float], out: dict[str, float]) -> None:
    """Current through every resistor when ``current`` enters ``node`` (parallel splits by conductance)."""
    if isinstance(node, str):
        out[node] = current
        return
    if node[0] == "+":
        _currents(node[1], current, values, out)
        _currents(node[2], current, values, out)
        return
    ga, gb = 1.0 / _ohms(node[1], values), 1.0 / _ohms(node[2], values)
    _currents(node[1], current * ga / (ga + gb), values, out)
    _currents(node[2], current * gb / (ga + gb), values, out)


def circuit_oracle(obs: str) -> Script:
    volts = float(re.search(r"A ([\d.]+) V battery", obs)[1])
    network = _parse_network(re.search(r"^Network: (.*)$", obs, re.M)[1])
    values = {n: float(v) for n, v in re.findall(r"(R\d+) = (\d+) ohm", obs)}
    total = _ohms(network, values)
    amps: dict[str, float] = {}
    _currents(network, volts / total, values, amps)
    while True:
        question = re.findall(r"Question \d+: what is (.*)\?", obs)[-1]
        name = re.search(r"R\d+", question)
        if "total resistance" in question:
            answer = total
        elif "battery" in question:
            answer = 1000 * volts / total
        elif question.startswith("the voltage"):
            answer = amps[name[0]] * values[name[0]]
        elif question.startswith("the current"):
            answer = 1000 * amps[name[0]]
        else:
            answer = 1000 * amps[name[0]] ** 2 * values[name[0]]
        obs = yield f"{answer:.6g}"


def _element_counts(formula: str) -> dict[str, int]:
    """Atoms per element of a formula, bracketed groups included: Al2(SO4)3 -> Al 2, S 3, O 12."""
    counts: dict[str, int] = {}
    for group, times in re.findall(r"\(([^)]*)\)(\d*)", formula):
        for element, n in _element_counts(group).items():
            counts[element] = counts.get(element, 0) + n * int(times or 1)
    for element, n in re.findall(r"([A-Z][a-z]?)(\d*)", re.sub(r"\([^)]*\)\d*", "", formula)):
        counts[element] = counts.get(element, 0) + int(n or 1)
    return counts


def balance_equation_oracle(obs: str) -> Script:
    """Null space of the element-by-species matrix (Gauss-Jordan over the rationals), scaled to whole numbers."""
    left, right = re.search(r"Balance this chemical equation: (.*)", obs)[1].split(" -> ")
    species = [(f, 1) for f in left.split(" + ")] + [(f, -1) for f in right.split(" + ")]
    elements = sorted({el for f, _ in species for el in _element_counts(f)})
    rows = [[Fraction(sign * _element_counts(f).get(el, 0)) for f, sign in species] for el in elements]
    pivots: list[int] = []
    r = 0
    for col in range(len(species)):
        pivot = next((i for i in range(r, len(rows)) if rows[i][col] != 0), None)
        if pivot is None:
            continue
        rows[r], rows[pivot] = rows[pivot], rows[r]
        rows[r] = [v / rows[r][col] for v in rows[r]]
        for i in range(len(rows)):
            if i != r and rows[i][col] != 0:
                rows[i] = [a - rows[i][col] * b for a, b in zip(rows[i], rows[r])]
        pivots.append(col)
        r += 1
    free = next(c for c in range(len(species)) if c not in pivots)  # the null space is one-dimensional
    solution = [Fraction(0)] * len(species)
    solution[free] = Fraction(1)
    for i, col in enumerate(pivots):
        solution[col] = -rows[i][free]
    scale = math.lcm(*(v.denominator for v in solution))
    whole = [int(v * scale) for v in solution]
    divisor = math.gcd(*whole)
    answer = ", ".join(str(abs(v // divisor)) for v in whole)
    while True:
        yield answer


def thermostat_oracle(obs: str) -> Script:
    """Measure (full power, then off), fit dT = leak*(outside - T) + gain*power by least squares, then control."""
    outside = float(re.search(r"Outside it is (-?[\d.]+) C", obs)[1])
    target = float(re.search(r"Keep the room at ([\d.]+) C", obs)[1])
    temp = float(re.search(r"the room is (-?[\d.]+) C now", obs)[1])
    samples: list[tuple[float, float, float]] = []
    power = 10.0
    while True:
        obs = yield f"{power:.3f}"
        new = float(re.search(r"to (-?[\d.]+) C", obs)[1])
        samples.append((outside - temp, power, new - temp))
        temp = new
        if len(samples) == 1:
            power = 0.0
            continue
        sxx = sum(x * x for x, _, _ in samples)
        sxp = sum(x * p for x, p, _ in samples)
        spp = sum(p * p for _, p, _ in samples)
        sxd = sum(x * d for x, _, d in samples)
        spd = sum(p * d for _, p, d in samples)
        det = sxx * spp - sxp * sxp
        leak, gain = (sxd * spp - spd * sxp) / det, (spd * sxx - sxd * sxp) / det
        power = min(10.0, max(0.0, (target - temp - leak * (outside - temp)) / gain)) if gain > 0 else 5.0


ENTRIES = [
    LibraryEntry(
        name="projectile",
        skill="science",
        summary="kinematics with and without quadratic air drag; calibrating from where each shot lands",
        hint="Without drag the range is v^2 * sin(2*angle) / g, so start with v = sqrt(distance * g / "
             "sin(2*angle)). Drag makes shots fall short: after each miss multiply the speed by "
             "sqrt(target / landed) (range grows about as speed squared) and shoot again.",
        oracle=projectile_oracle,
        target_return=0.75,
        action_examples=("{int}", "{int}.5", "{int} m/s"),
    ),
    LibraryEntry(
        name="circuit",
        skill="science",
        summary="Ohm's law on nested series/parallel resistor networks: resistance, currents, voltages, power",
        hint="Series resistances add; two in parallel combine as a*b/(a+b). Reduce from the innermost brackets "
             "out. Series parts carry the same current; parallel branches share the same voltage and split the "
             "current in inverse proportion to their resistance. P = V^2/R = I^2*R; 1 A = 1000 mA.",
        oracle=circuit_oracle,
        target_return=1.0,
        action_examples=("{int}", "{int}.{int}", "{int} ohm"),
    ),
    LibraryEntry(
        name="balance_equation",
        skill="science",
        summary="conserving atoms: smallest whole-number coefficients, bracketed groups and redox included",
        hint="Count each element on both sides, treating a bracketed group like (SO4)3 as three of each atom "
             "inside. Balance the element that appears in the fewest formulas first, keep free elements "
             "(O2, H2, Cl2) for last, and finally divide all coefficients by their common factor.",
        oracle=balance_equation_oracle,
        target_return=1.0,
        action_examples=("{int}, {int}, {int}", "{int}, {int}, {int}, {int}", "1, 1, 1"),
    ),
    LibraryEntry(
        name="thermostat",
        skill="science",
        summary="system identification and control: measure a heater's unknown rates, then reach and hold a set point",
        hint="The change per turn is linear: dT = leak*(outside - T) + gain*power. Spend two turns measuring "
             "(e.g. power 10, then power 0), solve the two equations for leak and gain, then each turn set "
             "power = (target - T - leak*(outside - T)) / gain, clipped to 0..10.",
        oracle=thermostat_oracle,
        target_return=0.9,  # the oracle wins when HOLD turns in a row end on target; noise at the hardest level can
        # knock it off target (59 of 60 seeds won there)
        action_examples=("{int}", "{int}.5", "10", "0"),
    ),
]
