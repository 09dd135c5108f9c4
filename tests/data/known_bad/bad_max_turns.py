# expect: bad_max_turns
# max_turns must be an int, not a string.
class Counter:
    max_turns = "10"

    def reset(self, seed):
        self.n = 0
        return "count"

    def step(self, action):
        self.n += 1
        return str(self.n), 0.0, self.n >= 10, False, {}
