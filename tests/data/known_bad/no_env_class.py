# expect: no_env_class
# Functions instead of a class.
max_turns = 5


def reset(seed):
    return "start"


def step(action):
    return "done", 0.0, True, False, {}
