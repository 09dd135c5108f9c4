"""Play one episode of a sandboxed environment with a policy, and keep the transcript.

Trusted code on the trainer side: it talks to an environment only through a handle with ``reset`` and ``step``
(a sandbox worker's, or anything with the same two methods), never to program code directly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any, Callable, Protocol, Sequence

Policy = Callable[[str], str]
"""observation -> action; one instance per episode, so a policy may keep memory of what it has seen."""


class Steppable(Protocol):
    """What the runner needs of an environment: the two calls of a sandbox ``EnvHandle``."""

    def reset(self, seed: int) -> str: ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]: ...


def episode_return(step_rewards: Sequence[float]) -> float:
    """The sum of the step rewards, correctly rounded; +-inf where it leaves the float range. Each step reward a
    program returns is finite, their sum need not be (two of 1e308): math.fsum raises OverflowError then."""
    for reward in step_rewards:
        if not math.isfinite(reward):
            raise ValueError(f"step rewards must be finite floats, got {reward!r}")
    try:
        return math.fsum(step_rewards)
    except OverflowError:  # a partial sum overflowed; the exact sum may still be a float
        exact = sum(map(Fraction, step_rewards), Fraction(0))
        try:
            return float(exact)
        except OverflowError:
            return math.inf if exact > 0 else -math.inf


@dataclass
class Turn:
    action: str
    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    """One played episode. ``capped`` means the runner's ``max_steps`` stopped it before the environment did."""

    seed: int
    first_observation: str
    turns: list[Turn] = field(default_factory=list)
    capped: bool = False

    @property
    def episode_return(self) -> float:
        return episode_return([turn.reward for turn in self.turns])

    @property
    def terminated(self) -> bool:
        return bool(self.turns) and self.turns[-1].terminated

    @property
    def truncated(self) -> bool:
        return self.capped or (bool(self.turns) and self.turns[-1].truncated)

    def transcript(self) -> str:
        """Human-readable: observations, the policy's actions (``>``) and rewards."""
        parts = [self.first_observation]
        for turn in self.turns:
            parts.append(f"> {turn.action}")
            parts.append(f"[reward {turn.reward:+.3f}]\n{turn.observation}")
        end = "terminated" if self.terminated else "truncated" if self.truncated else "unfinished"
        parts.append(f"[episode {end}, return {self.episode_return:+.3f}]")
        return "\n".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "first_observation": self.first_observation,
                "turns": [asdict(turn) for turn in self.turns], "capped": self.capped,
                "episode_return": total if math.isfinite(total := self.episode_return) else None}  # JSON has no inf


def play_episode(env: Steppable, policy: Policy, seed: int, max_steps: int = 256) -> Episode:
    """Reset ``env`` with ``seed`` and step it with ``policy`` until it terminates, truncates, or ``max_steps``."""
    episode = Episode(seed=seed, first_observation=env.reset(seed))
    observation = episode.first_observation
    for _ in range(max_steps):
        action = policy(observation)
        observation, reward, terminated, truncated, info = env.step(action)
        episode.turns.append(Turn(action, observation, float(reward), bool(terminated), bool(truncated), info))
        if terminated or truncated:
            return episode
    episode.capped = True
    return episode
