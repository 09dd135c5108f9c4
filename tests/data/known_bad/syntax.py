# expect: syntax
# A missing colon after the method header.
class Broken:
    max_turns = 5

    def reset(self, seed)
        return "start"

    def step(self, action):
        return "x", 0.0, True, False, {}
