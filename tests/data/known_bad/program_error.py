# expect: program_error
# Crashes on any action that is not an integer.
class Adder:
    max_turns = 5

    def reset(self, seed):
        self.total = 0
        return "Send integers."

    def step(self, action):
        self.total += int(action)
        return f"Total {self.total}", 0.0, self.total > 100, False, {}
