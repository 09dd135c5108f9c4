"""Find the one heavier counterfeit coin with a balance scale in few weighings."""

import random

# difficulty (rendered by the library; each range reads easy..hard)
COINS = 9  # 6..40: coins, numbered 1..COINS
SPARE = 1  # 1..0: weighings allowed beyond the minimum ceil(log3(COINS))
# end difficulty


def _min_weighings(n):
    k, reach = 0, 1
    while reach < n:
        k, reach = k + 1, reach * 3
    return k


WEIGHINGS = _min_weighings(COINS) + SPARE


class CounterfeitCoin:
    max_turns = WEIGHINGS + 2

    def reset(self, seed):
        rng = random.Random(seed)
        self.fake = rng.randint(1, COINS)
        self.weighings = 0
        self.turn = 0
        self.done = False
        return (f"There are {COINS} coins numbered 1 to {COINS}. One is counterfeit and heavier than the others, "
                f"which all weigh the same. You may use the balance scale {WEIGHINGS} times.\n"
                "To weigh, reply like: weigh 1 2 3 vs 4 5 6 (both pans need the same number of coins).\n"
                "When you know the counterfeit, reply: answer 7")

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        self.turn += 1
        words = action.lower().replace(",", " ").replace(":", " ").split()
        out_of_turns = self.turn >= self.max_turns
        if words[:1] == ["answer"] and len(words) == 2 and words[1].isdigit():
            self.done = True
            if int(words[1]) == self.fake:
                return f"Correct, coin {self.fake} is the counterfeit!", 1.0, True, False, {}
            return f"Wrong, the counterfeit was coin {self.fake}.", 0.0, True, False, {}
        if words[:1] == ["weigh"] and "vs" in words:
            if self.weighings >= WEIGHINGS:
                msg = "You have used all your weighings; reply: answer N"
                self.done = out_of_turns
                return msg, 0.0, False, out_of_turns, {}
            cut = words.index("vs")
            try:
                left, right = [int(w) for w in words[1:cut]], [int(w) for w in words[cut + 1:]]
            except ValueError:
                left, right = [], []
            coins = left + right
            valid = (left and len(left) == len(right) and len(set(coins)) == len(coins)
                     and all(1 <= c <= COINS for c in coins))
            if valid:
                self.weighings += 1
                if self.fake in left:
                    result = "The left pan is heavier."
                elif self.fake in right:
                    result = "The right pan is heavier."
                else:
                    result = "The pans balance."
                self.done = out_of_turns
                return (f"{result} Weighings left: {WEIGHINGS - self.weighings}.", 0.0, False, out_of_turns,
                        {"weighings": self.weighings})
        self.done = out_of_turns
        return ("Invalid action. Reply 'weigh 1 2 vs 3 4' (distinct coins, equal pans) or 'answer N'.",
                0.0, False, out_of_turns, {})
