"""Every library program can be *won* as training counts a win: its scripted solver's episode terminates (a truncated
episode earns 0 under ``rewards.truncated_episode: zero``, the reference setting) within the turns a rollout plays,
with a reward of at least ``rewards.win_threshold``. ``thermostat`` used to truncate every episode, so its reward was
always 0: no signal for the agent, and a program the play-mode solvability check refused."""

from __future__ import annotations

from typing import Iterator

import pytest

from spade_mega.config.schema import RewardsConfig, RolloutConfig, SandboxConfig
from spade_mega.curriculum.rewards import episode_reward, won
from spade_mega.envs import library
from spade_mega.envs.episode import Episode, play_episode
from spade_mega.envs.library import RandomPolicy, ScriptedPolicy
from spade_mega.envs.sandbox import SandboxPool

REWARDS = RewardsConfig()  # truncated_episode: zero, win_threshold 0.5
ROLLOUT_TURNS = RolloutConfig().max_turns


@pytest.fixture(scope="module")
def pool() -> Iterator[SandboxPool]:
    with SandboxPool(SandboxConfig(isolation="best-effort", warm_workers=2)) as pool:
        yield pool


def reward(episode: Episode) -> float:
    """The episode's reward as the rollout computes it."""
    return episode_reward([turn.reward for turn in episode.turns], episode.terminated, REWARDS)


def test_every_library_program_is_won_by_its_scripted_solver(pool: SandboxPool) -> None:
    """At the easiest, default and hardest difficulty: the solver's episodes terminate with a win, within the
    program's max_turns and the default rollout.max_turns."""
    failures = []
    for entry in library.entries():
        for level in (0.0, None, 1.0):
            with pool.open(entry.program(level=level)) as env:
                horizon = min(env.max_turns, ROLLOUT_TURNS)
                for seed in (0, 1):
                    episode = play_episode(env, ScriptedPolicy(entry.oracle), seed, max_steps=horizon)
                    if not (episode.terminated and won(reward(episode), REWARDS)):
                        failures.append(f"{entry.name} level {level} seed {seed}: {len(episode.turns)} turns, "
                                        f"terminated {episode.terminated}, return {episode.episode_return:g}")
    assert not failures, "\n".join(failures)


def test_thermostat_is_won_by_holding_the_target_and_not_by_chance(pool: SandboxPool) -> None:
    entry = library.get("thermostat")
    with pool.open(entry.program()) as env:
        solved = [play_episode(env, ScriptedPolicy(entry.oracle), seed) for seed in range(6)]
        randomly = [play_episode(env, RandomPolicy(entry.action_examples, seed), seed) for seed in range(20)]
        idle = play_episode(env, lambda observation: "0", 0)  # the heater off: the room never warms up
    for episode in solved:
        assert episode.terminated and reward(episode) == 1.0, episode.transcript()[-1500:]
        assert episode.turns[-1].observation.endswith("you win.")
        assert [turn.reward for turn in episode.turns[:-1]] == [0.0] * (len(episode.turns) - 1)
    assert sum(won(reward(episode), REWARDS) for episode in randomly) <= 2
    assert idle.truncated and not idle.terminated and len(idle.turns) == env.max_turns and reward(idle) == 0.0
