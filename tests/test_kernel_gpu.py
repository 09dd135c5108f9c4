"""The compiled kernels at the trainer's shapes on a CUDA GPU: Qwen3's vocabulary of 151,936 with the default vocab
blocks (the last one partial), and a million-sample advantage batch. Skipped without a GPU (conftest); the other
kernel tests check the same maths at small shapes, compiled here and interpreted on CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from spade_mega.config.schema import RLConfig
from spade_mega.kernels import grpo_advantage as adv_op
from spade_mega.kernels import tis_logprob as op
from spade_mega.kernels.dispatch import LAUNCHES
from spade_mega.rl.advantages import AGENT, DESIGNER, grpo_advantages
from spade_mega.rl.loss import policy_loss

pytestmark = pytest.mark.gpu
VOCAB, TEMPERATURE = 151_936, 0.6


@pytest.fixture
def seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str, seed: int,
                 scale: float | None = None) -> None:
    """Within ``tol`` relative to ``scale`` (default: the largest expected magnitude, as the CPU tests do); a mean
    of terms that cancel needs the size of its terms as ``scale``."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = scale if scale is not None else max(float(expected.abs().max()), 1e-3)
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale, msg=lambda m: f"{what} (seed {seed}): {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_tis_logprob_at_the_qwen3_vocabulary_matches_float64(seed: int, dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = 1024
    logits = (torch.randn(n, VOCAB, generator=g, device="cuda") * 3).to(dtype)
    tokens = torch.randint(0, VOCAB, (n,), generator=g, device="cuda")
    x = logits.double().requires_grad_(True)
    logp = torch.log_softmax(x / TEMPERATURE, dim=-1)
    lp = logp.gather(-1, tokens[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    old = (lp.detach() + 0.4 * torch.randn(n, generator=g, device="cuda", dtype=torch.float64)).float()
    rollout = old - 0.9 * torch.randn(n, generator=g, device="cuda")
    adv = torch.randn(n, generator=g, device="cuda")
    mask = torch.rand(n, generator=g, device="cuda") > 0.2

    leaf = logits.clone().requires_grad_(True)
    before = LAUNCHES.copy()
    res = op.tis_logprob(leaf, tokens, old, adv, rollout_logprobs=rollout, loss_mask=mask, temperature=TEMPERATURE,
                         with_entropy=True)
    assert LAUNCHES["tis_logprob.shard_stats"] == before["tis_logprob.shard_stats"] + 1
    assert LAUNCHES["tis_logprob.finalize"] == before["tis_logprob.finalize"] + 1
    # fp32 sums over 151,936 values, in 38 blocks
    assert_close(res.logprobs, torch.where(mask, lp, 0.0), 5e-5, "log-probs", seed)
    assert_close(res.entropy, torch.where(mask, ent, 0.0), 5e-5, "entropy", seed)
    assert (res.logprobs <= 0).all()

    want, _ = policy_loss(lp, old.double(), adv.double(), mask, RLConfig(), rollout_logprobs=rollout)
    got = res.loss.sum() / mask.sum()
    assert_close(got, want, 1e-5, "token-mean loss", seed, scale=float(adv.abs().mean()) + 1.0)
    (g_got,) = torch.autograd.grad(got, leaf)
    (g_want,) = torch.autograd.grad(want, x)
    assert LAUNCHES["tis_logprob.logits_grad"] == before["tis_logprob.logits_grad"] + 1
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the gradient is stored in bf16 (3 significant digits)
    assert_close(g_got, g_want, tol, "logits gradient", seed)


def test_grpo_advantage_on_a_million_samples_matches_rl_and_is_deterministic(seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = 1_000_000
    rewards = torch.rand(n, generator=g, device="cuda")
    designer = torch.rand(n, generator=g, device="cuda") < 0.1
    roles = torch.where(designer, DESIGNER, AGENT)
    group_ids = torch.arange(n, device="cuda") // 16
    skill_ids = torch.randint(0, 6, (n,), generator=g, device="cuda")
    before = LAUNCHES["grpo_advantage.forward"]
    runs = [adv_op.grpo_advantage(rewards, group_ids, roles, skill_ids, 12.0).samples for _ in range(2)]
    assert LAUNCHES["grpo_advantage.forward"] == before + 2
    assert torch.equal(runs[0], runs[1]), "two launches on the same batch disagree"
    want = grpo_advantages(rewards.double(), group_ids, roles, skill_ids, 12.0)
    assert_close(runs[0], want, 1e-5, "per-sample advantages", seed)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_kernels_launch_on_their_tensors_device_not_the_current_one(seed: int) -> None:
    """A rank whose current CUDA device is not its tensors' (a process driving two GPUs): each launch goes to the
    tensors' GPU (Triton launches on the current one, which read cuda:1 memory from cuda:0)."""
    g = torch.Generator(device="cuda:1").manual_seed(seed)
    logits = torch.randn(64, 1000, generator=g, device="cuda:1")
    tokens = torch.randint(0, 1000, (64,), generator=g, device="cuda:1")
    rewards = torch.rand(64, generator=g, device="cuda:1")
    ids = torch.arange(64, device="cuda:1") // 8
    roles = torch.full((64,), AGENT, device="cuda:1")
    with torch.cuda.device(0):
        before = LAUNCHES.copy()
        res = op.tis_logprob(logits, tokens, temperature=TEMPERATURE)
        adv = adv_op.grpo_advantage(rewards, ids, roles, ids, 1.0).samples
        torch.cuda.synchronize(1)
    assert LAUNCHES["tis_logprob.shard_stats"] == before["tis_logprob.shard_stats"] + 1
    assert LAUNCHES["grpo_advantage.forward"] == before["grpo_advantage.forward"] + 1
    want = torch.log_softmax(logits.double() / TEMPERATURE, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    assert_close(res.logprobs, want, 5e-5, "log-probs on cuda:1", seed)
    assert_close(adv, grpo_advantages(rewards.double(), ids, roles, ids, 1.0), 1e-5, "advantages on cuda:1", seed)
