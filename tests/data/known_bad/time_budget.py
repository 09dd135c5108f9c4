# expect: time_budget
# Each step is well within the per-call deadline, but every validation episode plays many of them: far longer than
# validation.time_budget_s allows the whole program (3 s in the test; the 30 s default stops it too, even when only
# the rollout's 25 turns are played).
import time


class Glacier:
    max_turns = 100

    def reset(self, seed):
        self.turn = 0
        return "Wait for it."

    def step(self, action):
        self.turn += 1
        time.sleep(0.5)
        return f"Turn {self.turn}.", 0.0, False, self.turn >= self.max_turns, {}
