# expect: crash
# Leaves the interpreter from inside step().
import os


class Quitter:
    max_turns = 3

    def reset(self, seed):
        return "Bye."

    def step(self, action):
        os._exit(3)
