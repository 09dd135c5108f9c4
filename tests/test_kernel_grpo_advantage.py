"""The fused per-role advantage op against ``rl.advantages`` (its specification): compiled on a GPU when there is one,
under the Triton interpreter on CPU otherwise (see kernel_support).

Fresh random batches each run (the seed is in every failure message); the launch counter proves the kernel ran.
"""

from __future__ import annotations

import os

import pytest
import torch

from spade_mega.kernels import grpo_advantage as op
from spade_mega.kernels.dispatch import LAUNCHES
from spade_mega.rl.advantages import AGENT, DESIGNER, grpo_advantages, token_advantages
from kernel_support import to_cpu, to_kernel_device


@pytest.fixture
def gen() -> torch.Generator:
    """A generator seeded afresh each run; ``initial_seed()`` reproduces a failure."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def run(*args, **kwargs) -> op.GrpoAdvantages:
    """The op on the kernel device (inputs moved there differentiably), its result back on CPU."""
    return to_cpu(op.grpo_advantage(*to_kernel_device(args), **{k: to_kernel_device(v) for k, v in kwargs.items()}))


def mixed_batch(gen: torch.Generator, dtype: torch.dtype = torch.float32):
    """Agent groups of 1, 2, 16 and 150 samples (one of them all-equal), designer samples over 4 skills, a few
    invalid rows, one group with no valid row, ids neither compact nor sorted, samples shuffled."""
    sizes = [1, 2, 16, 16, 150, 5]
    group_ids = torch.cat([torch.full((n,), 1000 - 37 * g) for g, n in enumerate(sizes)])
    n_agent, n_designer = group_ids.numel(), 40
    rewards = torch.randn(n_agent + n_designer, generator=gen, dtype=torch.float64)
    rewards[sizes[0] + sizes[1]: sizes[0] + sizes[1] + 16] = 0.75  # a group whose rewards are all equal
    roles = torch.cat([torch.full((n_agent,), AGENT), torch.full((n_designer,), DESIGNER)])
    group_ids = torch.cat([group_ids, torch.randint(0, 9, (n_designer,), generator=gen)])  # unused for designers
    skill_ids = torch.randint(-2, 2, (n_agent + n_designer,), generator=gen) * 7  # unused for agents
    valid = torch.rand(n_agent + n_designer, generator=gen) > 0.05
    valid[-5:] = False
    valid[sum(sizes) - 5: sum(sizes)] = False  # the last agent group has no valid sample
    perm = torch.randperm(rewards.numel(), generator=gen)
    return (rewards[perm].to(dtype), group_ids[perm], roles[perm], skill_ids[perm], valid[perm])


@pytest.mark.parametrize("tile", [None, 16], ids=["one-tile", "16-sample-tiles"])
@pytest.mark.parametrize("std_normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
def test_matches_rl_advantages_per_sample_and_per_token(gen, dtype, std_normalize, tile) -> None:
    """The default tile holds the whole batch (one launch); 16-sample tiles cut groups across tiles (the 150-sample
    group spans ten), so the first pass and the combination of tiles' shares run too."""
    seed = gen.initial_seed()
    rewards, group_ids, roles, skill_ids, valid = mixed_batch(gen, dtype)
    loss_mask = torch.rand(rewards.numel(), 37, generator=gen) > 0.3  # 37 tokens: a partial token block
    before = LAUNCHES.copy()
    got = run(rewards, group_ids, roles, skill_ids, 12.5, std_normalize=std_normalize, valid=valid,
              loss_mask=loss_mask, tile=tile)
    assert LAUNCHES["grpo_advantage.forward"] == before["grpo_advantage.forward"] + 1
    assert LAUNCHES["grpo_advantage.crossing"] == before["grpo_advantage.crossing"] + (tile is not None)
    want = grpo_advantages(rewards.double(), group_ids, roles, skill_ids, 12.5, std_normalize=std_normalize,
                           valid=valid)
    assert got.samples.dtype == dtype and got.tokens.dtype == dtype
    # bf16: one unit in the last place (the interpreter truncates float32 -> bf16 where a GPU rounds to nearest)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2.0 ** -7}[dtype]
    torch.testing.assert_close(got.samples.double(), want, rtol=tol, atol=tol, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(got.tokens.double(), token_advantages(want, loss_mask), rtol=tol, atol=tol,
                               msg=lambda m: f"seed {seed}: {m}")
    assert (got.samples[~valid] == 0).all()
    if dtype != torch.bfloat16:  # the reference in the rewards' own dtype: the same values after the same rounding
        same = grpo_advantages(rewards, group_ids, roles, skill_ids, 12.5, std_normalize=std_normalize, valid=valid)
        torch.testing.assert_close(got.samples, same, rtol=tol, atol=tol, msg=lambda m: f"seed {seed}: {m}")


def test_gradient_matches_autograd_through_the_reference(gen) -> None:
    seed = gen.initial_seed()
    rewards, group_ids, roles, skill_ids, valid = mixed_batch(gen, torch.float64)
    loss_mask = torch.rand(rewards.numel(), 21, generator=gen) > 0.3
    w_samples = torch.randn(rewards.numel(), generator=gen, dtype=torch.float64)
    w_tokens = torch.randn(rewards.numel(), 21, generator=gen, dtype=torch.float64)
    leaf = rewards.clone().requires_grad_(True)
    before = LAUNCHES["grpo_advantage.backward"]
    got = run(leaf, group_ids, roles, skill_ids, 3.0, valid=valid, loss_mask=loss_mask)
    (grad,) = torch.autograd.grad((got.samples * w_samples).sum() + (got.tokens * w_tokens).sum(), leaf)
    assert LAUNCHES["grpo_advantage.backward"] == before + 1

    leaf = rewards.clone().requires_grad_(True)
    want = grpo_advantages(leaf, group_ids, roles, skill_ids, 3.0, valid=valid)
    (want_grad,) = torch.autograd.grad((want * w_samples).sum() + (token_advantages(want, loss_mask) * w_tokens).sum(),
                                       leaf)
    # groups of one and all-equal groups are constant 0 in the kernel; autograd of the reference is NaN or 0 there
    constant = got.samples.detach() == 0
    torch.testing.assert_close(grad[~constant], want_grad[~constant], rtol=1e-9, atol=1e-9,
                               msg=lambda m: f"seed {seed}: {m}")
    assert (grad[constant] == 0).all()


def test_empty_batches_and_groups_give_zeros_without_a_launch_for_nothing(gen) -> None:
    empty = torch.zeros(0)
    ids = torch.zeros(0, dtype=torch.long)
    before = LAUNCHES["grpo_advantage.forward"]
    out = run(empty, ids, ids, ids, 1.0, loss_mask=torch.zeros(0, 5, dtype=torch.bool))
    assert out.samples.shape == (0,) and out.tokens.shape == (0, 5)
    rewards = torch.randn(6, generator=gen)
    none_valid = run(rewards, torch.arange(6), torch.zeros(6, dtype=torch.long),
                                   torch.zeros(6, dtype=torch.long), 1.0, valid=torch.zeros(6, dtype=torch.bool),
                                   loss_mask=torch.ones(6, 3, dtype=torch.bool))
    assert (none_valid.samples == 0).all() and (none_valid.tokens == 0).all()
    assert LAUNCHES["grpo_advantage.forward"] == before  # nothing to normalise: no segment, no launch
    singles = run(rewards, torch.arange(6), torch.zeros(6, dtype=torch.long),
                                torch.zeros(6, dtype=torch.long), 1.0)
    assert LAUNCHES["grpo_advantage.forward"] == before + 1
    assert (singles.samples == 0).all() and not singles.samples.isnan().any()


@pytest.mark.parametrize("tile", [None, 16], ids=["one-tile", "16-sample-tiles"])
def test_results_are_deterministic(gen, tile) -> None:
    rewards, group_ids, roles, skill_ids, valid = mixed_batch(gen)
    runs = [run(rewards, group_ids, roles, skill_ids, 2.0, valid=valid, tile=tile).samples for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("role", [AGENT, DESIGNER], ids=["agent-group", "designer-skill"])
def test_a_segment_over_many_tiles_matches_and_equal_rewards_stay_zero(gen, role) -> None:
    """2,100 samples of one segment in 16-sample tiles: 132 tiles' shares, more than one combination step (128);
    then the same segment with all rewards equal gives exactly 0 although no tile sees the whole segment."""
    seed = gen.initial_seed()
    n = 2100
    rewards = torch.rand(n, generator=gen, dtype=torch.float64) * 3
    ids, roles = torch.zeros(n, dtype=torch.long), torch.full((n,), role)
    got = run(rewards, ids, roles, ids, 3.0, tile=16).samples
    torch.testing.assert_close(got, grpo_advantages(rewards, ids, roles, ids, 3.0), rtol=1e-12, atol=1e-12,
                               msg=lambda m: f"seed {seed}: {m}")
    flat = run(torch.full((n,), 0.3, dtype=torch.float64), ids, roles, ids, 3.0, tile=16).samples
    assert (flat == 0).all()


def test_ids_anywhere_in_int64_keep_their_groups_apart() -> None:
    """Group ids 5 and 5 - 2**63 (and skill ids 2**62 and -2**62 for the designer) are different groups, as in the
    reference: the sort key must not pack the role into the id's bits (2 * id wraps around for |id| >= 2**62)."""
    rewards = torch.tensor([0.0, 1.0, 2.0, 10.0, 20.0, 30.0] * 2, dtype=torch.float64)
    group_ids = torch.tensor([5] * 3 + [5 - 2**63] * 3 + [0] * 6)
    skill_ids = torch.tensor([0] * 6 + [2**62] * 3 + [-(2**62)] * 3)
    roles = torch.tensor([AGENT] * 6 + [DESIGNER] * 6)
    for tile in (None, 16):
        got = run(rewards, group_ids, roles, skill_ids, 2.0, tile=tile).samples
        torch.testing.assert_close(got, grpo_advantages(rewards, group_ids, roles, skill_ids, 2.0), rtol=1e-12,
                                   atol=1e-12)
        torch.testing.assert_close(got, torch.tensor([-1.0, 0.0, 1.0] * 2 + [-2.0, 0.0, 2.0, -20.0, 0.0, 20.0],
                                                     dtype=torch.float64), rtol=1e-5, atol=0)  # agents: / (1 + eps)


def test_groups_that_fill_whole_tiles_take_one_launch(gen) -> None:
    """Groups of 16 in 16-sample tiles: no segment crosses a tile edge, so the first launch is skipped; one invalid
    sample shifts every later group across an edge, and the first launch runs."""
    rewards = torch.randn(96, generator=gen, dtype=torch.float64)
    groups, roles = torch.arange(96) // 16, torch.zeros(96, dtype=torch.long)
    for valid, crossing in ((None, 0), (torch.arange(96) != 5, 1)):
        before = LAUNCHES.copy()
        got = run(rewards, groups, roles, roles, 1.0, valid=valid, tile=16).samples
        assert LAUNCHES["grpo_advantage.crossing"] - before["grpo_advantage.crossing"] == crossing
        assert LAUNCHES["grpo_advantage.forward"] - before["grpo_advantage.forward"] == 1
        torch.testing.assert_close(got, grpo_advantages(rewards, groups, roles, roles, 1.0, valid=valid),
                                   rtol=1e-12, atol=1e-12)


def test_tile_must_be_a_power_of_two() -> None:
    ids = torch.zeros(4, dtype=torch.long)
    for tile in (8, 48):
        with pytest.raises(ValueError, match="tile must be a power of two >= 16"):
            op.grpo_advantage(torch.zeros(4), ids, ids, ids, 1.0, tile=tile)


def test_reference_path_runs_no_kernel(gen) -> None:
    rewards, group_ids, roles, skill_ids, valid = mixed_batch(gen)
    before = LAUNCHES.copy()
    got = op.grpo_advantage(rewards, group_ids, roles, skill_ids, 2.0, valid=valid, use_kernels=False)
    assert LAUNCHES == before
    assert torch.equal(got.samples, grpo_advantages(rewards, group_ids, roles, skill_ids, 2.0, valid=valid))


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernel", "reference"])
def test_bad_inputs_are_refused_alike_on_both_paths(use_kernels) -> None:
    ids = torch.zeros(3, dtype=torch.long)
    cases = [
        ((torch.tensor([0.0, float("nan"), 1.0]), ids, ids, ids, 1.0), "finite"),
        ((torch.zeros(3), ids, torch.tensor([0, 2, 1]), ids, 1.0), "roles must be"),
        ((torch.zeros(3), ids, ids, ids, -1.0), "designer_scale"),
        ((torch.zeros(3), ids[:2], ids, ids, 1.0), "group_ids must have shape"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            run(*args, use_kernels=use_kernels)
