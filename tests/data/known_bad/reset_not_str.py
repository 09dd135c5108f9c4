# expect: reset_not_str
# The observation must be text.
class Grid:
    max_turns = 4

    def reset(self, seed):
        self.pos = [0, 0]
        return {"pos": self.pos}

    def step(self, action):
        return "moved", 0.0, True, False, {}
