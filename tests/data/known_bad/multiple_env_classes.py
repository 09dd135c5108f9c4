# expect: multiple_env_classes
# Two candidate environment classes: the sandbox cannot tell which one to run.
class Easy:
    max_turns = 3

    def reset(self, seed):
        return "easy"

    def step(self, action):
        return "done", 1.0, True, False, {}


class Hard(Easy):
    max_turns = 5

    def reset(self, seed):
        return "hard"
