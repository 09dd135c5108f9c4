# expect: step_contract
# info must hold only JSON-like values; a set is not one.
class Sets:
    max_turns = 3

    def reset(self, seed):
        return "go"

    def step(self, action):
        return "seen", 0.0, True, False, {"seen": {action}}
