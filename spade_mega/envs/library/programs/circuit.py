"""DC resistor networks: total resistance, battery current, and voltages and currents of single resistors."""

import random

# difficulty (rendered by the library; each range reads easy..hard)
RESISTORS = 3  # 2..7: resistors in the network
QUESTIONS = 3  # 2..5: questions, one per turn
# end difficulty

VALUES = [10, 20, 22, 33, 47, 50, 68, 100, 150, 220, 330, 470]


def _build(rng, names, kind):
    """A random series/parallel tree over ``names``; children alternate the connection kind."""
    if len(names) == 1:
        return names[0]
    cut = rng.randint(1, len(names) - 1)
    other = "parallel" if kind == "series" else "series"
    return (kind, _build(rng, names[:cut], other), _build(rng, names[cut:], other))


def _text(node, top=True):
    if isinstance(node, str):
        return node
    body = f"{_text(node[1], False)} {'+' if node[0] == 'series' else '||'} {_text(node[2], False)}"
    return body if top else f"({body})"


def _resistance(node, ohms):
    if isinstance(node, str):
        return ohms[node]
    a, b = _resistance(node[1], ohms), _resistance(node[2], ohms)
    return a + b if node[0] == "series" else a * b / (a + b)


def _voltages(node, volts, ohms, out):
    """Voltage across every resistor when ``volts`` is across ``node``."""
    if isinstance(node, str):
        out[node] = volts
        return
    if node[0] == "parallel":
        _voltages(node[1], volts, ohms, out)
        _voltages(node[2], volts, ohms, out)
        return
    current = volts / _resistance(node, ohms)
    for child in node[1:]:
        _voltages(child, current * _resistance(child, ohms), ohms, out)


class Circuit:
    max_turns = QUESTIONS

    def reset(self, seed):
        rng = random.Random(seed)
        names = [f"R{i + 1}" for i in range(RESISTORS)]
        self.ohms = {n: rng.choice(VALUES) for n in names}
        self.volts = float(rng.choice([3, 5, 6, 9, 12, 24]))
        self.tree = _build(rng, names, rng.choice(["series", "parallel"]))
        total = _resistance(self.tree, self.ohms)
        across = {}
        _voltages(self.tree, self.volts, self.ohms, across)
        asks = [("the total resistance of the network, in ohms", total),
                ("the current drawn from the battery, in milliamps", 1000 * self.volts / total)]
        for _ in range(QUESTIONS - 2):
            n = rng.choice(names)
            kind = rng.choice(["voltage", "current", "power"])
            if kind == "voltage":
                asks.append((f"the voltage across {n}, in volts", across[n]))
            elif kind == "current":
                asks.append((f"the current through {n}, in milliamps", 1000 * across[n] / self.ohms[n]))
            else:
                asks.append((f"the power dissipated in {n}, in milliwatts", 1000 * across[n] ** 2 / self.ohms[n]))
        self.asks = asks
        self.turn = 0
        self.done = False
        parts = ", ".join(f"{n} = {self.ohms[n]} ohm" for n in names)
        return (f"A {self.volts:g} V battery drives this resistor network ('+' joins in series, '||' in parallel):\n"
                f"Network: {_text(self.tree)}\nResistors: {parts}\n"
                f"Answer {QUESTIONS} questions, one per turn, each with a number (1% tolerance).\n"
                f"Question 1: what is {asks[0][0]}?")

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        question, truth = self.asks[self.turn]
        self.turn += 1
        try:
            value = float(action.strip().split()[0].rstrip(",;"))
        except (ValueError, IndexError):
            value = None
        ok = value is not None and abs(value - truth) <= 0.01 * abs(truth) + 1e-9
        verdict = f"Correct ({truth:.4g})." if ok else f"Wrong: {question} is {truth:.4g}."
        reward = 1.0 / QUESTIONS if ok else 0.0
        if self.turn == QUESTIONS:
            self.done = True
            return verdict + " That was the last question.", reward, True, False, {}
        return (f"{verdict}\nQuestion {self.turn + 1}: what is {self.asks[self.turn][0]}?", reward, False, False, {})
