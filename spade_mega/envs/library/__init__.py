"""The reference environment library: hand-written environment programs with hints, skills, difficulty knobs
and scripted oracles.

They are the fixed-environment baseline, the designer's few-shot seeds and the validator's fixtures. Programs live
in ``programs/`` as plain text for the sandbox (this package never imports or runs them); the oracles here act only
on observations, as an agent would.

    from spade_mega.envs import library
    entry = library.get("grid_maze")
    program = entry.program(level=0.5)          # or entry.program({"SIZE": 9})
    [e.name for e in library.by_skill("logic")]
"""

from __future__ import annotations

from spade_mega.config.schema import CurriculumConfig
from spade_mega.envs.library import arithmetic, code_tracing, logic, navigation, science, tool_use
from spade_mega.envs.library.entry import DifficultyParam, LibraryEntry, LibraryError
from spade_mega.envs.library.policies import RandomPolicy, ScriptedPolicy
from spade_mega.envs.program import EnvProgram

SKILLS = tuple(skill.name for skill in CurriculumConfig().skills)
"""The default curriculum's six skills (arithmetic, logic, navigation, science, code_tracing, tool_use)."""

_ENTRIES: dict[str, LibraryEntry] = {
    e.name: e for module in (arithmetic, logic, navigation, science, code_tracing, tool_use) for e in module.ENTRIES
}


def entries(skill: str | None = None) -> list[LibraryEntry]:
    """Every library environment (of one skill if given), grouped by skill in ``SKILLS`` order."""
    return by_skill(skill) if skill is not None else [e for s in SKILLS for e in by_skill(s)]


def by_skill(skill: str) -> list[LibraryEntry]:
    if skill not in SKILLS:
        raise LibraryError(f"unknown skill {skill!r}; the library has {', '.join(SKILLS)}")
    return [e for e in _ENTRIES.values() if e.skill == skill]


def names() -> list[str]:
    return [e.name for e in entries()]


def get(name: str) -> LibraryEntry:
    try:
        return _ENTRIES[name]
    except KeyError:
        raise LibraryError(f"no library environment {name!r}; known: {', '.join(names())}") from None


def render(name: str, difficulty: dict[str, object] | None = None, level: float | None = None) -> EnvProgram:
    """The named environment as an ``EnvProgram`` at the given difficulty (defaults, or ``level`` 0 easy..1 hard)."""
    return get(name).program(difficulty, level)


__all__ = ["SKILLS", "DifficultyParam", "LibraryEntry", "LibraryError", "RandomPolicy", "ScriptedPolicy",
           "by_skill", "entries", "get", "names", "render"]
