"""Skills: the registry of what the designer writes environments for, and the round-robin choice of active skills.

SPADE uses 6 skills with 3 active per regeneration, round-robin, so every skill gets designer attention in turn and
per-skill reward centring compares like with like. The scheduler's state is a cursor, saved with the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from spade_mega.config.schema import CurriculumConfig
from spade_mega.errors import SpadeError


class SkillError(SpadeError):
    """An unknown skill, or a saved skill schedule that does not match the configured skills."""


@dataclass(frozen=True)
class Skill:
    name: str
    description: str
    domains: tuple[str, ...] = ()  # corpus domains that ground it; empty = any


class SkillRegistry:
    """The run's skills in configured order (the order round-robin follows)."""

    def __init__(self, skills: Sequence[Skill]) -> None:
        names = [s.name for s in skills]
        if not skills or len(set(names)) != len(names):
            raise SkillError(f"skills must be a non-empty list of distinct names, got {names}")
        self._skills = {s.name: s for s in skills}

    @classmethod
    def from_config(cls, cfg: CurriculumConfig) -> "SkillRegistry":
        return cls([Skill(s.name, s.description, tuple(s.domains)) for s in cfg.skills])

    @property
    def names(self) -> list[str]:
        return list(self._skills)

    def __len__(self) -> int:
        return len(self._skills)

    def __contains__(self, name: object) -> bool:
        return name in self._skills

    def __iter__(self) -> Iterator[str]:
        """Skill names in order (without it, iteration fell back to ``__getitem__(0)``: "unknown skill 0")."""
        return iter(self._skills)

    def __getitem__(self, name: str) -> Skill:
        try:
            return self._skills[name]
        except KeyError:
            raise SkillError(f"unknown skill {name!r} (known: {', '.join(self._skills)})") from None

    def domains(self) -> dict[str, list[str]]:
        """skill -> corpus domains, as the grounding sampler wants it."""
        return {s.name: list(s.domains) for s in self._skills.values()}


class SkillScheduler:
    """Round-robin over the registry: each regeneration takes the next ``active`` skills, wrapping around."""

    def __init__(self, registry: SkillRegistry, active: int) -> None:
        if not 1 <= active <= len(registry):
            raise SkillError(f"active skills must be in [1, {len(registry)}], got {active}")
        self.registry, self.active = registry, active
        self.cursor = 0
        self.rounds = 0

    def next_active(self) -> list[str]:
        names = self.registry.names
        chosen = [names[(self.cursor + i) % len(names)] for i in range(self.active)]
        self.cursor = (self.cursor + self.active) % len(names)
        self.rounds += 1
        return chosen

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "rounds": self.rounds, "skills": self.registry.names, "active": self.active}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("skills") != self.registry.names or state.get("active") != self.active:
            raise SkillError(f"saved skill schedule ({state.get('skills')}, {state.get('active')} active) does not "
                             f"match the configured one ({self.registry.names}, {self.active} active); resume with "
                             "the same curriculum.skills and curriculum.active_skills")
        cursor, rounds = state.get("cursor"), state.get("rounds")
        if not (isinstance(cursor, int) and isinstance(rounds, int) and 0 <= cursor < len(self.registry)
                and rounds >= 0) or isinstance(cursor, bool) or isinstance(rounds, bool):
            raise SkillError(f"saved skill schedule is damaged (cursor {cursor!r}, rounds {rounds!r}; expected "
                             f"0 <= cursor < {len(self.registry)} and rounds >= 0)")
        self.cursor, self.rounds = cursor, rounds
