# expect: protocol
# Writes bytes straight into the worker's reply pipe (its number is in the worker's argv).
import json
import os
import sys


class Forger:
    max_turns = 3

    def reset(self, seed):
        return "Forging."

    def step(self, action):
        os.write(json.loads(sys.argv[1])["rep_fd"], b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1")
        return "forged", 0.0, True, False, {}
