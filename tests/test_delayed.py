"""The delayed designer buffer: release timing, failures, bad input, and exact resume in the middle of a run."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any, Callable

import msgpack
import numpy as np
import pytest
import torch

from spade_mega.config.schema import RewardsConfig, RLConfig
from spade_mega.curriculum.rewards import SkillTrackers, StateError, env_reward_scale
from spade_mega.rl.advantages import designer_advantages, ids_of, token_advantages
from spade_mega.rl.delayed import DelayedDesignerBuffer, DesignerSample
from spade_mega.rl.loss import policy_loss

CFG = RewardsConfig()


def sample(sample_id: str, env_id: str, step: int, skill: str = "logic", failure: str | None = None,
           version: int | None = None, n: int = 6) -> DesignerSample:
    rng = random.Random(sample_id)
    mask = [0, 0] + [1] * (n - 2)
    return DesignerSample(sample_id=sample_id, env_id=env_id, skill=skill, step=step,
                          policy_version=step if version is None else version,
                          token_ids=[rng.randrange(1000) for _ in range(n)], loss_mask=mask,
                          behaviour_logprobs=[-rng.random() * 3 if m else 0.0 for m in mask],
                          failure=failure, metadata={"document_id": f"doc-{sample_id}"})


def test_release_after_the_delay_with_the_window_plays_only() -> None:
    buf = DelayedDesignerBuffer(CFG, delay=4)
    buf.add(sample("d0", "env-a", step=0))
    buf.record_plays("env-a", 0, [1, 0, 0, 1])
    buf.record_plays("env-a", 0, [1, 1, 1, 0], hinted=True)
    buf.record_plays("env-a", 1, [1, 1, 0, 1])
    for step in range(4):
        assert buf.release(step) == [] and len(buf) == 1
    buf.record_plays("env-a", 4, [0, 0, 0, 0])  # after the window: never used
    (out,) = buf.release(4)
    assert out.sample.sample_id == "d0" and out.reward.value == pytest.approx(0.94)  # see test_rewards: blend by hand
    assert out.reward.components["win_rate"] == pytest.approx(0.625)
    assert len(buf) == 0 and "env-a" not in buf and buf.release(5) == []


def test_delay_zero_releases_at_the_regeneration_step() -> None:
    buf = DelayedDesignerBuffer(replace(CFG, variant="regret"), delay=0)
    buf.add(sample("d0", "env-a", step=3))
    buf.record_plays("env-a", 3, [0, 0, 1, 0])
    buf.record_plays("env-a", 3, [1, 1, 0, 1], hinted=True)
    (out,) = buf.release(3)
    assert out.reward.value == pytest.approx(0.5)


def test_step_timeout_and_invalid_program_pay_their_penalty() -> None:
    buf = DelayedDesignerBuffer(CFG, delay=2)
    buf.add(sample("ok", "env-a", 0))
    buf.add(sample("bad", "env-b", 0, failure="invalid_program"))
    buf.add(sample("slow", "env-c", 0))
    for env in ("env-a", "env-c"):
        buf.record_plays(env, 0, [1, 0])
        buf.record_plays(env, 0, [1, 1], hinted=True)
    buf.mark_failed("env-c", "step_timeout")
    out = {r.sample.sample_id: r.reward for r in buf.release(2)}
    assert out["bad"].value == 0.0 and out["slow"].value == -0.5
    assert not out["bad"].masked and not out["slow"].masked
    assert out["ok"].value == pytest.approx(0.6 * 1.0 + 0.4 * 1.0)


def test_an_environment_proposed_twice_pays_each_sample_from_its_own_window() -> None:
    buf = DelayedDesignerBuffer(replace(CFG, variant="regret"), delay=2)
    buf.add(sample("first", "env-a", 0))
    buf.record_plays("env-a", 0, [0, 0])
    buf.record_plays("env-a", 0, [1, 1], hinted=True)
    buf.add(sample("again", "env-a", 1))
    buf.record_plays("env-a", 1, [1, 0])
    buf.record_plays("env-a", 1, [1, 1], hinted=True)
    (first,) = buf.release(2)
    assert first.reward.value == pytest.approx(1.0) and "env-a" in buf
    buf.record_plays("env-a", 2, [1, 1])
    (again,) = buf.release(3)
    assert again.reward.value == pytest.approx(0.5) and "env-a" not in buf


def test_bad_input_is_rejected_and_changes_nothing() -> None:
    buf = DelayedDesignerBuffer(CFG, delay=2)
    buf.add(sample("d0", "env-a", 0))
    before = buf.state_dict()
    bad = sample("d1", "env-b", 0)
    bad.behaviour_logprobs = bad.behaviour_logprobs[:-1]
    with pytest.raises(ValueError, match="differ in length"):
        buf.add(bad)
    with pytest.raises(ValueError, match="already waiting"):
        buf.add(sample("d0", "env-b", 0))
    with pytest.raises(ValueError, match="failure must be one of"):
        buf.add(sample("d2", "env-b", 0, failure="oops"))
    nan = sample("d3", "env-b", 0)
    nan.behaviour_logprobs[-1] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        buf.add(nan)
    with pytest.raises(ValueError, match="no designer sample is waiting for environment 'env-z'"):
        buf.record_plays("env-z", 0, [1.0])
    with pytest.raises(ValueError, match="finite"):
        buf.record_plays("env-a", 0, [float("inf")])
    assert buf.state_dict() == before


def test_learning_potential_variant_needs_the_trackers() -> None:
    cfg = replace(CFG, variant="learning_potential")
    buf = DelayedDesignerBuffer(cfg, delay=1)
    buf.add(sample("d0", "env-a", 0))
    buf.record_plays("env-a", 0, [1, 0])
    with pytest.raises(ValueError, match="SkillTrackers"):
        buf.release(1)
    trackers = SkillTrackers.from_config(cfg)
    trackers.update("logic", 0.9)
    (out,) = buf.release(1, trackers)
    assert out.reward.value == pytest.approx(0.4)


def test_malformed_state_raises_state_error_and_leaves_the_buffer_alone() -> None:
    buf = DelayedDesignerBuffer(CFG, delay=2)
    buf.add(sample("d0", "env-a", 0))
    buf.record_plays("env-a", 0, [1.0])
    good = buf.state_dict()
    broken_sample = json.loads(json.dumps(good))
    del broken_sample["pending"][0]["skill"]
    orphan_plays = json.loads(json.dumps(good))
    orphan_plays["plays"].append(["env-q", "agent", 0, [1.0]])
    for state, match in [({"format": "pickle"}, "not a delayed designer buffer"),
                         ({**good, "version": 99}, "version 99"),
                         (broken_sample, "malformed"), (orphan_plays, "malformed")]:
        with pytest.raises(StateError, match=match):
            buf.load_state_dict(state)
    assert buf.state_dict() == good



def test_a_resume_with_another_delay_pays_waiting_samples_on_their_own_window(caplog) -> None:
    """designer_delay changed from 2 to 4 at a resume: the sample waiting since step 1 is paid at step 3 on the plays
    of steps 1-2, exactly as the uninterrupted run pays it (it was released at step 5, with step 3-4 plays folded in,
    because the state did not record its delay); a sample generated after the resume waits 4 steps."""
    def play(buf: DelayedDesignerBuffer, step: int) -> list:
        if "env-a" in buf:
            buf.record_plays("env-a", step, [float(step % 2), 1.0, 0.0])
            buf.record_plays("env-a", step, [1.0, 1.0, 1.0], hinted=True)
        return buf.release(step)

    straight = DelayedDesignerBuffer(CFG, delay=2)
    straight.add(sample("d1", "env-a", 1))
    paid = {step: play(straight, step) for step in range(1, 4)}
    assert [out.sample.sample_id for out in paid[3]] == ["d1"]

    before = DelayedDesignerBuffer(CFG, delay=2)
    before.add(sample("d1", "env-a", 1))
    play(before, 1)
    resumed = DelayedDesignerBuffer(CFG, delay=4)
    with caplog.at_level("WARNING", logger="spade_mega.rl"):
        resumed.load_state_dict(json.loads(json.dumps(before.state_dict())))
    assert "1 designer sample(s) saved under designer_delay 2 keep it" in caplog.text
    assert play(resumed, 2) == []
    (out,) = play(resumed, 3)
    assert out.sample.sample_id == "d1" and out.reward == paid[3][0].reward
    resumed.add(sample("d3", "env-b", 3))
    assert all(resumed.release(step) == [] for step in range(3, 7)) and len(resumed.release(7)) == 1
    assert resumed.state_dict()["delay"] == 4


def test_a_version_1_state_waits_under_the_buffers_delay() -> None:
    """States saved before delays were recorded resume as they did: every waiting sample under this run's delay."""
    buf = DelayedDesignerBuffer(CFG, delay=2)
    buf.add(sample("d0", "env-a", 0))
    old = {k: v for k, v in buf.state_dict().items() if k not in ("delay", "delays")}
    restored = DelayedDesignerBuffer(CFG, delay=3)
    restored.load_state_dict({**old, "version": 1})
    assert restored.release(2) == [] and len(restored.release(3)) == 1


def test_what_add_accepts_a_checkpoint_restores_exactly_and_the_rest_is_refused_by_name() -> None:
    # numpy values (tokens.numpy() straight from a tensor) are stored as plain numbers, so the state saves
    buf = DelayedDesignerBuffer(CFG, delay=2)
    s = sample("np", "env-a", 0)
    s.token_ids = list(np.array(s.token_ids, dtype=np.int64))
    s.behaviour_logprobs = list(np.array(s.behaviour_logprobs, dtype=np.float32))
    s.metadata = {"document_id": "doc-1", "turns": (1, 2)}
    buf.add(s)
    s.token_ids[0] = -1  # the caller's object is not the buffer's copy
    for dumps, loads in CODECS.values():
        restored = DelayedDesignerBuffer(CFG, delay=2)
        restored.load_state_dict(loads(dumps(buf.state_dict())))
        assert restored.state_dict() == buf.state_dict()
    stored = buf.state_dict()["pending"][0]
    assert all(type(t) is int for t in stored["token_ids"]) and stored["token_ids"][0] != -1
    assert all(type(x) is float for x in stored["behaviour_logprobs"]) and stored["metadata"]["turns"] == [1, 2]

    # values a checkpoint would fail to write, or silently change, or fail to read back (losing every waiting sample)
    before = buf.state_dict()
    bad: list[tuple[str, dict, str]] = [
        ("prompt-none", {"behaviour_logprobs": [None, None, -0.5, -0.1, -0.2, -0.3]}, "behaviour_logprobs"),
        ("float-token", {"token_ids": [1, 2.7, 3, 4, 5, 6]}, "token_ids"),
        ("str-token", {"token_ids": ["1", 2, 3, 4, 5, 6]}, "token_ids"),
        ("half-mask", {"loss_mask": [0, 0.5, 1, 1, 1, 1]}, "loss_mask"),
        ("set-metadata", {"metadata": {"tags": {"maze"}}}, "metadata"),
        ("nan-metadata", {"metadata": {"score": float("nan")}}, "metadata"),
    ]
    for sample_id, fields, name in bad:
        with pytest.raises(ValueError, match=f"designer sample '{sample_id}': {name}"):
            buf.add(replace(sample(sample_id, "env-b", 0), **fields))
    assert buf.state_dict() == before and "env-b" not in buf


# --- resume in the middle of a simulated run -----------------------------------------------------------------------

SKILLS = ("logic", "arithmetic", "navigation")
DELAY, REGEN, STEPS = 4, 4, 14
CODECS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "json": (json.dumps, json.loads),
    "msgpack": (lambda s: msgpack.packb(s, use_bin_type=True), lambda b: msgpack.unpackb(b, raw=False)),
}


def simulate(variant: str, resume_at: int | None = None, codec: str = "json") -> tuple[list, dict, dict]:
    """A SPADE schedule: 5 designer outputs per regeneration (one invalid, one timing out later), agent and hint
    plays drawn from a seeded world, skill trackers fed every step. Optionally serialise and restore mid-run."""
    cfg = replace(CFG, variant=variant, regret_floor=variant != "regret")
    buf, trackers = DelayedDesignerBuffer(cfg, DELAY), SkillTrackers.from_config(cfg)
    log: list = []
    for step in range(STEPS):
        if step == resume_at:
            dumps, loads = CODECS[codec]
            state = loads(dumps({"buffer": buf.state_dict(), "trackers": trackers.state_dict()}))
            buf, trackers = DelayedDesignerBuffer(cfg, DELAY), SkillTrackers.from_config(cfg)
            buf.load_state_dict(state["buffer"])
            trackers.load_state_dict(state["trackers"])
        regen = step - step % REGEN
        if step == regen:
            for k in range(5):
                buf.add(sample(f"d{step}-{k}", f"env-{step}-{k}", step, SKILLS[k % 3],
                               failure="invalid_program" if k == 4 else None, version=step // 2))
        by_skill: dict[str, list[float]] = {}
        for k in range(4):
            env = f"env-{regen}-{k}"
            if env not in buf or (k == 3 and regen == 4 and step > 6):
                continue
            world = random.Random(f"{env}/{step}")
            skill_level = 0.15 * k + 0.1 * (step - regen)  # the agent improves during the window
            returns = [float(world.random() < skill_level) for _ in range(4)]
            buf.record_plays(env, step, returns)
            by_skill.setdefault(SKILLS[k % 3], []).extend(returns)
            if step == regen:
                buf.record_plays(env, step, [float(world.random() < skill_level + 0.3) for _ in range(4)],
                                 hinted=True)
            if k == 3 and regen == 4 and step == 6:
                buf.mark_failed(env, "step_timeout")
        for skill, returns in by_skill.items():
            trackers.update(skill, sum(returns) / len(returns))
        for out in buf.release(step, trackers):
            r = out.reward
            log.append((step, out.sample.to_dict(), r.value, r.mask_reason, dict(r.components)))
    return log, buf.state_dict(), trackers.state_dict()


@pytest.mark.parametrize("variant", ["blend", "regret", "learning_potential", "micro_lp", "learnability"])
@pytest.mark.parametrize("codec", sorted(CODECS))
def test_resume_mid_run_releases_exactly_what_the_uninterrupted_run_does(variant: str, codec: str) -> None:
    baseline = simulate(variant)
    log = baseline[0]
    assert [entry[0] for entry in log] == [4] * 5 + [8] * 5 + [12] * 5
    assert any(entry[2] == -0.5 for entry in log) and len({entry[2] for entry in log}) > 3
    for resume_at in (2, 6, 8):  # mid-window with plays recorded, and on a release-and-regenerate step
        assert simulate(variant, resume_at, codec) == baseline


def test_released_samples_feed_designer_advantages_and_the_tis_loss() -> None:
    log, _, _ = simulate("blend")
    released = [entry for entry in log if entry[0] == 8]
    rewards = torch.tensor([entry[2] for entry in released], dtype=torch.float64)
    valid = torch.tensor([entry[3] is None for entry in released])
    skills = ids_of([entry[1]["skill"] for entry in released])
    scale = env_reward_scale(n_agent=16 * 4, n_designer=len(released), regen_interval=REGEN, cap=50.0)
    adv = designer_advantages(rewards, skills, scale, valid=valid)
    for s in skills.unique():
        rows = (skills == s) & valid
        assert adv[rows].sum().abs() < 1e-9
    # the behaviour log-probs stored at generation time are the TIS reference for the delayed update
    mask = torch.tensor([entry[1]["loss_mask"] for entry in released])
    behaviour = torch.tensor([entry[1]["behaviour_logprobs"] for entry in released], dtype=torch.float64)
    current = (behaviour - 0.7 * mask).requires_grad_()  # the policy moved on: old/behaviour ratio exp(-0.7) ~ 0.5
    loss, metrics = policy_loss(current, current.detach(), token_advantages(adv, mask), mask, RLConfig(),
                                rollout_logprobs=behaviour)
    loss.backward()
    assert metrics["tis_ratio_mean"].item() == pytest.approx(0.4966, abs=1e-3)
    assert current.grad[mask == 0].eq(0).all() and loss.isfinite()
