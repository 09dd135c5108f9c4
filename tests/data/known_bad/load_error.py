# expect: load_error
# Only the standard library exists inside the sandbox.
import numpy as np


class Walk:
    max_turns = 5

    def reset(self, seed):
        self.rng = np.random.default_rng(seed)
        return "walk"

    def step(self, action):
        return "x", 0.0, True, False, {}
