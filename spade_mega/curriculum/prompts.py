"""Prompts for the ways the one model is asked: design an environment, play one, play one with the hint, and judge
whether one can be won (the solvability check's ``judge`` mode).

Every prompt is a list of chat messages rendered through the model's own chat template (the tokenizer's
``apply_chat_template``), so the designer and the agent see exactly the format the model was trained on. A tokenizer
without a chat template (a base model, a bare ``tokenizers.Tokenizer``) gets the plain fallback: each message as
``"<Role>:\\n<content>\\n\\n"`` (System, User, Assistant), ending with ``"Assistant:\\n"`` to open the answer.

The designer prompt quotes the environment contract from ``docs/environments.md`` (the example and its rules), so
the documentation and what the model is told cannot drift apart. It reads it through ``spade_mega/envs/environments.md``,
a symlink to that file, which setuptools packages as a copy: a wheel install carries the contract too.

Untrusted text (grounding documents, programs and hints from memory, observations written by generated programs, the
agent's own actions) passes through a :class:`ControlTokenGuard` first: a chat control token in it (``<|im_end|>``,
``<|im_start|>``, ...) would otherwise be encoded as the real control token and forge a turn boundary or end the
prompt. The guard breaks each such string with an invisible character, so it reads the same but encodes as text.

With a :class:`PromptBudget` (``PromptBuilder.from_config`` always sets one), the designer prompt is measured with the
run's tokenizer and trimmed to leave ``rollout.max_designer_tokens`` for the answer within
``rollout.max_context_tokens``. Trimming order, least useful first: negatives (oldest first; one line each), then
seeds (lowest regret first; whole programs), then the grounding document, cut at a token boundary with a visible
marker but never below ``MIN_DOCUMENT_TOKENS`` (the document is what keeps the designer diverse: without it SPADE's
Vendi/n fell from 0.68 to 0.04). The task, the contract and the answer format are never trimmed; a prompt that does
not fit even then is a :class:`PromptError` naming the numbers and the config keys to change.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from spade_mega.config.schema import SpadeConfig
from spade_mega.curriculum.corpus import GroundingDocument, count_tokens, truncate_to_tokens
from spade_mega.curriculum.memory import EnvRecord
from spade_mega.curriculum.skills import SkillRegistry
from spade_mega.errors import SpadeError
from spade_mega.tokenizer import load_tokenizer

CONTRACT_FILE = Path(__file__).resolve().parents[1] / "envs" / "environments.md"
_CONTRACT_START, _CONTRACT_END = "```python", "\nBeside the source"
MIN_DOCUMENT_TOKENS = 256  # below about a paragraph a grounding document gives the designer no concept to build on
TRUNCATION_MARKER = "\n[... the rest of this document is cut to fit the prompt ...]"

DESIGNER_SYSTEM = (
    "You are the environment designer in a self-play curriculum. You write small, executable, text-based "
    "environments (Python programs) that a reasoning agent will play. The best environment is one the agent cannot "
    "yet solve on its own but can solve with your hint: neither trivial nor impossible."
)
AGENT_SYSTEM = (
    "You are playing a text-based environment. Each user message is the environment's observation. Think as much "
    "as you need, then give your move as <action>YOUR MOVE</action>; only the text inside the last action tag is "
    "sent to the environment."
)

JUDGE_SYSTEM = (
    "You check environment programs written for a self-play curriculum before an agent trains on them. Refuse only a "
    "program that no player could ever win; a hard program is welcome, an impossible one is useless."
)
JUDGE_TASK = (
    "Can a player win this environment? The player sees only the observations that reset() and step() return and "
    "answers each with a text action.\n\n{program}\n\n"
    "Follow the reward and termination logic back to the actions that trigger them. The program is UNWINNABLE when "
    "the winning condition can never hold: no sequence of actions reaches the state it checks, two conditions "
    "contradict each other, a comparison can never be true (a string compared with a number, an item looked up in "
    "a list of records), or it needs a value the player can neither read in an observation nor work out from the "
    "task. Values drawn at random are fine as long as an observation reveals them or they can be discovered by "
    "acting. Difficulty, long action sequences, strict formats and unhelpful messages are no reason to refuse.\n\n"
    "End your answer with \\boxed{{yes}} if the environment can be won, or \\boxed{{no}} if it cannot."
)


class PromptError(SpadeError):
    """A prompt cannot be built (missing contract file, inconsistent play history)."""


def load_contract(path: Path = CONTRACT_FILE) -> str:
    """The contract section of docs/environments.md: the example program and its rules."""
    if not path.is_file():
        raise PromptError(f"{path}: environment contract not found; the designer prompt quotes it (it ships with "
                          "the package as spade_mega/envs/environments.md; reinstall spade-mega)")
    text = path.read_text(encoding="utf-8")
    start, end = text.find(_CONTRACT_START), text.find(_CONTRACT_END)
    if start < 0 or end < start:
        raise PromptError(f"{path}: cannot find the contract (from the first ```python block to 'Beside the source')")
    return text[start:end].strip()


@dataclass(frozen=True)
class ChatPrompt:
    messages: list[dict[str, str]]
    text: str  # rendered with the chat template, generation prompt opened
    num_tokens: int | None = None  # the rendered text's length in tokens, when a budget had it measured
    dropped: dict[str, int] = field(default_factory=dict)  # what the budget trimmed: negatives, seeds, document_tokens


@dataclass(frozen=True)
class PromptBudget:
    """The designer prompt must leave room for the designer's answer within the context window."""

    max_context_tokens: int
    max_designer_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return self.max_context_tokens - self.max_designer_tokens


def _control_tokens(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's control tokens (text -> id): its special tokens, and added tokens shaped like a tag
    (``<think>``, ``<tool_call>``, ``<|fim_prefix|>`` in Qwen3 are added but not flagged special, yet chat templates
    give them meaning). Added tokens that are ordinary text (runs of spaces in code tokenizers) are not control."""
    if hasattr(tokenizer, "added_tokens_decoder"):
        added = tokenizer.added_tokens_decoder
    elif hasattr(tokenizer, "get_added_tokens_decoder"):  # a bare `tokenizers.Tokenizer`
        added = tokenizer.get_added_tokens_decoder()
    else:
        return {}
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    return {t.content: i for i, t in added.items()
            if t.special or t.content in special or re.fullmatch(r"<[^<>\s]+>", t.content)}


def _encode(tokenizer: Any, text: str) -> list[int]:
    if hasattr(tokenizer, "encode_batch"):  # a bare `tokenizers.Tokenizer`
        return tokenizer.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


class ControlTokenGuard:
    """Makes untrusted text unable to produce a control token: each occurrence gets a break after its first character.

    The break is a zero-width space (invisible, so the text reads the same), or a plain space for a tokenizer whose
    normaliser deletes zero-width spaces; which one is checked against the tokenizer itself, once, for every token.
    """

    BREAKS = ("\u200b", " ")

    def __init__(self, tokenizer: Any) -> None:
        self.tokens = _control_tokens(tokenizer)
        ids = set(self.tokens.values())
        self.breaks: dict[str, str] = {}
        for token in self.tokens:
            fits = [b for b in self.BREAKS if ids.isdisjoint(_encode(tokenizer, token[0] + b + token[1:]))]
            if not fits:
                raise PromptError(f"cannot neutralise the control token {token!r} of this tokenizer in untrusted "
                                  "text: it still encodes as a control token with a zero-width space or a space "
                                  "inserted")
            self.breaks[token] = fits[0]
        longest_first = sorted(self.tokens, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, longest_first))) if self.tokens else None

    def __call__(self, text: str) -> str:
        if self._pattern is None:
            return text
        # Breaking one occurrence can expose an overlapping one (tokens sharing characters): repeat until none is left.
        # Each pass inserts breaks at new positions of the original text only, so it ends.
        while True:
            text, count = self._pattern.subn(lambda m: m[0][0] + self.breaks[m[0]] + m[0][1:], text)
            if not count:
                return text


def render(tokenizer: Any, messages: Sequence[dict[str, str]], **template_kwargs: Any) -> str:
    """Render messages with the tokenizer's chat template, or the documented plain fallback."""
    if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "apply_chat_template"):
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                             **template_kwargs)
    body = "".join(f"{m['role'].capitalize()}:\n{m['content']}\n\n" for m in messages)
    return body + "Assistant:\n"


def _summary(record: EnvRecord) -> str:
    """One line naming an environment: its class and the first line of its docstring (read with ast, not run)."""
    try:
        tree = ast.parse(record.source)
        classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
        cls = next((c for c in classes if {"reset", "step"} <= {getattr(f, "name", "") for f in c.body}), classes[0])
        doc = (ast.get_docstring(cls) or "").strip().splitlines()
        return f"{cls.name}: {doc[0]}" if doc else cls.name
    except (IndexError, SyntaxError, ValueError, RecursionError, MemoryError):
        return record.source.strip().splitlines()[0][:120] if record.source.strip() else "(empty program)"


def _fenced(source: str) -> str:
    """``source`` in a python code fence longer than any backtick run inside it (CommonMark), so a program that
    quotes ``` lines stays one intact block, as the parser reads it back."""
    longest = max((len(run) for run in re.findall(r"`+", source)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}python\n{source.rstrip()}\n{fence}"


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


class PromptBuilder:
    """Builds designer, agent and hint-play prompts for one run (its skills, tokenizer and contract)."""

    def __init__(self, skills: SkillRegistry, tokenizer: Any, contract: str | None = None,
                 template_kwargs: dict[str, Any] | None = None, budget: PromptBudget | None = None) -> None:
        self.skills, self.tokenizer, self.budget = skills, tokenizer, budget
        self.contract = contract if contract is not None else load_contract()
        self.template_kwargs = dict(template_kwargs or {})
        self.untrusted = ControlTokenGuard(tokenizer)

    @classmethod
    def from_config(cls, cfg: SpadeConfig, tokenizer: Any = None, **kwargs: Any) -> "PromptBuilder":
        """The run's builder: its skills, its tokenizer (``model.tokenizer`` unless given) and the designer prompt
        budget from ``rollout.max_context_tokens`` and ``rollout.max_designer_tokens``."""
        return cls(SkillRegistry.from_config(cfg.curriculum),
                   tokenizer if tokenizer is not None else load_tokenizer(cfg.model.tokenizer),
                   budget=PromptBudget(cfg.rollout.max_context_tokens, cfg.rollout.max_designer_tokens), **kwargs)

    def _prompt(self, messages: list[dict[str, str]]) -> ChatPrompt:
        return ChatPrompt(messages, render(self.tokenizer, messages, **self.template_kwargs))

    def designer(self, skill: str, document: GroundingDocument | None, seeds: Sequence[EnvRecord] = (),
                 negatives: Sequence[EnvRecord] = ()) -> ChatPrompt:
        """Ask for one new environment of ``skill``, grounded in ``document``, steered by memory; trimmed to the
        budget, when there is one (see the module docstring for the order)."""
        text = None if document is None else self.untrusted(document.text)
        seeds, negatives = list(seeds), list(negatives)
        prompt = self._designer(skill, document, text, seeds, negatives)
        budget = self.budget
        if budget is None:
            return prompt
        limit = budget.prompt_tokens
        dropped = {"negatives": 0, "seeds": 0, "document_tokens": 0}
        n = count_tokens(self.tokenizer, prompt.text)
        for kind, records in (("negatives", negatives), ("seeds", seeds)):
            while n > limit and records:
                records.pop()
                dropped[kind] += 1
                prompt = self._designer(skill, document, text, seeds, negatives)
                n = count_tokens(self.tokenizer, prompt.text)
        if n > limit and text is not None:
            whole = count_tokens(self.tokenizer, text)
            keep = whole - (n - limit) - count_tokens(self.tokenizer, TRUNCATION_MARKER)
            while n > limit and keep >= MIN_DOCUMENT_TOKENS:
                piece, kept, _ = truncate_to_tokens(self.tokenizer, text, keep)
                prompt = self._designer(skill, document, piece + TRUNCATION_MARKER, seeds, negatives)
                n = count_tokens(self.tokenizer, prompt.text)
                dropped["document_tokens"] = whole - kept
                keep = min(keep - 1, kept - (n - limit))  # merges across the cut can cost a token or two more
        if n > limit:
            raise self._too_long(budget, skill, document, text)
        return ChatPrompt(prompt.messages, prompt.text, n, dropped)

    def _too_long(self, b: PromptBudget, skill: str, document: GroundingDocument | None,
                  text: str | None) -> PromptError:
        """The error for a prompt over budget even at its smallest: no memory, the document at its floor."""
        if text is not None and count_tokens(self.tokenizer, text) > MIN_DOCUMENT_TOKENS:
            text = truncate_to_tokens(self.tokenizer, text, MIN_DOCUMENT_TOKENS)[0] + TRUNCATION_MARKER
        minimal = count_tokens(self.tokenizer, self._designer(skill, document, text, [], []).text)
        return PromptError(
            f"the designer prompt takes {minimal} tokens even without seeds and negatives and with the grounding "
            f"document cut to {MIN_DOCUMENT_TOKENS} tokens, but rollout.max_context_tokens ({b.max_context_tokens}) "
            f"- rollout.max_designer_tokens ({b.max_designer_tokens}) leave {b.prompt_tokens} tokens for it; raise "
            "rollout.max_context_tokens or lower rollout.max_designer_tokens")

    def _designer(self, skill: str, document: GroundingDocument | None, text: str | None,
                  seeds: Sequence[EnvRecord], negatives: Sequence[EnvRecord]) -> ChatPrompt:
        """The designer prompt with ``document``'s (guarded, possibly cut) ``text``."""
        info, untrusted = self.skills[skill], self.untrusted
        parts = [f"Design one new environment for the skill **{skill}** ({info.description})."]
        if document is not None:
            parts.append(f"Ground it in this document (id {untrusted(document.id)}, domain "
                         f"{untrusted(document.domain)}): take a concept, a procedure or a situation from it and turn "
                         f"it into an interactive task.\n\n<document>\n{text}\n</document>")
        parts.append(f"The program must follow this contract exactly:\n\n{self.contract}")
        if seeds:
            shown = []
            for i, seed in enumerate(seeds, 1):
                shown.append(f"Example {i} (agent win rate {_rate(seed.win_rate)} alone, "
                             f"{_rate(seed.win_rate_hint)} with the hint: the hint helps by {_rate(seed.regret)}):\n"
                             f"<hint>{untrusted(seed.hint)}</hint>\n{_fenced(untrusted(seed.source))}")
            parts.append("Past environments at the right difficulty (hard alone, solvable with the hint). Write "
                         "something new in the same spirit, not a copy:\n\n" + "\n\n".join(shown))
        if negatives:
            lines = []
            for record in negatives:
                verdict = ("mastered: the agent already wins alone" if record.outcome == "mastered"
                           else "unsolvable: the agent fails even with the hint")
                lines.append(f"- {untrusted(_summary(record))} ({verdict}, win rate {_rate(record.win_rate)})")
            parts.append("Do not repeat these; they teach nothing now:\n" + "\n".join(lines))
        parts.append(
            "Answer with exactly these three parts, in this order:\n"
            f"<skill>{skill}</skill>\n"
            "<hint>privileged advice that makes the environment solvable: the strategy, the key fact or the "
            "procedure, without giving away a fixed answer</hint>\n"
            "```python\n# one module: imports from the standard library, then exactly one environment class\n```")
        return self._prompt([{"role": "system", "content": DESIGNER_SYSTEM},
                             {"role": "user", "content": "\n\n".join(parts)}])

    def agent(self, observations: Sequence[str], actions: Sequence[str] = (), hint: str | None = None) -> ChatPrompt:
        """The agent's next-move prompt: the episode so far (observation, action, ..., observation)."""
        if len(observations) != len(actions) + 1:
            raise PromptError(f"an episode prompt needs one more observation than actions, got "
                              f"{len(observations)} observations and {len(actions)} actions")
        untrusted = self.untrusted
        system = AGENT_SYSTEM
        if hint is not None:
            system += f"\n\nA hint from the environment's designer:\n<hint>{untrusted(hint)}</hint>"
        messages = [{"role": "system", "content": system}]
        for i, observation in enumerate(observations):
            messages.append({"role": "user", "content": untrusted(observation)})
            if i < len(actions):
                messages.append({"role": "assistant", "content": f"<action>{untrusted(actions[i])}</action>"})
        return self._prompt(messages)

    def hint_play(self, observations: Sequence[str], actions: Sequence[str], hint: str) -> ChatPrompt:
        """The agent prompt with the designer's privileged hint (hint plays measure regret; never trained on)."""
        return self.agent(observations, actions, hint=hint)

    def solvability_judge(self, source: str) -> ChatPrompt:
        """Ask whether the program ``source`` can be won, answered with a boxed yes or no (the solvability check's
        ``judge`` mode). Like the reference's validator it shows the source alone, not the designer's hint."""
        task = JUDGE_TASK.format(program=_fenced(self.untrusted(source)))
        return self._prompt([{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": task}])
