# expect: step_contract
# step() returns the old Gym 4-tuple (no truncated flag).
class OldGym:
    max_turns = 3

    def reset(self, seed):
        return "old API"

    def step(self, action):
        return "obs", 0.0, True, {}
