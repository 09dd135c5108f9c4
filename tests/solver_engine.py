"""An engine that plays library environments with their scripted oracles, for tests of code that needs a policy
which *wins*: a language model that solves environments cannot run on this machine (the tiny demo model has random
weights and solves nothing, and writes no valid program either).

It is stateless, as a served model is. An agent prompt is decoded, the episode's observations are read back off the
chat (each is a user message), and the oracle of the environment whose hint the prompt carries is replayed over them
from the start; its last action is the answer, as ``<action>...</action>`` and the end-of-turn token. A prompt with no
known hint gets a fixed wrong answer (``GIVE_UP``). A designer prompt is answered with the next of ``designs`` for the
skill it asks for, written as the designer is asked to. Log-probs are 0 (the answers are deterministic).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from spade_mega.envs.library import LibraryEntry, ScriptedPolicy
from spade_mega.envs.program import EnvProgram
from spade_mega.inference.base import Generation, GenerationRequest
from spade_mega.rollout.chat import ChatTurns, decode, encode

GIVE_UP = "I give up"


def designer_text(env: EnvProgram) -> str:
    return f"<skill>{env.skill}</skill>\n<hint>{env.hint}</hint>\n```python\n{env.source}```\n"


class ScriptedSolverEngine:
    def __init__(self, chat: ChatTurns, entries: Sequence[LibraryEntry],
                 designs: Mapping[str, Sequence[EnvProgram]] | None = None) -> None:
        self.chat, self.tokenizer = chat, chat.tokenizer
        self.oracles = {chat.builder.untrusted(e.hint): e.oracle for e in entries}
        self.designs = {skill: list(programs) for skill, programs in (designs or {}).items()}
        # the text around each observation: what precedes a user message's content, and what ends it
        first = decode(self.tokenizer, encode(self.tokenizer, chat.before_observation)[:1])
        self.user_header = chat.before_observation[len(first):]
        self.end_of_message = chat.after_observation[:len(decode(self.tokenizer, encode(
            self.tokenizer, chat.after_observation)[:1]))]
        self.calls: list[int] = []  # requests per generate() call
        self.temperatures: set[float] = set()

    @property
    def weight_version(self) -> int:
        return 0

    def _answer(self, prompt: str) -> str:
        skill = next((s for s in self.designs if f"environment for the skill **{s}**" in prompt), None)
        if skill is not None:
            return designer_text(self.designs[skill].pop(0))
        oracle = next((script for hint, script in self.oracles.items() if hint in prompt), None)
        if oracle is None:
            return f"<action>{GIVE_UP}</action>"
        observations = [part.split(self.end_of_message)[0] for part in prompt.split(self.user_header)[1:]]
        policy = ScriptedPolicy(oracle)
        return f"<action>{[policy(observation) for observation in observations][-1]}</action>"

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        self.calls.append(len(requests))
        out = []
        for request in requests:
            self.temperatures.add(request.sampling.temperature)
            ids = encode(self.tokenizer, self._answer(decode(self.tokenizer, request.prompt_ids)))
            ids = (ids + list(self.chat.stop_ids[:1]))[:request.sampling.max_new_tokens]
            finish = "stop" if ids[-1] in self.chat.stop_ids else "length"
            out.append(Generation(request.prompt_ids, tuple(ids), tuple([0.0] * len(ids)), finish, 0))
        return out

    def close(self) -> None:
        """Nothing to release (the actor closes its engine)."""
