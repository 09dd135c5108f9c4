"""Per-role GRPO advantages: hand-computed values and property-based invariants."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spade_mega.rl.advantages import (
    AGENT,
    DESIGNER,
    agent_advantages,
    designer_advantages,
    grpo_advantages,
    ids_of,
    token_advantages,
)

T = torch.tensor
PROPS = settings(max_examples=80, deadline=None)


def test_agent_group_normalisation_by_hand() -> None:
    # group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) -> +-0.5 * sqrt(3)
    adv = agent_advantages(T([1.0, 0.0, 0.0, 1.0]), T([7, 7, 7, 7]), eps=0.0)
    assert torch.allclose(adv, T([1.0, -1.0, -1.0, 1.0]) * 0.5 * math.sqrt(3))
    centred = agent_advantages(T([1.0, 0.0, 0.0, 1.0]), T([7, 7, 7, 7]), std_normalize=False)
    assert torch.equal(centred, T([0.5, -0.5, -0.5, 0.5]))


def test_groups_of_one_and_all_equal_rewards_give_exact_zero() -> None:
    rewards = T([0.1, 0.1, 0.1, 0.7, -0.3, 2.0, 1.0], dtype=torch.float64)
    groups = T([0, 0, 0, 1, 2, 3, 3])
    adv = agent_advantages(rewards, groups)
    assert adv[:5].eq(0).all() and adv.isfinite().all()
    assert adv[5] > 0 > adv[6]
    designer = designer_advantages(T([0.3, 0.3, 0.9]), T([0, 0, 1]), 50.0)
    assert designer.eq(0).all()


def test_designer_centred_per_skill_and_scaled_never_std_divided() -> None:
    adv = designer_advantages(T([0.75, 0.25, 0.5, 0.5], dtype=torch.float64), T([0, 0, 0, 1]), 10.0)
    assert torch.equal(adv, T([2.5, -2.5, 0.0, 0.0], dtype=torch.float64))


def test_masked_designer_rows_get_zero_and_leave_the_skill_mean_alone() -> None:
    rewards = T([1.0, 0.5, -0.8], dtype=torch.float64)
    valid = T([True, True, False])
    adv = designer_advantages(rewards, T([0, 0, 0]), 2.0, valid=valid)
    assert torch.equal(adv, T([0.5, -0.5, 0.0], dtype=torch.float64))


def test_mixed_batch_equals_each_role_alone_and_roles_never_share_a_group() -> None:
    agent_r, agent_g = T([1.0, 0.0, 1.0, 1.0, 0.0]), T([0, 0, 0, 1, 1])
    designer_r, designer_s = T([0.9, 0.1, 0.4]), T([0, 0, 1])  # skill id 0 == group id 0: still separate groups
    mixed = grpo_advantages(torch.cat([agent_r, designer_r]), torch.cat([agent_g, T([9, 9, 9])]),
                            T([AGENT] * 5 + [DESIGNER] * 3), torch.cat([T([5] * 5), designer_s]), 16.0)
    assert torch.allclose(mixed[:5], agent_advantages(agent_r, agent_g))
    assert torch.allclose(mixed[5:], designer_advantages(designer_r, designer_s, 16.0))


def test_bad_inputs_are_rejected_with_clear_errors() -> None:
    with pytest.raises(ValueError, match="finite"):
        agent_advantages(T([1.0, float("nan")]), T([0, 0]))
    with pytest.raises(ValueError, match="shape"):
        agent_advantages(T([1.0, 0.0]), T([0, 0, 0]))
    with pytest.raises(ValueError, match="roles"):
        grpo_advantages(T([1.0]), T([0]), T([2]), T([0]), 1.0)
    with pytest.raises(ValueError, match="designer_scale"):
        designer_advantages(T([1.0]), T([0]), float("inf"))


def test_ids_of_numbers_labels_by_first_appearance() -> None:
    assert ids_of(["logic", "maths", "logic", "code"]).tolist() == [0, 1, 0, 2]


def test_token_broadcast_padded_packed_and_multi_turn_mask() -> None:
    adv = T([2.0, -1.0])
    # multi-turn row 0: prompt(2) action(2) observation(2) action(1) pad(1); only the model's own tokens train
    mask = T([[0, 0, 1, 1, 0, 0, 1, 0], [0, 1, 1, 1, 0, 0, 0, 0]])
    out = token_advantages(adv, mask)
    assert out.tolist() == [[0, 0, 2, 2, 0, 0, 2, 0], [0, -1, -1, -1, 0, 0, 0, 0]]
    packed = token_advantages(adv, T([0, 1, 1, 1, 0, 1]), sample_ids=T([0, 0, 0, 1, 1, 1]))
    assert packed.tolist() == [0, 2, 2, -1, 0, -1]
    with pytest.raises(ValueError, match="sample_ids"):
        token_advantages(adv, T([1, 1]))


# --- properties ----------------------------------------------------------------------------------------------------

finite_rewards = st.one_of(
    st.floats(-1e6, 1e6, allow_nan=False),
    st.floats(-1e-30, 1e-30, allow_nan=False),  # tiny, distinct: the std is far below eps
    st.sampled_from([0.0, 1.0, -1.0, 0.5]),
)


@st.composite
def mixed_batches(draw, rewards=finite_rewards):
    n = draw(st.integers(1, 24))
    return (T(draw(st.lists(rewards, min_size=n, max_size=n)), dtype=torch.float64),
            T(draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))),
            T(draw(st.lists(st.sampled_from([AGENT, DESIGNER]), min_size=n, max_size=n))),
            T(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))),
            T(draw(st.lists(st.booleans(), min_size=n, max_size=n))))


@PROPS
@given(batch=mixed_batches(), scale=st.floats(0.0, 50.0), std_normalize=st.booleans(),
       eps=st.sampled_from([1e-6, 1e-12, 0.0]))
def test_advantages_are_finite_for_any_input(batch, scale, std_normalize, eps) -> None:
    rewards, groups, roles, skills, valid = batch
    adv = grpo_advantages(rewards, groups, roles, skills, scale, std_normalize=std_normalize, eps=eps, valid=valid)
    assert adv.shape == rewards.shape and adv.isfinite().all()
    assert adv[~valid].eq(0).all()


grid_rewards = st.integers(-8, 8).map(lambda k: k / 8)  # episode returns in [-1, 1]: std well above eps


@PROPS
@given(batch=mixed_batches(grid_rewards))
def test_agent_advantages_zero_mean_unit_std_per_group(batch) -> None:
    rewards, groups, _, _, _ = batch
    adv = agent_advantages(rewards, groups)
    for g in groups.unique():
        rows = groups == g
        if rewards[rows].unique().numel() >= 2:
            assert adv[rows].mean().abs() < 1e-9
            assert adv[rows].std() == pytest.approx(1.0, rel=1e-4)  # unbiased std, like the normaliser
        else:
            assert adv[rows].eq(0).all()


@PROPS
@given(batch=mixed_batches(st.floats(-1.0, 1.0, allow_nan=False)), scale=st.floats(0.0, 50.0))
def test_designer_advantages_zero_mean_per_skill(batch, scale) -> None:
    rewards, _, _, skills, valid = batch
    adv = designer_advantages(rewards, skills, scale, valid=valid)
    for s in skills.unique():
        rows = (skills == s) & valid
        if rows.any():
            assert adv[rows].mean().abs() < 1e-9
            expected = (rewards[rows] - rewards[rows].mean()) * scale
            assert torch.allclose(adv[rows], expected, atol=1e-9)


def test_packed_sample_ids_are_positions_checked_on_loss_tokens_only() -> None:
    adv = T([2.0, -1.0])
    # padding tokens may carry any id (-1, or one past the last sample): they are outside the loss mask
    out = token_advantages(adv, T([1, 1, 0, 1, 0]), sample_ids=T([0, 0, 2, 1, -1]))
    assert out.tolist() == [2.0, 2.0, 0.0, -1.0, 0.0]
    # labels that are not positions (as policy_loss accepts) are refused by name, not an IndexError
    with pytest.raises(ValueError, match=r"sample_ids .*positions in advantages \(0\.\.1\).*\[10, 20\]"):
        token_advantages(adv, T([1, 1, 0, 1]), sample_ids=T([10, 10, 10, 20]))
    assert token_advantages(T([]), T([0, 0]), sample_ids=T([5, 5])).tolist() == [0.0, 0.0]
