"""Skills (registry, round-robin, resume state, config checks) and the diversity / curriculum metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from spade_mega.config import ConfigError, load_config
from spade_mega.curriculum.diversity import (curriculum_metrics, difficulty_bucket, diversity_metrics,
                                             duplicate_rate, program_kernel, vendi_score)
from spade_mega.curriculum.skills import Skill, SkillError, SkillRegistry, SkillScheduler

SIX = ["arithmetic", "logic", "navigation", "science", "code_tracing", "tool_use"]


def test_default_registry_has_the_six_reference_skills_with_descriptions() -> None:
    registry = SkillRegistry.from_config(load_config().curriculum)
    assert registry.names == SIX
    assert all(registry[n].description for n in SIX)
    assert registry.domains()["code_tracing"] == ["code"] and "tool_use" in registry
    with pytest.raises(SkillError, match="unknown skill 'poetry'"):
        registry["poetry"]


def test_more_skills_come_from_config() -> None:
    cfg = load_config(None, ["curriculum.skills=[{name: chess, description: board games, domains: [maths]}, "
                             "{name: cooking, description: recipes}]", "curriculum.active_skills=1"])
    registry = SkillRegistry.from_config(cfg.curriculum)
    assert registry.names == ["chess", "cooking"] and registry["cooking"].domains == ()


@pytest.mark.parametrize("override, key", [
    (["curriculum.active_skills=7"], "curriculum.active_skills"),
    (["curriculum.active_skills=0"], "curriculum.active_skills"),
    (["curriculum.skills=[{name: a, description: x}, {name: a, description: y}]", "curriculum.active_skills=1"],
     "curriculum.skills[1].name"),
    (["curriculum.skills=[{name: Bad-Name, description: x}]", "curriculum.active_skills=1"],
     "curriculum.skills[0].name"),
    (["curriculum.skills=[{name: a, description: ' '}]", "curriculum.active_skills=1"],
     "curriculum.skills[0].description"),
    (["curriculum.corpus.token_budget=0"], "curriculum.corpus.token_budget"),
    (["curriculum.corpus.sources=[]"], "curriculum.corpus.sources"),
    (["curriculum.corpus.sources=[{path: x.jsonl, text_field: ''}]"], "curriculum.corpus.sources[0].text_field"),
    (["curriculum.memory.prompt_window=0"], "curriculum.memory.prompt_window"),
    (["curriculum.memory.synchronous=off"], "curriculum.memory.synchronous"),
])
def test_curriculum_config_errors_name_the_key(override: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, override)
    assert info.value.path == key


def test_round_robin_covers_every_skill_and_resumes_exactly() -> None:
    registry = SkillRegistry([Skill(n, n) for n in SIX[:5]])
    sched = SkillScheduler(registry, 3)
    assert sched.next_active() == SIX[:3]
    assert sched.next_active() == [SIX[3], SIX[4], SIX[0]]
    state = sched.state_dict()
    expected = [sched.next_active() for _ in range(4)]
    resumed = SkillScheduler(registry, 3)
    resumed.load_state_dict(state)
    assert [resumed.next_active() for _ in range(4)] == expected and resumed.rounds == 6
    counts = {n: 0 for n in registry.names}
    for _ in range(5):
        for n in sched.next_active():
            counts[n] += 1
    assert set(counts.values()) == {3}  # 5 rounds x 3 = 15 = 3 per skill
    with pytest.raises(SkillError, match="does not match"):
        SkillScheduler(SkillRegistry([Skill(n, n) for n in SIX]), 3).load_state_dict(state)
    with pytest.raises(SkillError, match="active skills"):
        SkillScheduler(registry, 6)


def test_vendi_identical_items_score_one_and_orthogonal_items_score_n() -> None:
    assert vendi_score(np.ones((5, 5))) == pytest.approx(1.0)
    assert vendi_score(np.eye(7)) == pytest.approx(7.0)
    assert vendi_score(np.zeros((0, 0))) == 0.0


def test_vendi_hand_computed_two_item_case() -> None:
    s = 0.5
    eig = np.array([(1 + s) / 2, (1 - s) / 2])  # eigenvalues of [[1, s], [s, 1]] / 2
    expected = math.exp(-float(np.sum(eig * np.log(eig))))
    assert vendi_score(np.array([[1, s], [s, 1]])) == pytest.approx(expected)
    # Two identical clusters of two: behaves like 2 distinct items.
    block = np.kron(np.eye(2), np.ones((2, 2)))
    assert vendi_score(block) == pytest.approx(2.0)


GAME = '''class Maze:
    max_turns = 5

    def reset(self, seed):
        self.pos = 0
        return "start"

    def step(self, action):
        self.pos += 1
        return "moved", 0.0, self.pos > 3, False, {}
'''
RENAMED = GAME.replace("Maze", "Labyrinth").replace("pos", "where").replace("    def step", "    # go\n    def step")
OTHER = '''import random


class Market:
    """Buy low, sell high."""
    max_turns = 9

    def reset(self, seed):
        self.rng = random.Random(seed)
        self.prices = [self.rng.randint(1, 20) for _ in range(9)]
        self.cash, self.stock, self.t = 100, 0, 0
        return f"price {self.prices[0]}"

    def step(self, action):
        price = self.prices[self.t]
        if action == "buy" and self.cash >= price:
            self.cash, self.stock = self.cash - price, self.stock + 1
        elif action == "sell" and self.stock:
            self.cash, self.stock = self.cash + price, self.stock - 1
        self.t += 1
        done = self.t >= len(self.prices)
        return f"cash {self.cash}", (self.cash - 100) / 100 if done else 0.0, done, False, {}
'''


def test_program_kernel_and_duplicates() -> None:
    k = program_kernel([GAME, RENAMED, OTHER])
    assert k[0, 1] == pytest.approx(1.0) and k[0, 2] < 0.2 and np.allclose(k, k.T)
    assert duplicate_rate([GAME, OTHER, RENAMED, GAME]) == pytest.approx(0.5)
    m = diversity_metrics([GAME, RENAMED])
    assert m["vendi"] == pytest.approx(1.0) and m["vendi_per_n"] == pytest.approx(0.5)
    assert diversity_metrics([GAME, OTHER])["vendi"] > 1.8


def test_curriculum_metrics_and_buckets() -> None:
    assert [difficulty_bucket(x) for x in (0.0, 0.2, 0.5, 0.8, 0.81, 1.0)] == \
        ["hard", "medium", "medium", "medium", "easy", "easy"]
    m = curriculum_metrics([0.0, 0.5, 1.0, 0.1], [0.5, 0.5, 1.0, 0.0])
    assert m == {"learnable_fraction": 0.5, "positive_regret_fraction": 0.25, "easy": 0.25, "medium": 0.25,
                 "hard": 0.5}
    with pytest.raises(ValueError):
        curriculum_metrics([0.1], [])


@pytest.mark.parametrize("damage", [{"cursor": None}, {"cursor": "x"}, {"cursor": 7}, {"cursor": -1},
                                    {"rounds": None}, "drop cursor"])
def test_a_damaged_saved_schedule_is_a_skill_error(damage) -> None:
    registry = SkillRegistry([Skill(n, n) for n in SIX])
    state = SkillScheduler(registry, 3).state_dict()
    if damage == "drop cursor":
        del state["cursor"]
    else:
        state.update(damage)
    resumed = SkillScheduler(registry, 3)
    with pytest.raises(SkillError, match="saved skill schedule is damaged"):
        resumed.load_state_dict(state)
    assert resumed.cursor == 0 and resumed.rounds == 0  # left as it was


def test_the_registry_is_a_collection_of_skill_names_the_parser_accepts() -> None:
    # It has `in` and len(), so it reads as the parser's `skills` collection; iterating it went through __getitem__(0)
    # and raised SkillError("unknown skill 0") out of the parser instead of an unknown_skill parse error.
    from spade_mega.curriculum.parsing import DesignerParseError, ParseReason, parse_designer_output

    registry = SkillRegistry([Skill(n, n) for n in SIX])
    assert list(registry) == SIX and sorted(registry) == sorted(SIX)
    body = "```python\nclass A:\n    def reset(self, seed):\n        return ''\n    def step(self, a):\n" \
           "        return '', 0.0, True, False, {}\n```\n"
    assert parse_designer_output(f"<skill>logic</skill><hint>h</hint>\n{body}", registry).skill == "logic"
    with pytest.raises(DesignerParseError) as info:
        parse_designer_output(f"<skill>poetry</skill><hint>h</hint>\n{body}", registry)
    assert info.value.reason is ParseReason.UNKNOWN_SKILL and "tool_use" in str(info.value)
