# expect: nondeterministic_episode
# reset() is deterministic but step() draws from the unseeded global RNG.
import random


class Slots:
    max_turns = 4

    def reset(self, seed):
        self.turn = 0
        return "Pull the lever."

    def step(self, action):
        self.turn += 1
        symbol = random.choice(["cherry", "bell", "seven", "lemon", "plum", "bar"] * 10 + [str(random.random())])
        return f"You got {symbol}", 0.0, False, self.turn >= self.max_turns, {}
