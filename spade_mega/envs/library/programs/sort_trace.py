"""Trace a sorting algorithm pass by pass: give the array after each pass."""

import random

# difficulty (rendered by the library; each range reads easy..hard)
LENGTH = 5  # 4..9: array length (the number of passes is LENGTH - 1)
ALGORITHMS = 2  # 1..3: algorithms in play (bubble, insertion, selection)
# end difficulty

DESCRIPTIONS = {
    "bubble": "Bubble sort: pass k (k = 1, 2, ...) walks j from 0 to n-1-k and swaps a[j] and a[j+1] whenever "
              "a[j] > a[j+1].",
    "insertion": "Insertion sort: pass k (k = 1, 2, ...) takes a[k] and shifts the larger entries of the "
                 "sorted prefix a[0..k-1] one place right to insert it.",
    "selection": "Selection sort: pass k (k = 1, 2, ...) finds the smallest entry of a[k-1..n-1] (the leftmost "
                 "if tied) and swaps it with a[k-1].",
}


def _passes(name, values):
    a, out, n = values[:], [], len(values)
    for k in range(1, n):
        if name == "bubble":
            for j in range(n - k):
                if a[j] > a[j + 1]:
                    a[j], a[j + 1] = a[j + 1], a[j]
        elif name == "insertion":
            key, j = a[k], k - 1
            while j >= 0 and a[j] > key:
                a[j + 1] = a[j]
                j -= 1
            a[j + 1] = key
        else:
            m = min(range(k - 1, n), key=lambda i: (a[i], i))
            a[k - 1], a[m] = a[m], a[k - 1]
        out.append(a[:])
    return out


class SortTrace:
    max_turns = LENGTH - 1

    def reset(self, seed):
        rng = random.Random(seed)
        self.algorithm = rng.choice(list(DESCRIPTIONS)[:ALGORITHMS])
        self.values = [rng.randint(0, 40) for _ in range(LENGTH)]
        self.expected = _passes(self.algorithm, self.values)
        self.turn = 0
        self.done = False
        return (f"{DESCRIPTIONS[self.algorithm]}\nThe array (a[0] first) is {self.values}. "
                f"There are {LENGTH - 1} passes. Reply with the array after pass 1, like {sorted(self.values)}.")

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        truth = self.expected[self.turn]
        self.turn += 1
        try:
            ok = [int(v) for v in action.strip().strip("[]").replace(",", " ").split()] == truth
        except ValueError:
            ok = False
        verdict = "Correct." if ok else f"Wrong: after pass {self.turn} the array is {truth}."
        reward = 1.0 / (LENGTH - 1) if ok else 0.0
        if self.turn == LENGTH - 1:
            self.done = True
            return verdict + " That was the last pass.", reward, True, False, {}
        return f"{verdict} Now the array after pass {self.turn + 1}?", reward, False, False, {}
