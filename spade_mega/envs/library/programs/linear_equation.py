"""Solve a linear equation in x with terms on both sides; 'too high' / 'too low' feedback after a miss."""

import random

# difficulty (rendered by the library; each range reads easy..hard)
TERMS = 3  # 2..6: terms on each side of the equation
MAX_COEF = 9  # 5..25: largest coefficient or constant
MAX_X = 10  # 10..60: the solution lies in -MAX_X..MAX_X
ATTEMPTS = 3  # 4..1: answers allowed
# end difficulty


def _render(terms):
    out = ""
    for i, (coef, is_x) in enumerate(terms):
        sign = "-" if coef < 0 else "+"
        mag = abs(coef)
        body = ("x" if mag == 1 else f"{mag}x") if is_x else str(mag)
        out += (("-" if sign == "-" else "") + body) if i == 0 else f" {sign} {body}"
    return out


class LinearEquation:
    max_turns = ATTEMPTS

    def reset(self, seed):
        rng = random.Random(seed)
        self.x = rng.randint(-MAX_X, MAX_X)
        while True:
            left = [(rng.choice([-1, 1]) * rng.randint(1, MAX_COEF), rng.random() < 0.5) for _ in range(TERMS)]
            right = [(rng.choice([-1, 1]) * rng.randint(1, MAX_COEF), rng.random() < 0.5) for _ in range(TERMS - 1)]
            a = sum(c for c, is_x in left if is_x) - sum(c for c, is_x in right if is_x)
            if a == 0:
                continue
            # the last constant on the right makes x the solution
            last = a * self.x + sum(c for c, is_x in left if not is_x) - sum(c for c, is_x in right if not is_x)
            if last != 0:
                break
        right.append((last, False))
        order = list(range(TERMS))
        rng.shuffle(order)
        right = [right[i] for i in order]
        self.equation = f"{_render(left)} = {_render(right)}"
        self.attempt = 0
        self.done = False
        return (f"Solve for x: {self.equation}\nThe solution is an integer. Reply with the value of x only. "
                f"You have {ATTEMPTS} attempt(s).")

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        self.attempt += 1
        text = action.strip().replace(" ", "")
        if text.startswith("x="):
            text = text[2:]
        try:
            guess = int(text)
        except ValueError:
            guess = None
        if guess == self.x:
            self.done = True
            return f"Correct, x = {self.x}.", 1.0 / 2 ** (self.attempt - 1), True, False, {"attempts": self.attempt}
        left = ATTEMPTS - self.attempt
        verdict = "not an integer" if guess is None else ("too high" if guess > self.x else "too low")
        if left == 0:
            self.done = True
            return f"Wrong ({verdict}). The answer was x = {self.x}.", 0.0, True, False, {"attempts": self.attempt}
        return f"Wrong ({verdict}). {self.equation}. Attempts left: {left}.", 0.0, False, False, {}
