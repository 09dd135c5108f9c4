# expect: unsolvable
# Well-formed, but no action sequence ever earns a reward (the secret cannot be guessed in 3 turns).
import random


class Vault:
    max_turns = 3

    def reset(self, seed):
        self.secret = str(random.Random(seed).randint(10**11, 10**12))
        self.turn = 0
        return "Enter the 12-digit code."

    def step(self, action):
        self.turn += 1
        if action.strip() == self.secret:
            return "Open!", 1.0, True, False, {}
        return "Wrong code.", 0.0, False, self.turn >= self.max_turns, {}
