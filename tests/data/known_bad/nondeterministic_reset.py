# expect: nondeterministic_reset
# Uses the global RNG (seeded from the OS in every process) instead of random.Random(seed).
import random


class Dice:
    max_turns = 3

    def reset(self, seed):
        self.target = random.randint(1, 1_000_000)
        return f"Target: {self.target}. Roll!"

    def step(self, action):
        return "rolled", 0.0, True, False, {}
