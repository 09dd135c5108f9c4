# expect: timeout
# An accidental infinite loop on the first step.
class Spinner:
    max_turns = 3

    def reset(self, seed):
        self.x = seed
        return "Spin."

    def step(self, action):
        while self.x >= 0:
            self.x += 1
        return "never", 0.0, True, False, {}
