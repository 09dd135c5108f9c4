"""Keep a running total through a chain of operations announced one per turn."""

import random

# difficulty (rendered by the library; each range reads easy..hard)
N_OPS = 5  # 3..10: operations in the chain (one per turn)
MAX_OPERAND = 12  # 9..60: largest operand of add and subtract
MULTIPLY = 1  # 0..1: 1 also allows 'multiply by' and exact 'divide by'
# end difficulty


class RunningTotal:
    max_turns = N_OPS

    def reset(self, seed):
        rng = random.Random(seed)
        self.total = rng.randint(1, MAX_OPERAND)
        self.start = self.total
        self.ops = []
        value = self.total
        kinds = ["add", "subtract"] + (["multiply by", "divide by"] if MULTIPLY else [])
        for _ in range(N_OPS):
            kind = rng.choice(kinds)
            divisors = [d for d in range(2, 10) if value % d == 0]
            if kind == "divide by" and (value == 0 or not divisors):
                kind = "add"
            if kind == "multiply by" and abs(value) > 500:
                kind = "subtract"
            if kind == "add":
                n = rng.randint(1, MAX_OPERAND)
                value += n
            elif kind == "subtract":
                n = rng.randint(1, MAX_OPERAND)
                value -= n
            elif kind == "multiply by":
                n = rng.randint(2, 9)
                value *= n
            else:
                n = rng.choice(divisors)
                value //= n
            self.ops.append((kind, n, value))
        self.turn = 0
        self.done = False
        return (f"Start with {self.start}. I will announce {N_OPS} operations, one per turn. After each one, reply "
                f"with the new running total as a single integer. A wrong total ends the game.\n"
                f"{self._announce()}")

    def _announce(self):
        kind, n, _ = self.ops[self.turn]
        return f"Operation {self.turn + 1} of {N_OPS}: {kind} {n}."

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        expected = self.ops[self.turn][2]
        self.turn += 1
        try:
            answer = int(action.strip().rstrip("."))
        except ValueError:
            answer = None
        if answer != expected:
            self.done = True
            return (f"Wrong: the running total was {expected}. Game over.", 0.0, True, False,
                    {"correct": self.turn - 1})
        if self.turn == N_OPS:
            self.done = True
            return f"Correct, the final total is {expected}. Well done!", 1.0 / N_OPS, True, False, {"correct": N_OPS}
        return f"Correct, the total is {expected}.\n{self._announce()}", 1.0 / N_OPS, False, False, {}
