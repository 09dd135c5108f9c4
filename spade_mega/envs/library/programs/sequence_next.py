"""Predict the next terms of an integer sequence; each true term is revealed after the guess."""

import random

# difficulty (rendered by the library; each range reads easy..hard)
KINDS = 3  # 2..6: sequence rules in play (arithmetic, geometric, quadratic, Fibonacci-like, interleaved, cubic)
SHOWN = 6  # 7..5: terms shown before the first prediction
PREDICT = 3  # 2..5: terms to predict, one per turn
# end difficulty

RULES = ["arithmetic", "geometric", "quadratic", "fibonacci", "interleaved", "cubic"]


def _predict(rule, seq):
    """The next term under ``rule`` if the whole of ``seq`` follows it, else None."""
    n = len(seq)
    if rule == "arithmetic":
        d = seq[1] - seq[0]
        ok = all(seq[i + 1] - seq[i] == d for i in range(n - 1))
        return seq[-1] + d if ok else None
    if rule == "geometric":
        if seq[0] == 0 or seq[1] % seq[0]:
            return None
        r = seq[1] // seq[0]
        ok = all(seq[i + 1] == seq[i] * r for i in range(n - 1))
        return seq[-1] * r if ok else None
    if rule in ("quadratic", "cubic"):
        order = 2 if rule == "quadratic" else 3
        rows = [list(seq)]
        for _ in range(order):
            prev = rows[-1]
            rows.append([prev[i + 1] - prev[i] for i in range(len(prev) - 1)])
        last = rows[-1]
        if len(last) < 2 or any(v != last[0] for v in last):
            return None
        return sum(row[-1] for row in rows[:-1]) + last[0]
    if rule == "fibonacci":
        ok = all(seq[i + 2] == seq[i + 1] + seq[i] for i in range(n - 2))
        return seq[-1] + seq[-2] if ok else None
    # interleaved: the terms at even and at odd positions are two arithmetic sequences
    even, odd = seq[0::2], seq[1::2]
    if len(odd) < 2 or _predict("arithmetic", even) is None or _predict("arithmetic", odd) is None:
        return None
    return _predict("arithmetic", even if n % 2 == 0 else odd)


def _make(rule, rng, length):
    if rule == "arithmetic":
        a, d = rng.randint(-20, 20), rng.choice([-1, 1]) * rng.randint(2, 12)
        return [a + d * i for i in range(length)]
    if rule == "geometric":
        a, r = rng.choice([-1, 1]) * rng.randint(1, 5), rng.choice([-3, -2, 2, 3])
        return [a * r ** i for i in range(length)]
    if rule == "quadratic":
        a, b, c = rng.choice([-2, -1, 1, 2, 3]), rng.randint(-6, 6), rng.randint(-10, 10)
        return [a * i * i + b * i + c for i in range(length)]
    if rule == "cubic":
        a, b, c = rng.choice([-1, 1]), rng.randint(-3, 3), rng.randint(-5, 5)
        return [a * i ** 3 + b * i * i + c for i in range(length)]
    if rule == "fibonacci":
        seq = [rng.randint(-5, 9), rng.randint(1, 9)]
        while len(seq) < length:
            seq.append(seq[-1] + seq[-2])
        return seq
    a, b = rng.randint(-10, 10), rng.randint(-10, 10)
    d1, d2 = rng.choice([-1, 1]) * rng.randint(2, 9), rng.choice([-1, 1]) * rng.randint(2, 9)
    return [(a + d1 * (i // 2)) if i % 2 == 0 else (b + d2 * (i // 2)) for i in range(length)]


def _unambiguous(seq):
    """Every prefix shown to the player has exactly one next term under all the rules that fit it."""
    for n in range(SHOWN, len(seq)):
        fits = {_predict(r, seq[:n]) for r in RULES[:KINDS]} - {None}
        if fits != {seq[n]}:
            return False
    return True


class SequenceNext:
    max_turns = PREDICT

    def reset(self, seed):
        rng = random.Random(seed)
        while True:
            rule = rng.choice(RULES[:KINDS])
            seq = _make(rule, rng, SHOWN + PREDICT)
            if _unambiguous(seq) and len(set(seq)) > 2:
                break
        self.seq = seq
        self.turn = 0
        self.done = False
        return (f"Here is an integer sequence: {self._shown()}\nPredict the next term (one integer). "
                f"After each guess I reveal the true term; you will predict {PREDICT} terms in all.")

    def _shown(self):
        return ", ".join(str(v) for v in self.seq[:SHOWN + self.turn]) + ", ?"

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        truth = self.seq[SHOWN + self.turn]
        self.turn += 1
        try:
            ok = int(action.strip().rstrip(".")) == truth
        except ValueError:
            ok = False
        verdict = f"Correct, the term is {truth}." if ok else f"Wrong, the term was {truth}."
        reward = 1.0 / PREDICT if ok else 0.0
        if self.turn == PREDICT:
            self.done = True
            return verdict + " That was the last one.", reward, True, False, {}
        return f"{verdict}\nSequence so far: {self._shown()}\nPredict the next term.", reward, False, False, {}
