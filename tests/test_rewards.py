"""SPADE reward formulas against hand-computed values, and the rewards/rl config sections."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from spade_mega.config import ConfigError, load_config
from spade_mega.config.schema import RewardsConfig
from spade_mega.curriculum.rewards import (
    LearningPotentialTracker,
    SkillTrackers,
    StateError,
    blend,
    designer_reward,
    env_reward_scale,
    episode_reward,
    learnability,
    micro_learning_potential,
    normalized_regret,
    plateau,
    win_rate,
    wls_slope,
    won,
)
from spade_mega.errors import SpadeError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "configs"
CFG = RewardsConfig()


@pytest.mark.parametrize("win_rate, expected", [
    (0.0, 0.0), (0.1, 0.0), (0.15, 0.0), (0.2, 0.2), (0.3, 0.6), (0.4, 1.0), (0.5, 1.0), (0.6, 1.0),
    (0.7, 0.6), (0.8, 0.2), (0.85, 0.0), (1.0, 0.0),
])
def test_plateau_edges_and_ramps(win_rate: float, expected: float) -> None:
    assert plateau(win_rate, 0.4, 0.6, 0.25) == pytest.approx(expected, abs=1e-12)


def test_plateau_is_one_exactly_on_both_edges() -> None:
    assert plateau(0.4, 0.4, 0.6, 0.25) == 1.0 and plateau(0.6, 0.4, 0.6, 0.25) == 1.0
    assert plateau(0.39, 0.4, 0.6, 0.25) < 1.0 and plateau(0.61, 0.4, 0.6, 0.25) < 1.0


@pytest.mark.parametrize("regret, floor, expected", [
    (0.075, True, 0.5), (0.15, True, 1.0), (0.3, True, 1.0), (0.0, True, 0.0), (-0.1, True, 0.0),
    (-0.15, False, -1.0), (0.3, False, 1.0),
])
def test_normalized_regret_cap_and_floor(regret: float, floor: bool, expected: float) -> None:
    assert normalized_regret(regret, 0.15, floor) == pytest.approx(expected)


def test_blend_weights_and_nominal_scale() -> None:
    assert blend(0.5, 0.075, CFG) == pytest.approx(0.6 * 1.0 + 0.4 * 0.5)
    assert blend(0.3, 0.3, CFG) == pytest.approx(0.6 * 0.6 + 0.4 * 1.0)
    assert blend(0.9, -0.4, CFG) == 0.0  # mastered and the hint hurts: floored, not negative
    other = replace(CFG, plateau_weight=0.2, regret_weight=0.8, regret_scale=0.3)
    assert blend(0.5, 0.075, other) == pytest.approx(0.2 + 0.8 * 0.25)


def test_designer_reward_blend_uses_matched_timing_regret_and_window_win_rate() -> None:
    # offset 0: no-hint mean 0.5, hint mean 0.75 -> regret 0.25 -> normalised 1 (capped)
    # window win rate 5/8 = 0.625 -> plateau 1 - 0.025 / 0.25 = 0.9 -> blend 0.6 * 0.9 + 0.4 * 1 = 0.94
    r = designer_reward(CFG, {0: [1, 0, 0, 1], 1: [1, 1, 0, 1]}, [1, 1, 1, 0])
    assert not r.masked
    assert r.value == pytest.approx(0.94)
    assert r.components["regret"] == pytest.approx(0.25) and r.components["win_rate"] == pytest.approx(0.625)
    # later plays never change the regret (they do change the win rate)
    later = designer_reward(CFG, {0: [1, 0, 0, 1], 1: [1, 1, 1, 1]}, [1, 1, 1, 0])
    assert later.components["regret"] == pytest.approx(0.25)


def test_negative_regret_is_floored_or_the_negative_blend_is_masked() -> None:
    plays, hints = {0: [0.0, 0.0]}, [-0.3, -0.3]  # win rate 0 -> plateau 0; regret -0.3
    floored = designer_reward(CFG, plays, hints)
    assert floored.value == 0.0 and not floored.masked
    unfloored = designer_reward(replace(CFG, regret_floor=False), plays, hints)
    assert unfloored.mask_reason == "negative" and unfloored.value == pytest.approx(0.4 * -2.0)
    plain = designer_reward(replace(CFG, variant="regret"), plays, hints)
    assert plain.value == 0.0 and not plain.masked
    plain_pos = designer_reward(replace(CFG, variant="regret"), {0: [0.0, 1.0]}, [1.0, 1.0])
    assert plain_pos.value == pytest.approx(0.5)  # plain regret is not divided by the nominal scale


def test_failures_earn_their_bounded_penalty_and_are_never_masked() -> None:
    timeout = designer_reward(CFG, {}, failure="step_timeout")
    assert timeout.value == -0.5 and not timeout.masked
    assert designer_reward(CFG, {0: [1.0]}, [1.0], failure="invalid_program").value == 0.0
    assert designer_reward(replace(CFG, invalid_program_penalty=-0.2), {}, failure="invalid_program").value == -0.2
    with pytest.raises(ValueError, match="failure must be one of"):
        designer_reward(CFG, {}, failure="crashed")  # type: ignore[arg-type]


def test_missing_plays_mask_the_sample_instead_of_inventing_a_reward() -> None:
    assert designer_reward(CFG, {}, [1.0]).mask_reason == "no_plays"
    assert designer_reward(CFG, {1: [1.0]}, [1.0]).mask_reason == "no_plays"  # nothing at the regeneration step
    assert designer_reward(CFG, {0: [1.0]}, []).mask_reason == "no_plays"  # no hint plays
    with pytest.raises(ValueError, match="finite"):
        designer_reward(CFG, {0: [float("nan")]}, [1.0])


def test_env_reward_scale_and_its_cap() -> None:
    assert env_reward_scale(96, 24, 4, 50.0) == 16.0
    assert env_reward_scale(384, 24, 4, 50.0) == 50.0  # 64 capped at 50
    assert env_reward_scale(16 * 24, 24, 4, 100.0) == 64.0


def test_env_reward_scale_without_designer_or_agent_samples_is_one_as_in_the_reference() -> None:
    """A rollout whose designer wrote nothing usable (or whose agent played nothing) has nothing to balance; the
    reference returns 1.0 there, and so do we (it raised before)."""
    assert env_reward_scale(10, 0, 4, 50.0) == 1.0
    assert env_reward_scale(0, 24, 4, 50.0) == 1.0
    assert env_reward_scale(0, 0, 4, 50.0) == 1.0
    with pytest.raises(ValueError, match="n_designer >= 0"):
        env_reward_scale(10, -1, 4, 50.0)
    with pytest.raises(ValueError, match="regen_interval > 0"):
        env_reward_scale(10, 2, 0, 50.0)


def test_wls_slope_against_hand_value_and_numpy() -> None:
    # x_bar = 1.25, y_bar = 0.375, Sxx = 2.75, Sxy = 0.625 -> slope 5/22
    assert wls_slope([0, 1, 2], [0, 0.5, 0.5], [1, 1, 2]) == pytest.approx(5 / 22)
    xs, ys, ws = [0.0, 1.0, 3.0, 4.0], [0.1, 0.3, 0.2, 0.9], [3.0, 1.0, 2.0, 5.0]
    # np.polyfit weights residuals (not squared residuals), so sqrt(w) gives the same WLS fit
    assert wls_slope(xs, ys, ws) == pytest.approx(np.polyfit(xs, ys, 1, w=np.sqrt(ws))[0])
    assert wls_slope([2, 2], [0.0, 1.0], [1, 1]) == 0.0  # one distinct x: no slope
    with pytest.raises(ValueError, match="differ in length"):
        wls_slope([0, 1], [0.0], [1, 1])


def test_micro_learning_potential_is_fitted_end_minus_start() -> None:
    # (0/1 rewards: each play's win indicator is its reward)
    # ys [0, .5, 1] at xs [0, 1, 3], weights = plays [2, 2, 4]: slope 4.25 / 13.5, span 3 -> 17/18
    assert micro_learning_potential({0: [0, 0], 1: [1, 0], 3: [1, 1, 1, 1]}) == pytest.approx(17 / 18)
    assert micro_learning_potential({0: [1, 1], 1: [0, 0]}) == pytest.approx(-1.0)
    assert micro_learning_potential({0: [1, 0]}) == 0.0
    cfg = replace(CFG, variant="micro_lp")
    assert designer_reward(cfg, {0: [0, 0], 1: [1, 0], 3: [1, 1, 1, 1]}).value == pytest.approx(17 / 18)
    assert designer_reward(cfg, {0: [1, 1], 1: [0, 0]}).value == 0.0  # got worse: floored


def test_learnability_variant() -> None:
    assert (learnability(0.0), learnability(1.0), learnability(0.25)) == (0.0, 0.0, 0.75)
    cfg = replace(CFG, variant="learnability", win_threshold=0.5)
    r = designer_reward(cfg, {0: [1.0, 0.4], 1: [0.6, 0.0]})  # won: 1.0 and 0.6 -> rate 0.5
    assert r.components["win_rate"] == 0.5 and r.value == 0.5
    assert designer_reward(cfg, {0: [1.0, 1.0]}).value == 0.0


# --- one definition of a win --------------------------------------------------------------------------------------

SHAPED = {0: [0.3, 0.3, 0.9, 0.3], 1: [0.3, 0.9, 0.3, 0.3]}  # partial credit 0.3 per episode, a win pays 0.9


def test_a_win_is_a_reward_at_or_above_the_threshold() -> None:
    assert won(0.5, CFG) and won(1.0, CFG) and not won(0.49, CFG) and not won(-1.0, CFG)
    assert win_rate([0.3, 0.9, 0.5, -0.2], CFG) == 0.5 and win_rate([], CFG) == 0.0
    assert win_rate([0.3, 0.9], replace(CFG, win_threshold=0.25)) == 1.0


def test_with_0_1_rewards_the_win_rate_is_the_mean_return_as_in_the_reference() -> None:
    """The reference's games pay 0 or 1 and it uses the mean reward as the win rate: same numbers here."""
    plays, hint = {0: [1, 0, 0, 1], 1: [1, 1, 0, 1]}, [1, 1, 1, 0]
    for threshold in (0.5, 1.0, 0.01):
        cfg = replace(CFG, win_threshold=threshold)
        for variant in ("blend", "learnability", "micro_lp"):
            r = designer_reward(replace(cfg, variant=variant), plays, hint)
            assert r.components["win_rate"] == r.components["return"] == pytest.approx(0.625)
        assert designer_reward(cfg, plays, hint).value == pytest.approx(0.94)  # the blend test's hand value


def test_shaped_rewards_count_wins_in_every_rate_and_returns_in_regret() -> None:
    """Partial credit is not a win: 6 of 8 plays earn 0.3 (mean return 0.45, which the plateau would read as 'just
    right'), 2 win (rate 0.25, too hard). The plateau, learnability and micro learning potential see the 0.25; regret
    stays hint mean return minus no-hint mean return."""
    hint = [0.9, 0.9, 0.3, 0.9]  # mean 0.75; offset-0 no-hint mean 0.45 -> regret 0.3
    r = designer_reward(CFG, SHAPED, hint)
    assert r.components["win_rate"] == 0.25 and r.components["return"] == pytest.approx(0.45)
    assert r.components["plateau"] == pytest.approx(plateau(0.25, 0.4, 0.6, 0.25)) == pytest.approx(0.4)
    assert r.components["regret"] == pytest.approx(0.3)
    assert r.value == pytest.approx(0.6 * 0.4 + 0.4 * 1.0)
    assert designer_reward(replace(CFG, variant="learnability"), SHAPED).value == pytest.approx(0.75)
    # the same plays, with the agent's wins moving from offset 0 to offset 1: micro learning potential counts wins
    rising = {0: [0.3, 0.3, 0.3, 0.3], 1: [0.9, 0.9, 0.3, 0.3]}
    assert designer_reward(replace(CFG, variant="micro_lp"), rising).value == pytest.approx(0.5)
    lp = designer_reward(replace(CFG, variant="learning_potential"), SHAPED, skill_baseline=0.1)
    assert lp.value == pytest.approx(0.15)  # |0.25 - 0.1|, not |0.45 - 0.1|


def test_win_threshold_must_be_reachable() -> None:
    for value in (-1.0, 1.5):
        with pytest.raises(ConfigError, match="rewards.win_threshold"):
            replace(CFG, win_threshold=value).check()
    replace(CFG, win_threshold=1.0).check()


def test_a_config_with_the_removed_solve_threshold_is_told_what_replaced_it(tmp_path: Path) -> None:
    """solve_threshold counted learnability's solves alone; win_threshold decides every win rate, so renaming the key
    blindly changes the plateau and the rest too: the error says so, from a file and from an override."""
    old = tmp_path / "old.yaml"
    old.write_text("rewards:\n  solve_threshold: 0.8\n")
    for args in ((old, ()), (None, ["rewards.solve_threshold=0.8"])):
        with pytest.raises(ConfigError) as info:
            load_config(*args)
        assert info.value.path == "rewards.solve_threshold"
        assert "removed" in str(info.value) and "replaced by rewards.win_threshold" in str(info.value)
        assert "every win rate" in str(info.value)


def test_learning_potential_tracker_by_hand() -> None:
    t = LearningPotentialTracker(0.99, 0.95)
    assert t.potential == 0.0 and t.baseline is None
    assert t.update(0.0) == 0.0 and (t.mu_fast, t.mu_slow) == (0.0, 0.0)
    assert t.update(1.0) == pytest.approx(0.04 / 0.08)  # mu_fast 0.99, mu_slow 0.95
    assert t.baseline == pytest.approx(0.95)
    assert t.update(1.0) == pytest.approx((0.9999 - 0.9975) / 0.08)
    t2 = LearningPotentialTracker(0.99, 0.95)
    for v in (0.0, 1.0):
        t2.update(v)
    t2.update(0.0)  # falling: signed potential negative, potential its magnitude
    assert t2.signed_potential < 0 and t2.potential == pytest.approx(-t2.signed_potential)


def test_learning_potential_variant_pays_distance_from_skill_baseline() -> None:
    cfg = replace(CFG, variant="learning_potential")
    assert designer_reward(cfg, {0: [1, 0], 1: [1, 0]}, skill_baseline=0.95).value == pytest.approx(0.45)
    with pytest.raises(ValueError, match="baseline"):
        designer_reward(cfg, {0: [1.0]})


def test_skill_trackers_state_round_trip_and_bad_state() -> None:
    trackers = SkillTrackers.from_config(CFG)
    for v in (0.1, 0.7, 0.3):
        trackers.update("logic", v)
    trackers.update("maths", 0.5)
    restored = SkillTrackers.from_config(CFG)
    restored.load_state_dict(json.loads(json.dumps(trackers.state_dict())))
    assert restored == trackers
    assert restored.baseline("nothing") is None and restored.potential("nothing") == 0.0
    with pytest.raises(StateError, match="malformed") as info:
        restored.load_state_dict({"skills": {"logic": {"mu_fast": 1.0}}})
    assert isinstance(info.value, SpadeError)
    assert restored == trackers  # unchanged


@pytest.mark.parametrize("entry", [
    {"mu_fast": float("nan"), "mu_slow": 0.5, "updates": 3},  # json.loads accepts NaN: a corrupt file reads back
    {"mu_fast": 0.5, "mu_slow": float("inf"), "updates": 3},
    {"mu_fast": 0.5, "mu_slow": None, "updates": 3},  # one EMA without the other
    {"mu_fast": 0.5, "mu_slow": 0.5, "updates": -1},
])
def test_skill_trackers_refuse_a_state_that_would_poison_the_designer_reward(entry: dict) -> None:
    trackers = SkillTrackers.from_config(CFG)
    trackers.update("logic", 0.4)
    before = trackers.state_dict()
    with pytest.raises(StateError, match="'logic'"):
        trackers.load_state_dict(json.loads(json.dumps({"skills": {"logic": entry}})))
    assert trackers.state_dict() == before


def test_episode_reward() -> None:
    assert episode_reward([0.0, 0.0, 1.0], True, CFG) == 1.0
    assert episode_reward([0.5, 0.25], True, CFG) == 0.75
    assert episode_reward([1.0, 1.0, 1.0], True, CFG) == 1.0  # clipped to agent_reward_max
    assert episode_reward([-1.0, -1.0], True, CFG) == -1.0
    assert episode_reward([0.5, 0.25], False, CFG) == 0.0  # ran out of turns
    assert episode_reward([0.5, 0.25], False, replace(CFG, truncated_episode="return")) == 0.75
    with pytest.raises(ValueError, match="finite"):
        episode_reward([float("inf")], True, CFG)


def test_an_episode_whose_finite_step_rewards_overflow_in_their_sum_is_clipped() -> None:
    """A program may return any finite step reward; two of 1e308 overflow math.fsum (OverflowError, which stopped the
    run from inside the rollout). The return is then beyond any clip bound; a sum that only overflowed on the way
    is exact."""
    assert episode_reward([1e308, 1e308], True, CFG) == 1.0
    assert episode_reward([-1e308, -1e308, 0.5], True, CFG) == -1.0
    assert episode_reward([1e308, 1e308, -1e308, -1e308, 0.25], True, CFG) == 0.25
    assert episode_reward([1e308, 1e308], False, CFG) == 0.0


def test_reference_recipe_rewards_and_rl_values() -> None:
    cfg = load_config(EXAMPLES / "qwen3_30b_a3b_games.yaml")
    r, rl = cfg.rewards, cfg.rl
    assert (r.variant, r.plateau_weight, r.regret_weight, r.regret_scale) == ("blend", 0.6, 0.4, 0.15)
    assert (r.plateau_lo, r.plateau_hi, r.plateau_ramp, r.step_timeout_penalty) == (0.4, 0.6, 0.25, -0.5)
    assert (r.env_reward_scale_cap, r.ema_fast, r.ema_slow) == (50.0, 0.99, 0.95)
    assert (rl.eps_clip_low, rl.eps_clip_high, rl.tis_clip, rl.tis_clip_low) == (0.2, 0.28, 2.0, 0.0)
    assert (rl.kl_coef, rl.entropy_coef) == (0.0, 0.0)


@pytest.mark.parametrize("override, path", [
    ("rewards.step_timeout_penalty=-5", "rewards.step_timeout_penalty"),
    ("rewards.invalid_program_penalty=0.5", "rewards.invalid_program_penalty"),
    ("rewards.ema_slow=0.995", "rewards.ema_fast"),
    ("rewards.plateau_lo=0.7", "rewards.plateau_lo"),
    ("rewards.regret_scale=0", "rewards.regret_scale"),
    ("rewards.variant=blnd", "rewards.variant"),
    ("rl.tis_clip=0.5", "rl.tis_clip_low"),
    ("rl.eps_clip_low=1.5", "rl.eps_clip_low"),
    ("rl.loss_aggregation=seq-mean", "rl.loss_aggregation"),
    ("rl.kl_coef=-1", "rl.kl_coef"),
])
def test_bad_reward_and_rl_config_names_the_key(override: str, path: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert info.value.path == path


def test_cross_section_checks() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rewards.variant=micro_lp", "selfplay.designer_delay=1"])
    assert info.value.path == "selfplay.designer_delay"
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.hint_plays_per_env=0"])
    assert info.value.path == "rollout.hint_plays_per_env"
    load_config(None, ["rollout.hint_plays_per_env=0", "rewards.regret_weight=0"])  # plateau alone needs no hints


def test_plateau_only_blend_pays_without_hint_plays() -> None:
    # the config accepts blend with regret_weight 0 and no hint plays; its designer samples must still be paid
    cfg = load_config(None, ["rollout.hint_plays_per_env=0", "rewards.regret_weight=0"]).rewards
    r = designer_reward(cfg, {0: [1.0, 0.0, 0.0, 0.0], 1: [1.0, 1.0, 0.0, 0.0]}, [])  # win rate 0.375
    assert not r.masked and r.value == pytest.approx(0.6 * (1 - 0.025 / 0.25))
    assert "regret" not in r.components and r.components["plateau"] == pytest.approx(0.9)
    assert not designer_reward(cfg, {1: [1.0, 0.0]}, []).masked  # no play at the regeneration step: plateau only
    assert designer_reward(cfg, {}, []).mask_reason == "no_plays"  # nothing played at all: still nothing to pay
    # with hint plays the regret is still measured and logged, weighted 0
    logged = designer_reward(cfg, {0: [1.0, 0.0]}, [1.0, 1.0])
    assert logged.components["regret"] == pytest.approx(0.5) and logged.value == pytest.approx(0.6)
    # a regret-weighted blend without hint plays stays masked: its regret term cannot be measured
    assert designer_reward(CFG, {0: [1.0, 0.0]}, []).mask_reason == "no_plays"
