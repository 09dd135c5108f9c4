"""A ``gymnasium.Env`` backed by a sandboxed environment program, so gymnasium tooling works with generated
environments: wrappers, the environment checker, ``gymnasium.make("spade_mega/EnvProgram-v0", program=...)``.

Observations and actions are text spaces. The program runs in a sandbox worker, never in this process; a failing
call raises the sandbox's typed error (the next ``reset()`` gets a fresh worker).
"""

from __future__ import annotations

import string
from typing import Any

import gymnasium
from gymnasium import spaces

from spade_mega.config.schema import SandboxConfig
from spade_mega.envs.program import EnvProgram
from spade_mega.envs.sandbox import SandboxPool

ENV_ID = "spade_mega/EnvProgram-v0"
ACTION_CHARSET = frozenset(string.printable)
# What observation_space.sample() draws from: every printable character of the Basic Multilingual Plane below CJK,
# plus newline/tab. Membership takes any str (see FreeText).
OBSERVATION_CHARSET = frozenset(c for c in map(chr, range(0x20, 0x3000)) if c.isprintable()) | frozenset("\n\t")


class FreeText(spaces.Text):
    """A Text space whose members are all strs of an allowed length, in any script: an observation is any str (the
    program contract), and a charset of all of Unicode would be a set of 1.1 million characters. ``sample()`` still
    draws from ``charset``."""

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length


class SandboxEnv(gymnasium.Env[str, str]):
    """One environment program as a gymnasium environment.

    ``program`` is an :class:`EnvProgram` or its source text. Pass a ``pool`` to share workers between environments;
    otherwise the environment starts (and closes) a pool of its own from ``sandbox``. Episodes are truncated at the
    program's ``max_turns`` even if the program forgets to.
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, program: EnvProgram | str, pool: SandboxPool | None = None,
                 sandbox: SandboxConfig | None = None, render_mode: str | None = None,
                 max_action_chars: int = 4096) -> None:
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.program = program if isinstance(program, EnvProgram) else EnvProgram(source=program, hint="", skill="")
        self._own_pool = pool is None
        self.pool = pool if pool is not None else SandboxPool(sandbox or SandboxConfig(warm_workers=1))
        try:
            self.handle = self.pool.open(self.program)
        except BaseException:
            if self._own_pool:
                self.pool.close()
            raise
        self.max_turns = self.handle.max_turns
        self.render_mode = render_mode
        self.observation_space = FreeText(self.pool.cfg.reply_limit_kb << 10, min_length=0, charset=OBSERVATION_CHARSET)
        self.action_space = spaces.Text(max_action_chars, min_length=0, charset=ACTION_CHARSET)
        self._observation = ""
        self._turn = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Without ``seed``, the episode seed is drawn from ``np_random`` (seeded by the last explicit seed)."""
        super().reset(seed=seed)
        episode_seed = seed if seed is not None else int(self.np_random.integers(2**31 - 1))
        self._observation = self.handle.reset(episode_seed)
        self._turn = 0
        return self._observation, {"seed": episode_seed}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        observation, reward, terminated, truncated, info = self.handle.step(action)
        self._turn += 1
        self._observation = observation
        return observation, reward, terminated, truncated or (not terminated and self._turn >= self.max_turns), info

    def render(self) -> str | None:
        return self._observation if self.render_mode == "ansi" else None

    def close(self) -> None:
        self.handle.close()
        if self._own_pool:
            self.pool.close()


if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="spade_mega.envs.gym:SandboxEnv", disable_env_checker=False)
