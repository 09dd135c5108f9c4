"""A small zebra puzzle: place every attribute value in its house from a list of clues."""

import random
from itertools import permutations, product

# difficulty (rendered by the library; each range reads easy..hard)
HOUSES = 3  # 3..4: houses in the row, numbered from the left
CATEGORIES = 2  # 2..3: attribute categories (colour, pet, drink)
ATTEMPTS = 2  # 3..1: answers allowed
# end difficulty

VALUES = [["red", "green", "blue", "yellow"], ["cat", "dog", "fish", "bird"], ["tea", "coffee", "milk", "juice"]]
CATEGORY_NAMES = ["colour", "pet", "drink"]


def _house(world, value):
    for perm in world:
        if value in perm:
            return perm.index(value)
    return -1


def _holds(clue, world):
    kind, a, b = clue
    ha = _house(world, a)
    if kind == "in":
        return ha == b
    if kind == "not_in":
        return ha != b
    hb = _house(world, b)
    if kind == "same":
        return ha == hb
    if kind == "left_of":
        return ha + 1 == hb
    if kind == "next_to":
        return abs(ha - hb) == 1
    return ha < hb  # somewhere_left


def _say(clue):
    kind, a, b = clue
    if kind == "in":
        return f"The {a} is in house {b + 1}."
    if kind == "not_in":
        return f"The {a} is not in house {b + 1}."
    if kind == "same":
        return f"The {a} and the {b} are in the same house."
    if kind == "left_of":
        return f"The {a} is directly left of the {b}."
    if kind == "next_to":
        return f"The {a} is next to the {b}."
    return f"The {a} is somewhere left of the {b}."


class HousePuzzle:
    max_turns = ATTEMPTS

    def reset(self, seed):
        rng = random.Random(seed)
        self.values = [v[:HOUSES] for v in VALUES[:CATEGORIES]]
        self.world = tuple(tuple(rng.sample(v, HOUSES)) for v in self.values)
        worlds = list(product(*[list(permutations(v)) for v in self.values]))
        every = [x for v in self.values for x in v]
        clues = []
        while len(worlds) > 1:
            kind = rng.choice(["in", "not_in", "same", "left_of", "next_to", "somewhere_left", "same", "not_in"])
            a = rng.choice(every)
            b = rng.randrange(HOUSES) if kind in ("in", "not_in") else rng.choice([x for x in every if x != a])
            clue = (kind, a, b)
            if not _holds(clue, self.world):
                continue
            kept = [w for w in worlds if _holds(clue, w)]
            if len(kept) < len(worlds):
                worlds = kept
                clues.append(clue)
        self.clues = clues
        self.attempt = 0
        self.done = False
        cats = "\n".join(f"- {n}: {', '.join(sorted(v))}" for n, v in zip(CATEGORY_NAMES, self.values))
        example = "; ".join(f"{h + 1}=" + ",".join(sorted(v)[h] for v in self.values) for h in range(HOUSES))
        return (f"{HOUSES} houses stand in a row, numbered 1 to {HOUSES} from left to right. Each house has exactly "
                f"one value of each category:\n{cats}\nClues:\n"
                + "\n".join(f"{i + 1}. {_say(c)}" for i, c in enumerate(clues))
                + f"\nReply with every house's values, e.g. {example}\nYou have {ATTEMPTS} attempt(s).")

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        self.attempt += 1
        placed = {}
        for part in action.replace("\n", ";").split(";"):
            house, sep, items = part.partition("=") if "=" in part else part.partition(":")
            digits = "".join(ch for ch in house if ch.isdigit())
            if sep and digits:
                for item in items.replace(" ", ",").split(","):
                    if item.strip():
                        placed[item.strip().lower()] = int(digits) - 1
        every = [x for v in self.values for x in v]
        right = sum(1 for x in every if placed.get(x) == _house(self.world, x))
        if right == len(every):
            self.done = True
            return "Correct, every house is right!", 1.0 / 2 ** (self.attempt - 1), True, False, {}
        if self.attempt == ATTEMPTS:
            self.done = True
            truth = "; ".join(f"{h + 1}=" + ",".join(p[h] for p in self.world) for h in range(HOUSES))
            return f"Wrong. The solution was: {truth}.", 0.0, True, False, {}
        return (f"Wrong: {right} of {len(every)} values are in the right house. "
                f"Attempts left: {ATTEMPTS - self.attempt}.", 0.0, False, False, {})
