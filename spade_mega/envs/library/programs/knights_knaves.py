"""Knights always tell the truth, knaves always lie: deduce who is which from what they say."""

import random

# difficulty (rendered by the library; each range reads easy..hard)
PEOPLE = 3  # 2..6: islanders to classify
COUNTING = 1  # 1..0: 1 lets islanders make counting claims ('exactly k of us are knights'), which cut many cases
ATTEMPTS = 2  # 3..1: answers allowed
# end difficulty

NAMES = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank"]


def _claim(rng, speaker, people):
    others = [p for p in people if p != speaker]
    a = rng.choice(others)
    b = rng.choice([p for p in people if p != a])
    kinds = ["is", "same", "different", "or"] + (["exactly", "at_least"] if COUNTING else [])
    kind = rng.choice(kinds)
    if kind == "is":
        return ("is", a, rng.choice(["knight", "knave"]))
    if kind in ("same", "different"):
        return (kind, a, b)
    if kind == "or":
        return ("or", a, rng.choice(["knight", "knave"]), b, rng.choice(["knight", "knave"]))
    return (kind, rng.randint(1, len(people)), rng.choice(["knights", "knaves"]))


def _holds(claim, world):
    kind = claim[0]
    if kind == "is":
        return world[claim[1]] == claim[2]
    if kind == "same":
        return world[claim[1]] == world[claim[2]]
    if kind == "different":
        return world[claim[1]] != world[claim[2]]
    if kind == "or":
        return world[claim[1]] == claim[2] or world[claim[3]] == claim[4]
    count = sum(1 for v in world.values() if v + "s" == claim[2])
    return count == claim[1] if kind == "exactly" else count >= claim[1]


def _say(claim):
    kind = claim[0]
    if kind == "is":
        return f"{claim[1]} is a {claim[2]}."
    if kind == "same":
        return f"{claim[1]} and {claim[2]} are the same kind."
    if kind == "different":
        return f"{claim[1]} and {claim[2]} are different kinds."
    if kind == "or":
        return f"{claim[1]} is a {claim[2]} or {claim[3]} is a {claim[4]}."
    return f"{'Exactly' if kind == 'exactly' else 'At least'} {claim[1]} of us are {claim[2]}."


class KnightsKnaves:
    max_turns = ATTEMPTS

    def reset(self, seed):
        rng = random.Random(seed)
        people = NAMES[:PEOPLE]
        self.world = {p: rng.choice(["knight", "knave"]) for p in people}
        worlds = [{p: ("knight" if mask >> i & 1 else "knave") for i, p in enumerate(people)}
                  for mask in range(2 ** PEOPLE)]
        statements = []
        order = people[:]
        rng.shuffle(order)
        i = 0
        while len(worlds) > 1 or i < PEOPLE:
            speaker = order[i % PEOPLE]
            i += 1
            claim = _claim(rng, speaker, people)
            while _holds(claim, self.world) != (self.world[speaker] == "knight"):
                claim = _claim(rng, speaker, people)
            kept = [w for w in worlds if _holds(claim, w) == (w[speaker] == "knight")]
            if len(kept) < len(worlds) or i <= PEOPLE:
                worlds = kept
                statements.append((speaker, claim))
        self.people = people
        self.text = "\n".join(f'{s} says: "{_say(c)}"' for s, c in statements)
        self.attempt = 0
        self.done = False
        fmt = ", ".join(f"{p}=knight/knave" for p in people)
        return ("On this island knights always tell the truth and knaves always lie. "
                f"You meet {', '.join(people)}.\n{self.text}\n"
                f"Who is a knight and who is a knave? Reply like: {fmt}. You have {ATTEMPTS} attempt(s).")

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        self.attempt += 1
        said = {}
        for part in action.replace(";", ",").replace("\n", ",").split(","):
            key, sep, value = part.partition("=") if "=" in part else part.partition(":")
            if sep:
                said[key.strip().capitalize()] = value.strip().lower().rstrip(".s")
        right = sum(1 for p in self.people if said.get(p) == self.world[p])
        if right == PEOPLE:
            self.done = True
            return "Correct!", 1.0 / 2 ** (self.attempt - 1), True, False, {"attempts": self.attempt}
        if self.attempt == ATTEMPTS:
            self.done = True
            truth = ", ".join(f"{p}={self.world[p]}" for p in self.people)
            return f"Wrong. The answer was: {truth}.", 0.0, True, False, {"attempts": self.attempt}
        return (f"Wrong: {right} of {PEOPLE} are right. Attempts left: {ATTEMPTS - self.attempt}.",
                0.0, False, False, {})
