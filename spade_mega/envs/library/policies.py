"""Scripted policies for library environments: the oracle adapter and the random baseline.

A policy is any callable ``observation -> action``, one instance per episode (see ``spade_mega.envs.episode``).
"""

from __future__ import annotations

import random
import re
import string
from typing import Generator, Sequence

from spade_mega.envs.library.entry import OracleScript

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")


class ScriptedPolicy:
    """Drives an oracle generator script: first observation in, actions out, each later observation sent back."""

    def __init__(self, script: OracleScript) -> None:
        self._script = script
        self._run: Generator[str, str, None] | None = None

    def __call__(self, observation: str) -> str:
        try:
            if self._run is None:
                self._run = self._script(observation)
                return next(self._run)
            return self._run.send(observation)
        except StopIteration:
            raise RuntimeError(f"oracle script {self._script.__qualname__} ended while the episode goes on; "
                               f"last observation: {observation[:200]!r}") from None


class RandomPolicy:
    """The baseline an environment must beat: legal-looking actions with random content, or plain noise.

    Half the time it fills one of the entry's action examples (``{int}`` and ``{word}`` from numbers and words of the
    observation, or small random integers); otherwise it echoes a token of the observation or types a random string.
    """

    def __init__(self, examples: Sequence[str], seed: int) -> None:
        self._examples = list(examples)
        self._rng = random.Random(seed)

    def _fill(self, template: str, numbers: list[str], words: list[str]) -> str:
        rng = self._rng
        while "{int}" in template:
            value = rng.choice(numbers) if numbers and rng.random() < 0.5 else str(rng.randint(-10, 30))
            template = template.replace("{int}", value, 1)
        while "{word}" in template:
            template = template.replace("{word}", rng.choice(words) if words else "x", 1)
        return template

    def __call__(self, observation: str) -> str:
        rng = self._rng
        numbers, words = _NUMBER.findall(observation), _WORD.findall(observation)
        roll = rng.random()
        if roll < 0.5 and self._examples:
            return self._fill(rng.choice(self._examples), numbers, words)
        if roll < 0.75 and (numbers or words):
            return rng.choice(numbers + words)
        alphabet = string.ascii_letters + string.digits + " ,.-=[]{}:\""
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 16)))
