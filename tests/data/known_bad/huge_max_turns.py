# expect: bad_max_turns
# A turn budget far beyond validation.max_turns_limit.
class Marathon:
    max_turns = 1_000_000

    def reset(self, seed):
        self.n = 0
        return "run"

    def step(self, action):
        self.n += 1
        return "keep going", 0.0, False, self.n >= self.max_turns, {}
