"""Logic deduction environments and their oracles."""

from __future__ import annotations

import itertools
import re
from typing import Callable, Generator

from spade_mega.envs.library.entry import LibraryEntry

Script = Generator[str, str, None]
World = dict[str, str]


def _knights_claim(text: str) -> Callable[[World], bool]:
    """A claim sentence as a predicate over worlds (person -> 'knight' | 'knave')."""
    if m := re.fullmatch(r"(\w+) is a (knight|knave) or (\w+) is a (knight|knave)\.", text):
        a, ka, b, kb = m.groups()
        return lambda w: w[a] == ka or w[b] == kb
    if m := re.fullmatch(r"(\w+) is a (knight|knave)\.", text):
        a, kind = m.groups()
        return lambda w: w[a] == kind
    if m := re.fullmatch(r"(\w+) and (\w+) are (the same|different) kinds?\.", text):
        a, b, rel = m.groups()
        return (lambda w: w[a] == w[b]) if rel == "the same" else (lambda w: w[a] != w[b])
    m = re.fullmatch(r"(Exactly|At least) (\d+) of us are (knight|knave)s\.", text)
    assert m is not None, f"unknown claim {text!r}"
    exact, k, kind = m[1] == "Exactly", int(m[2]), m[3]
    return lambda w: (sum(v == kind for v in w.values()) == k) if exact else (sum(v == kind for v in w.values()) >= k)


def knights_knaves_oracle(obs: str) -> Script:
    people = re.search(r"You meet ([\w, ]+)\.", obs)[1].split(", ")
    statements = [(s, _knights_claim(c)) for s, c in re.findall(r'^(\w+) says: "(.*)"$', obs, re.M)]
    for kinds in itertools.product(("knight", "knave"), repeat=len(people)):
        world = dict(zip(people, kinds))
        if all(claim(world) == (world[speaker] == "knight") for speaker, claim in statements):
            break
    answer = ", ".join(f"{p}={world[p]}" for p in people)
    while True:
        yield answer


def _mastermind_score(guess: str, code: str) -> tuple[int, int]:
    exact = sum(a == b for a, b in zip(guess, code))
    common = sum(min(guess.count(c), code.count(c)) for c in set(guess))
    return exact, common - exact


def mastermind_oracle(obs: str) -> Script:
    """Always guess a code consistent with all feedback so far (the first one in alphabetical order)."""
    pegs = int(re.search(r"secret code of (\d+) letters", obs)[1])
    letters = re.search(r"each one of ([A-Z, ]+) \(", obs)[1].split(", ")
    candidates = ["".join(c) for c in itertools.product(letters, repeat=pegs)]
    guess = "".join(letters[i // 2] for i in range(pegs))  # AABB...: splits the space well
    while True:
        obs = yield guess
        exact, misplaced = map(int, re.search(r": (\d+) exact, (\d+) misplaced", obs).groups())
        candidates = [c for c in candidates if _mastermind_score(guess, c) == (exact, misplaced)]
        guess = candidates[0]


def _house_clue(text: str) -> Callable[[dict[str, int]], bool]:
    """A clue sentence as a predicate over placements (value -> house index, 0-based)."""
    if m := re.fullmatch(r"The (\w+) is (not )?in house (\d+)\.", text):
        a, neg, h = m[1], bool(m[2]), int(m[3]) - 1
        return lambda p: (p[a] == h) != neg
    if m := re.fullmatch(r"The (\w+) and the (\w+) are in the same house\.", text):
        a, b = m.groups()
        return lambda p: p[a] == p[b]
    m = re.fullmatch(r"The (\w+) is (directly left of|next to|somewhere left of) the (\w+)\.", text)
    assert m is not None, f"unknown clue {text!r}"
    a, rel, b = m.groups()
    return {"directly left of": lambda p: p[a] + 1 == p[b], "next to": lambda p: abs(p[a] - p[b]) == 1,
            "somewhere left of": lambda p: p[a] < p[b]}[rel]


def house_puzzle_oracle(obs: str) -> Script:
    houses = int(re.search(r"^(\d+) houses stand in a row", obs)[1])
    categories = [line.split(": ")[1].split(", ") for line in re.findall(r"^- \w+: .*$", obs, re.M)]
    clues = [_house_clue(text) for text in re.findall(r"^\d+\. (.*)$", obs, re.M)]
    for perms in itertools.product(*[list(itertools.permutations(values)) for values in categories]):
        placement = {value: house for perm in perms for house, value in enumerate(perm)}
        if all(clue(placement) for clue in clues):
            break
    answer = "; ".join(f"{h + 1}=" + ",".join(perm[h] for perm in perms) for h in range(houses))
    while True:
        yield answer


def counterfeit_coin_oracle(obs: str) -> Script:
    """Ternary search: weigh two thirds of the suspects against each other."""
    suspects = list(range(1, int(re.search(r"There are (\d+) coins", obs)[1]) + 1))
    while len(suspects) > 1:
        third = (len(suspects) + 2) // 3
        left, right, rest = suspects[:third], suspects[third:2 * third], suspects[2 * third:]
        obs = yield f"weigh {' '.join(map(str, left))} vs {' '.join(map(str, right))}"
        suspects = left if "left pan is heavier" in obs else right if "right pan is heavier" in obs else rest
    while True:
        yield f"answer {suspects[0]}"


ENTRIES = [
    LibraryEntry(
        name="knights_knaves",
        skill="logic",
        summary="case analysis over who tells the truth, from claims about identities, pairs and counts",
        hint="Try the possible knight/knave assignments one at a time: an assignment works only if every "
             "knight's statement is true and every knave's is false. Start from counting claims ('exactly k of us "
             "are knights'): whoever makes one fixes how many knights there are if they are a knight.",
        oracle=knights_knaves_oracle,
        target_return=1.0,
        action_examples=("Alice=knight, Bob=knave, Carol=knight", "{word}=knave", "Alice=knave, Bob=knave"),
    ),
    LibraryEntry(
        name="mastermind",
        skill="logic",
        summary="deducing a hidden code from exact/misplaced feedback within a guess budget",
        hint="Keep the list of every code still consistent with all the feedback so far and only guess codes "
             "from that list. Open with a guess that repeats letters in pairs (like AABB) to split the codes "
             "evenly, and remember 'misplaced' counts letters shared in any position minus the exact ones.",
        oracle=mastermind_oracle,
        target_return=1.0,
        action_examples=("AABB", "ABCD", "{word}", "BCDA"),
    ),
    LibraryEntry(
        name="house_puzzle",
        skill="logic",
        summary="a zebra-style constraint puzzle: place colours, pets and drinks from positional clues",
        hint="Draw a table with one column per house. Apply 'is in house k' and 'is not in house k' first, then "
             "'directly left of' (the left one can never be in the last house, the right one never in the first), "
             "and check every clue again before answering.",
        oracle=house_puzzle_oracle,
        target_return=1.0,
        action_examples=("1=red,cat; 2=green,dog; 3=blue,fish", "1={word}; 2={word}; 3={word}", "{word}"),
    ),
    LibraryEntry(
        name="counterfeit_coin",
        skill="logic",
        summary="adaptive experiment design: find a heavier coin with the fewest balance weighings",
        hint="Split the coins that could still be fake into three groups as equal as possible and weigh two of "
             "them: the heavier pan holds the fake, and if the pans balance it is in the third group. Each "
             "weighing cuts the suspects to a third, which is exactly what the weighing budget allows.",
        oracle=counterfeit_coin_oracle,
        target_return=1.0,
        action_examples=("weigh {int} {int} vs {int} {int}", "weigh {int} vs {int}", "answer {int}"),
    ),
]
