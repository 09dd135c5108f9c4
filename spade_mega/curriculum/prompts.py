"""Prompts for the three ways the one model is asked: design an environment, play one, play one with the hint.

Every prompt is a list of chat messages rendered through the model's own chat template (the tokenizer's
``apply_chat_template``), so the designer and the agent see exactly the format the model was trained on. A tokenizer
without a chat template (a base model, a bare ``tokenizers.Tokenizer``) gets the plain fallback: each message as
``"<Role>:\\n<content>\\n\\n"`` (System, User, Assistant), ending with ``"Assistant:\\n"`` to open the answer.

The designer prompt quotes the environment contract from ``docs/environments.md`` (the example and its rules), so
the documentation and what the model is told cannot drift apart. It reads it through ``spade_mega/envs/environments.md``,
a symlink to that file, which setuptools packages as a copy: a wheel install carries the contract too.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from spade_mega.curriculum.corpus import GroundingDocument
from spade_mega.curriculum.memory import EnvRecord
from spade_mega.curriculum.skills import SkillRegistry
from spade_mega.errors import SpadeError

CONTRACT_FILE = Path(__file__).resolve().parents[1] / "envs" / "environments.md"
_CONTRACT_START, _CONTRACT_END = "```python", "\nBeside the source"

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
                 template_kwargs: dict[str, Any] | None = None) -> None:
        self.skills, self.tokenizer = skills, tokenizer
        self.contract = contract if contract is not None else load_contract()
        self.template_kwargs = dict(template_kwargs or {})

    def _prompt(self, messages: list[dict[str, str]]) -> ChatPrompt:
        return ChatPrompt(messages, render(self.tokenizer, messages, **self.template_kwargs))

    def designer(self, skill: str, document: GroundingDocument | None, seeds: Sequence[EnvRecord] = (),
                 negatives: Sequence[EnvRecord] = ()) -> ChatPrompt:
        """Ask for one new environment of ``skill``, grounded in ``document``, steered by memory."""
        info = self.skills[skill]
        parts = [f"Design one new environment for the skill **{skill}** ({info.description})."]
        if document is not None:
            parts.append(f"Ground it in this document (id {document.id}, domain {document.domain}): take a concept, "
                         f"a procedure or a situation from it and turn it into an interactive task.\n\n"
                         f"<document>\n{document.text}\n</document>")
        parts.append(f"The program must follow this contract exactly:\n\n{self.contract}")
        if seeds:
            shown = []
            for i, seed in enumerate(seeds, 1):
                shown.append(f"Example {i} (agent win rate {_rate(seed.win_rate)} alone, "
                             f"{_rate(seed.win_rate_hint)} with the hint: the hint helps by {_rate(seed.regret)}):\n"
                             f"<hint>{seed.hint}</hint>\n{_fenced(seed.source)}")
            parts.append("Past environments at the right difficulty (hard alone, solvable with the hint). Write "
                         "something new in the same spirit, not a copy:\n\n" + "\n\n".join(shown))
        if negatives:
            lines = []
            for record in negatives:
                verdict = ("mastered: the agent already wins alone" if record.outcome == "mastered"
                           else "unsolvable: the agent fails even with the hint")
                lines.append(f"- {_summary(record)} ({verdict}, win rate {_rate(record.win_rate)})")
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
        system = AGENT_SYSTEM
        if hint is not None:
            system += f"\n\nA hint from the environment's designer:\n<hint>{hint}</hint>"
        messages = [{"role": "system", "content": system}]
        for i, observation in enumerate(observations):
            messages.append({"role": "user", "content": observation})
            if i < len(actions):
                messages.append({"role": "assistant", "content": f"<action>{actions[i]}</action>"})
        return self._prompt(messages)

    def hint_play(self, observations: Sequence[str], actions: Sequence[str], hint: str) -> ChatPrompt:
        """The agent prompt with the designer's privileged hint (hint plays measure regret; never trained on)."""
        return self.agent(observations, actions, hint=hint)
