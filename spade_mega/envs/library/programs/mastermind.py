"""Mastermind: find a secret code from exact / misplaced feedback on each guess."""

import random

# difficulty (rendered by the library; each range reads easy..hard)
PEGS = 4  # 3..5: code length
COLORS = 6  # 4..6: letters the code is drawn from (A, B, C, ...)
GUESSES = 10  # 10..8: guesses allowed
# end difficulty

LETTERS = "ABCDEFGH"[:COLORS]


class Mastermind:
    max_turns = GUESSES

    def reset(self, seed):
        rng = random.Random(seed)
        self.code = "".join(rng.choice(LETTERS) for _ in range(PEGS))
        self.turn = 0
        self.done = False
        return (f"I chose a secret code of {PEGS} letters, each one of {', '.join(LETTERS)} (letters may repeat). "
                f"Guess it by replying with {PEGS} letters, e.g. {LETTERS[0] * 2}{LETTERS[1] * (PEGS - 2)}. After "
                "each guess I say how many letters are exact (right letter, right place) and how many are "
                f"misplaced (right letter, wrong place). You have {GUESSES} guesses.")

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        self.turn += 1
        guess = "".join(ch for ch in action.upper() if not ch.isspace())
        left = GUESSES - self.turn
        if len(guess) != PEGS or any(ch not in LETTERS for ch in guess):
            msg = f"Invalid guess {guess[:20]!r}: use exactly {PEGS} letters from {LETTERS}."
            if left == 0:
                self.done = True
                return msg + f" Out of guesses; the code was {self.code}.", 0.0, False, True, {}
            return msg + f" Guesses left: {left}.", 0.0, False, False, {}
        if guess == self.code:
            self.done = True
            return f"{guess}: all {PEGS} exact. You cracked the code!", 1.0, True, False, {"guesses": self.turn}
        exact = sum(1 for a, b in zip(guess, self.code) if a == b)
        common = sum(min(guess.count(c), self.code.count(c)) for c in LETTERS)
        msg = f"{guess}: {exact} exact, {common - exact} misplaced."
        if left == 0:
            self.done = True
            return msg + f" Out of guesses; the code was {self.code}.", 0.0, False, True, {"guesses": self.turn}
        return msg + f" Guesses left: {left}.", 0.0, False, False, {}
