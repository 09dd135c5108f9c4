# expect: reward_not_finite
# Dividing by a zero count gives an infinite reward.
class Ratio:
    max_turns = 3

    def reset(self, seed):
        self.hits = 0
        return "Shoot."

    def step(self, action):
        score = float("inf") if self.hits == 0 else 1.0 / self.hits
        return "shot", score, True, False, {}
