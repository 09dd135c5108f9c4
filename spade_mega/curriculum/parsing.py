"""Parsing model outputs: designer output -> EnvProgram (or a typed error with a reason code); agent output -> action.

The designer answers in the format its prompt asks for (``prompts.py``)::

    <skill>navigation</skill>
    <hint>privileged advice for solving it</hint>
    ```python
    ...one module defining exactly one environment class...
    ```

Parsing treats the output as untrusted text: it never executes the program (``ast.parse`` only), bounds the work by
the output length, and raises nothing but :class:`DesignerParseError`, whose ``reason`` is counted in metrics.
Reasoning blocks (``<think>...</think>``) are dropped first, so code sketched while thinking is not mistaken for the
answer.
"""

from __future__ import annotations

import ast
import re
import warnings
from dataclasses import dataclass
from enum import Enum
from typing import Any, Collection

from spade_mega.envs.program import EnvProgram
from spade_mega.errors import SpadeError

MAX_SOURCE_CHARS = 100_000  # a 16k-token designer budget is ~64k characters of code
_PYTHON_LANGS = frozenset({"", "python", "py", "python3"})
_THINK_END = "</think>"
_LINE_END = re.compile(r"\r\n|\r|\n")  # Python's and CommonMark's line ends; str.splitlines knows eight more


class ParseReason(str, Enum):
    """Why a designer output was rejected (one code per failure, counted in metrics)."""

    EMPTY = "empty"  # nothing but whitespace (after dropping the reasoning block)
    TRUNCATED = "truncated"  # hit the token limit, or a code block / reasoning block is never closed
    NO_CODE_BLOCK = "no_code_block"
    SEVERAL_CODE_BLOCKS = "several_code_blocks"
    TOO_LONG = "too_long"  # the program exceeds the size limit
    SYNTAX_ERROR = "syntax_error"  # ast.parse rejects the program
    NO_ENV_CLASS = "no_env_class"  # no top-level class with both reset() and step()
    SEVERAL_CLASSES = "several_classes"  # more than one such class: which one is the environment?
    MISSING_HINT = "missing_hint"  # no <hint>...</hint>, or an empty one
    SEVERAL_HINTS = "several_hints"
    MISSING_SKILL = "missing_skill"
    SEVERAL_SKILLS = "several_skills"
    UNKNOWN_SKILL = "unknown_skill"  # not one of the run's skills
    WRONG_SKILL = "wrong_skill"  # a run skill, but not the one the prompt asked for


class DesignerParseError(SpadeError):
    """A designer output that does not hold one well-formed environment; ``reason`` says why."""

    def __init__(self, reason: ParseReason, detail: str) -> None:
        self.reason, self.detail = reason, detail
        super().__init__(f"designer output rejected ({reason.value}): {detail}")


def strip_reasoning(text: str) -> tuple[str, bool]:
    """Drop a leading reasoning block; returns (answer, closed). An opened, never closed block is not closed.

    The block ends at the *first* ``</think>`` (reasoning cannot contain its own end; the answer may quote the tags),
    and only a ``<think>`` that opens the output starts one (chat templates that open it in the prompt leave just
    the ``</think>``).
    """
    _, end, answer = text.partition(_THINK_END)
    if end:
        return answer, True
    return text, not text.lstrip().startswith("<think>")


def _fence(line: str) -> tuple[int, str, str] | None:
    """(indentation in columns, fence, info string) when ``line`` is a CommonMark code fence (3+ backticks or
    tildes), else None.

    A plain scan, not a regex: a fence line padded with 100k blanks must not cost backtracking time.
    """
    stripped = line.strip(" \t")
    if stripped[:1] not in ("`", "~"):
        return None
    width = len(stripped) - len(stripped.lstrip(stripped[0]))
    info = stripped[width:].strip()
    if width < 3 or (stripped[0] == "`" and "`" in info):
        return None
    return len(line[:len(line) - len(line.lstrip(" \t"))].expandtabs(4)), stripped[:width], info


def _code_blocks(text: str) -> tuple[list[tuple[str, str]], str, bool]:
    """Fenced blocks as (language, body), the text outside them, and whether every fence was closed.

    As in CommonMark, a block closes only at a bare fence of the same character at least as long as the opening one,
    indented at most 3 columns more, so a program whose text holds ``` lines can be sent inside a ```` fence, and a
    ``` line indented with the code (a docstring's example) stays program text. A fence indented by n spaces whose
    lines all are too (a list item) takes those n spaces off them; otherwise the lines are kept as they are. Lines end only at \n, \r\n or \r, as in Python:
    a form feed or U+2028 inside a string literal is program text.
    """
    blocks, outside, body, lang, opening, indent = [], [], None, "", "", 0
    for line in _LINE_END.split(text):
        fence = _fence(line)
        if body is None:
            if fence:
                body, (indent, opening, info) = [], fence
                lang = info.split()[0].lower() if info else ""
            else:
                outside.append(line)
        elif fence and not fence[2] and fence[1][0] == opening[0] and len(fence[1]) >= len(opening) \
                and fence[0] <= indent + 3:
            if indent and all(line.startswith(" " * indent) or not line.strip() for line in body):
                body = [line[indent:] for line in body]
            blocks.append((lang, "\n".join(body) + "\n"))
            body = None
        else:
            body.append(line)
    return blocks, "\n".join(outside), body is None


def _tag_values(text: str, name: str) -> list[str]:
    """Contents of every ``<name>...</name>`` (case-insensitive), in one linear scan (no regex backtracking on
    adversarial inputs full of unclosed tags)."""
    opening, closing = re.compile(f"<{name}>", re.IGNORECASE), re.compile(f"</{name}>", re.IGNORECASE)
    values, pos = [], 0
    while (start := opening.search(text, pos)) is not None:
        end = closing.search(text, start.end())
        if end is None:
            break
        values.append(text[start.end():end.start()])
        pos = end.end()
    return values


def _tag(text: str, name: str, missing: ParseReason, several: ParseReason) -> str:
    values = _tag_values(text, name)
    if len(values) > 1:
        raise DesignerParseError(several, f"{len(values)} <{name}> tags; give exactly one")
    if not values or not values[0].strip():
        what = "is empty" if values else f"is missing (write <{name}>...</{name}> outside the code block)"
        raise DesignerParseError(missing, f"<{name}> {what}")
    return values[0].strip()


def _env_classes(tree: ast.Module) -> list[str]:
    names = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            methods = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            if {"reset", "step"} <= methods:
                names.append(node.name)
    return names


def parse_designer_output(text: str, skills: Collection[str], expected_skill: str | None = None,
                          finished: bool = True, max_source_chars: int = MAX_SOURCE_CHARS,
                          provenance: dict[str, Any] | None = None) -> EnvProgram:
    """The environment in a designer output, or :class:`DesignerParseError`.

    ``finished``: False when generation stopped at the token limit (the output is then truncated whatever it holds).
    ``expected_skill``: the skill the prompt asked for; another run skill is ``wrong_skill``.
    """
    if not finished:
        raise DesignerParseError(ParseReason.TRUNCATED, "generation stopped at the token limit")
    answer, closed = strip_reasoning(text)
    if not closed:
        raise DesignerParseError(ParseReason.TRUNCATED, "the reasoning block (<think>) is never closed")
    if not answer.strip():
        raise DesignerParseError(ParseReason.EMPTY, "no answer after the reasoning block" if text.strip()
                                 else "the output is empty")
    blocks, outside, all_closed = _code_blocks(answer)
    if not all_closed:
        raise DesignerParseError(ParseReason.TRUNCATED, "a ``` code block is opened but never closed")
    python = [body for lang, body in blocks if lang in _PYTHON_LANGS]
    if not python:
        raise DesignerParseError(ParseReason.NO_CODE_BLOCK, "no ```python code block")
    if len(python) > 1:
        raise DesignerParseError(ParseReason.SEVERAL_CODE_BLOCKS,
                                 f"{len(python)} python code blocks; put the whole module in one")
    hint = _tag(outside, "hint", ParseReason.MISSING_HINT, ParseReason.SEVERAL_HINTS)
    skill = _tag(outside, "skill", ParseReason.MISSING_SKILL, ParseReason.SEVERAL_SKILLS).lower()
    if skill not in skills:
        raise DesignerParseError(ParseReason.UNKNOWN_SKILL,
                                 f"skill {skill[:80]!r} is not one of: {', '.join(sorted(skills))}")
    if expected_skill is not None and skill != expected_skill:
        raise DesignerParseError(ParseReason.WRONG_SKILL, f"asked for skill {expected_skill!r}, got {skill!r}")
    source = python[0]
    if len(source) > max_source_chars:
        raise DesignerParseError(ParseReason.TOO_LONG,
                                 f"program has {len(source)} characters (limit {max_source_chars})")
    try:
        with warnings.catch_warnings():  # the program's own warnings (invalid escapes...) are not ours to show
            warnings.simplefilter("ignore")
            tree = ast.parse(source)
    except SyntaxError as exc:
        raise DesignerParseError(ParseReason.SYNTAX_ERROR, f"line {exc.lineno}: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError, OverflowError) as exc:
        raise DesignerParseError(ParseReason.SYNTAX_ERROR, f"cannot parse: {type(exc).__name__}") from None
    classes = _env_classes(tree)
    if not classes:
        raise DesignerParseError(ParseReason.NO_ENV_CLASS, "no top-level class defines both reset() and step()")
    if len(classes) > 1:
        raise DesignerParseError(ParseReason.SEVERAL_CLASSES,
                                 f"{len(classes)} environment classes ({', '.join(classes[:5])}); define exactly one")
    return EnvProgram(source=source, hint=hint, skill=skill, provenance=dict(provenance or {}))


@dataclass(frozen=True)
class AgentAction:
    """The action to send to ``step()``; ``well_formed`` is False when the agent ignored the action format."""

    text: str
    well_formed: bool


def parse_agent_output(text: str, max_chars: int = 4096) -> AgentAction:
    """The content of the last ``<action>...</action>``; without one, the whole answer (after reasoning), stripped.

    Never raises: a malformed action still goes to the environment, whose reward judges it.
    """
    answer, _ = strip_reasoning(text)
    found = _tag_values(answer, "action")
    if found:
        return AgentAction(found[-1].strip()[:max_chars], True)
    return AgentAction(answer.strip()[:max_chars], False)
