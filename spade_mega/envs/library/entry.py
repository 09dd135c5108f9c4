"""One library environment: its program file, hint, skill, difficulty parameters and scripted oracle.

Difficulty is one mechanism for every entry: each program file carries a *difficulty block* of module constants,

    # difficulty (rendered by the library; each range reads easy..hard)
    GRID = 7  # 5..11: side of the square grid
    # end difficulty

and rendering rewrites only those lines. The file as shipped is itself a valid program at its defaults, the trainer
only ever reads it as text (programs run in sandbox workers), and the ranges are declared next to the code they
steer, so they cannot drift apart. A range reads *easy..hard*, so a single ``level`` in [0, 1] can interpolate every
parameter of every entry from easiest to hardest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from typing import Callable, Generator, Mapping, Union

from spade_mega.envs.program import EnvProgram
from spade_mega.errors import SpadeError

Number = Union[int, float]
OracleScript = Callable[[str], Generator[str, str, None]]

BLOCK_BEGIN = "# difficulty (rendered by the library; each range reads easy..hard)"
BLOCK_END = "# end difficulty"
_NUM = r"-?\d+(?:\.\d+)?"
_LINE = re.compile(rf"^(?P<name>[A-Z][A-Z0-9_]*) = (?P<value>{_NUM})  "
                   rf"# (?P<easy>{_NUM})\.\.(?P<hard>{_NUM}): (?P<doc>.+)$")


class LibraryError(SpadeError, ValueError):
    """A bad request to the environment library (unknown name or skill, bad difficulty value)."""


def _number(text: str) -> Number:
    return float(text) if "." in text else int(text)


@dataclass(frozen=True)
class DifficultyParam:
    """One difficulty knob: a module constant of the program with its default and its easy..hard range."""

    name: str
    default: Number
    easy: Number
    hard: Number
    doc: str

    @property
    def low(self) -> Number:
        return min(self.easy, self.hard)

    @property
    def high(self) -> Number:
        return max(self.easy, self.hard)

    def at_level(self, level: float) -> Number:
        """The value ``level`` of the way from easy (0) to hard (1): integers round to the nearest (half to even),
        decimals to 6 places, so both ends are exact and rendered sources stay readable."""
        value = self.easy * (1.0 - level) + self.hard * level
        return round(value) if isinstance(self.default, int) else round(value, 6)

    def check(self, value: object, where: str) -> Number:
        """``value`` as this parameter's type, or a LibraryError naming the parameter and its range."""
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if isinstance(self.default, int) and not is_int:
            raise LibraryError(f"{where}.{self.name}: must be an integer in {self.low}..{self.high}, got {value!r}")
        if isinstance(self.default, float) and not (is_int or isinstance(value, float)):
            raise LibraryError(f"{where}.{self.name}: must be a number in {self.low}..{self.high}, got {value!r}")
        if not self.low <= value <= self.high:  # type: ignore[operator]
            raise LibraryError(f"{where}.{self.name}: must be in {self.low}..{self.high}, got {value!r}")
        return float(value) if isinstance(self.default, float) else value  # type: ignore[return-value]


def parse_difficulty_block(source: str, where: str) -> dict[str, DifficultyParam]:
    """The difficulty parameters declared in a program's difficulty block (parsed as text, never executed)."""
    lines = source.splitlines()
    try:
        start, end = lines.index(BLOCK_BEGIN), lines.index(BLOCK_END)
    except ValueError:
        raise LibraryError(f"{where}: no difficulty block ({BLOCK_BEGIN!r} ... {BLOCK_END!r})") from None
    params: dict[str, DifficultyParam] = {}
    for line in lines[start + 1:end]:
        match = _LINE.match(line)
        if match is None:
            raise LibraryError(f"{where}: bad difficulty line {line!r} (want 'NAME = 3  # 1..5: what it does')")
        default, easy, hard = (_number(match[k]) for k in ("value", "easy", "hard"))
        if not (type(default) is type(easy) is type(hard)):
            raise LibraryError(f"{where}: {match['name']} mixes integers and decimals in {line!r}")
        param = DifficultyParam(match["name"], default, easy, hard, match["doc"])
        param.check(default, where)
        params[param.name] = param
    if not params:
        raise LibraryError(f"{where}: the difficulty block declares no parameters")
    return params


def render_difficulty_block(source: str, values: Mapping[str, Number]) -> str:
    """``source`` with the given constants of its difficulty block rewritten (everything else byte for byte)."""
    lines = source.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.rstrip("\n") == BLOCK_BEGIN)
    for i in range(start + 1, len(lines)):
        line = lines[i].rstrip("\n")
        if line == BLOCK_END:
            break
        match = _LINE.match(line)
        assert match is not None, line  # parse_difficulty_block accepted this source
        if match["name"] in values:
            name = match["name"]
            lines[i] = f"{name} = {values[name]!r}  # {match['easy']}..{match['hard']}: {match['doc']}\n"
    return "".join(lines)


@dataclass(frozen=True)
class LibraryEntry:
    """A hand-written reference environment.

    ``oracle`` is a generator script: it receives the first observation, yields an action, and is sent each following
    observation. It sees only what the agent sees (the environment runs in a remote sandbox), and its mean return
    over a few seeds reaches ``target_return`` at every difficulty level. ``action_examples`` are legal-looking actions (``{int}``
    and ``{word}`` are filled from the observation) for the random baseline and the docs.
    """

    name: str
    skill: str
    summary: str
    hint: str
    oracle: OracleScript = field(repr=False)
    target_return: float
    action_examples: tuple[str, ...]

    @property
    def program_file(self) -> str:
        return f"programs/{self.name}.py"

    @cached_property
    def template(self) -> str:
        """The program source as shipped (valid at its default difficulty)."""
        path = resources.files("spade_mega.envs.library").joinpath(self.program_file)
        return path.read_text(encoding="utf-8")

    @cached_property
    def difficulty(self) -> dict[str, DifficultyParam]:
        return parse_difficulty_block(self.template, f"library environment {self.name!r}")

    def resolve(self, difficulty: Mapping[str, object] | None = None, level: float | None = None) -> dict[str, Number]:
        """Every parameter's value: defaults (or ``level`` in [0, 1], easy to hard), overridden by ``difficulty``."""
        where = f"{self.name}.difficulty"
        if level is not None and not 0.0 <= level <= 1.0:
            raise LibraryError(f"{self.name}: level must be in [0, 1] (0 easiest, 1 hardest), got {level!r}")
        values = {n: (p.default if level is None else p.at_level(level)) for n, p in self.difficulty.items()}
        for name, value in (difficulty or {}).items():
            if name not in self.difficulty:
                raise LibraryError(f"{where}.{name}: unknown parameter; {self.name} has {', '.join(self.difficulty)}")
            values[name] = self.difficulty[name].check(value, where)
        return values

    def source(self, difficulty: Mapping[str, object] | None = None, level: float | None = None) -> str:
        return render_difficulty_block(self.template, self.resolve(difficulty, level))

    def program(self, difficulty: Mapping[str, object] | None = None, level: float | None = None) -> EnvProgram:
        """The environment program at this difficulty, ready for the sandbox."""
        values = self.resolve(difficulty, level)
        return EnvProgram(source=render_difficulty_block(self.template, values), hint=self.hint, skill=self.skill,
                          provenance={"origin": "library", "name": self.name, "difficulty": values})
