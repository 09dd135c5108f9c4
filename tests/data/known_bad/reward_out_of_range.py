# expect: reward_out_of_range
# Points instead of a reward in [-1, 1].
class Points:
    max_turns = 3

    def reset(self, seed):
        return "Answer anything."

    def step(self, action):
        return "10 points!", 10.0, True, False, {}
