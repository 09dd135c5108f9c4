# expect: time_budget
# Each step is well within the per-call deadline, but 100 of them in every validation episode take far longer than
# validation.time_budget_s allows the whole program (3 s in the test; the 60 s default would refuse it too).
import time


class Glacier:
    max_turns = 100

    def reset(self, seed):
        self.turn = 0
        return "Wait for it."

    def step(self, action):
        self.turn += 1
        time.sleep(0.2)
        return f"Turn {self.turn}.", 0.0, False, self.turn >= self.max_turns, {}
