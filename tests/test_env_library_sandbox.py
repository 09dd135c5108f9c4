"""The reference library played for real: every environment runs in sandbox workers from one pool.

Every program validates at its easiest, default and hardest difficulty; the observation-only oracle reaches its target
return; a random policy scores lower; every difficulty knob changes what an agent sees; the episode runner stops and
records episodes as documented.
"""

from __future__ import annotations

import json
import statistics
from typing import Iterator

import pytest

from spade_mega.config.schema import SandboxConfig
from spade_mega.envs import library
from spade_mega.envs.episode import Episode, play_episode
from spade_mega.envs.library import LibraryEntry, RandomPolicy, ScriptedPolicy
from spade_mega.envs.program import EnvProgram
from spade_mega.envs.sandbox import SandboxPool
from spade_mega.envs.validate import Validator

ENTRIES = library.entries()
ORACLE_SEEDS = (0, 1, 2)
RANDOM_SEEDS = tuple(range(6))


@pytest.fixture(scope="module")
def pool() -> Iterator[SandboxPool]:
    # best-effort: these tests are about the environments, not the isolation (the attack tests cover that)
    with SandboxPool(SandboxConfig(isolation="best-effort", warm_workers=2)) as pool:
        yield pool


def _play(pool: SandboxPool, program: EnvProgram, policies: list, seeds: tuple[int, ...]) -> list[Episode]:
    with pool.open(program) as env:
        return [play_episode(env, policy, seed) for policy, seed in zip(policies, seeds)]


def _oracle(pool: SandboxPool, entry: LibraryEntry, program: EnvProgram, seeds: tuple[int, ...]) -> list[Episode]:
    return _play(pool, program, [ScriptedPolicy(entry.oracle) for _ in seeds], seeds)


def test_every_library_environment_validates_at_every_level(pool: SandboxPool) -> None:
    programs = [e.program(level=level) for e in ENTRIES for level in (0.0, None, 1.0)]
    reports = Validator(pool).validate_many(programs)
    failed = [(p.provenance["name"], p.provenance["difficulty"], r.reason, r.detail)
              for p, r in zip(programs, reports) if not r.ok]
    assert not failed
    assert all(r.max_turns <= 100 for r in reports)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_oracle_reaches_its_target_and_random_play_scores_lower(pool: SandboxPool, entry: LibraryEntry) -> None:
    oracle_means = []
    for level in (None, 0.0, 1.0):
        episodes = _oracle(pool, entry, entry.program(level=level), ORACLE_SEEDS if level is None else (3, 4))
        assert all((ep.terminated or ep.truncated) and not ep.capped for ep in episodes)
        returns = [ep.episode_return for ep in episodes]
        assert all(0.0 <= r <= 1.0 for r in returns)
        assert statistics.mean(returns) >= entry.target_return - 1e-9, (level, episodes[0].transcript()[-2000:])
        oracle_means.append(statistics.mean(returns))
    random_episodes = _play(pool, entry.program(), [RandomPolicy(entry.action_examples, s) for s in RANDOM_SEEDS],
                            RANDOM_SEEDS)
    random_mean = statistics.mean(ep.episode_return for ep in random_episodes)
    assert all(0.0 <= ep.episode_return <= 1.0 for ep in random_episodes)
    assert random_mean < oracle_means[0] and random_mean < entry.target_return


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_every_difficulty_parameter_changes_the_environment(pool: SandboxPool, entry: LibraryEntry) -> None:
    for name, param in entry.difficulty.items():
        transcripts = [[ep.transcript() for ep in _oracle(pool, entry, entry.program({name: value}), (5, 6))]
                       for value in (param.easy, param.hard)]
        assert transcripts[0] != transcripts[1], f"{entry.name}.{name} changes nothing an agent sees"


def test_episode_runner_caps_steps_and_records_the_transcript(pool: SandboxPool) -> None:
    entry = library.get("grid_maze")
    with pool.open(entry.program()) as env:
        capped = play_episode(env, ScriptedPolicy(entry.oracle), seed=0, max_steps=2)
        full = play_episode(env, ScriptedPolicy(entry.oracle), seed=0)
    assert capped.capped and capped.truncated and not capped.terminated and len(capped.turns) == 2
    assert [t.action for t in capped.turns] == [t.action for t in full.turns[:2]]
    assert full.terminated and not full.capped and full.episode_return == pytest.approx(1.0)
    assert full.turns[-1].info["moves"] == len(full.turns) == full.turns[-1].info["shortest"]
    text = full.transcript()
    assert text.startswith(full.first_observation) and f"> {full.turns[0].action}\n" in text
    assert text.endswith("[episode terminated, return +1.000]")
    record = json.loads(json.dumps(full.to_dict()))
    assert record["episode_return"] == pytest.approx(1.0) and len(record["turns"]) == len(full.turns)


def test_an_episode_whose_finite_rewards_sum_past_the_float_range_is_recorded(pool: SandboxPool) -> None:
    """Each step reward is finite, the sum of 1e308 twice is not: the return is +inf (math.fsum raised), the sum
    that comes back into range is exact, and the record is strict JSON (null where the return is not finite)."""
    source = ("class Overflow:\n    max_turns = 3\n    def reset(self, seed):\n        self.t = 0\n"
              "        return 'go'\n    def step(self, action):\n        self.t += 1\n"
              "        reward = -1e308 if action == 'down' else 1e308\n"
              "        return 'o', reward, self.t == 3, False, {}\n")
    with pool.open(EnvProgram(source, "any action", "logic")) as env:
        over = play_episode(env, lambda observation: "up", seed=0, max_steps=2)
        actions = iter(["up", "up", "down"])
        back = play_episode(env, lambda observation: next(actions), seed=0)
    assert over.capped and over.episode_return == float("inf")
    assert over.transcript().endswith("[episode truncated, return +inf]")
    assert json.loads(json.dumps(over.to_dict(), allow_nan=False))["episode_return"] is None
    assert back.terminated and back.episode_return == 1e308 and back.to_dict()["episode_return"] == 1e308
