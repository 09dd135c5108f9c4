"""The fused log-prob / entropy / PPO-clip / TIS op against a float64 truth built on ``rl.loss.policy_loss``.

Kernels run compiled on a GPU when there is one and under the Triton interpreter on CPU otherwise (see
kernel_support); every test that claims the kernel ran checks the launch counter. Inputs are fresh random draws each run; the seed is in every failure message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from spade_mega.config.schema import RLConfig
from spade_mega.kernels import tis_logprob as op
from spade_mega.kernels.dispatch import LAUNCHES
from spade_mega.rl.loss import policy_loss
from kernel_support import to_cpu, to_kernel_device

STAGES = ("tis_logprob.shard_stats", "tis_logprob.finalize", "tis_logprob.logits_grad")
TEMPERATURE = 0.7
BLOCK_V = 128  # small vocab blocks so that a vocab of a few hundred spans several, the last one partial


@pytest.fixture
def gen() -> torch.Generator:
    """A generator seeded afresh each run; ``initial_seed()`` reproduces a failure."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


@dataclass
class Batch:
    logits: torch.Tensor
    tokens: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    rollout: torch.Tensor
    mask: torch.Tensor


def truth_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = TEMPERATURE):
    """Float64 log-prob and entropy of the tempered policy, from a full log-softmax (graph attached to ``x``)."""
    x = logits.detach().double().requires_grad_(True)
    logp = torch.log_softmax(x / temperature, dim=-1)
    lp = logp.gather(-1, tokens.clamp(0, x.shape[-1] - 1)[..., None]).squeeze(-1)
    ent = -(logp.exp() * torch.where(logp > -torch.inf, logp, 0.0)).sum(-1)
    return x, lp, ent


def make_batch(gen: torch.Generator, n_tokens: int, vocab: int, dtype: torch.dtype, scale: float = 3.0) -> Batch:
    logits = (torch.randn(n_tokens, vocab, generator=gen) * scale).to(dtype)
    tokens = torch.randint(0, vocab, (n_tokens,), generator=gen)
    _, lp, _ = truth_logprobs(logits, tokens)
    # old log-probs near the current ones (ratios straddle the clip range) and rollout log-probs further off (some TIS
    # weights truncated at tis_clip)
    old = (lp.detach() + 0.4 * torch.randn(n_tokens, generator=gen, dtype=torch.float64)).float()
    rollout = old - 0.9 * torch.randn(n_tokens, generator=gen)
    adv = torch.randn(n_tokens, generator=gen)
    mask = torch.rand(n_tokens, generator=gen) > 0.25
    mask[0] = True
    return Batch(logits, tokens, old, adv, rollout, mask)


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float, seed: int, what: str,
          scale: Optional[float] = None) -> None:
    """Close within ``tol`` relative to ``scale`` (default: the largest expected magnitude); a sum that cancels
    needs the magnitude of its terms as ``scale``."""
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    scale = scale if scale is not None else float(expected.abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * max(scale, 1e-3),
                               msg=lambda m: f"{what} (seed {seed}): {m}")


def run_op(b: Batch, *, with_rollout: bool, with_entropy: bool, use_kernels: bool = True, logits=None):
    """The op on the kernel device; the leaf it returns lives there, the result comes back to CPU."""
    logits = to_kernel_device(b.logits if logits is None else logits).detach().clone().requires_grad_(True)
    tokens, old, adv, rollout, mask = to_kernel_device((b.tokens, b.old, b.adv, b.rollout, b.mask))
    res = op.tis_logprob(logits, tokens, old, adv, rollout_logprobs=rollout if with_rollout else None,
                         loss_mask=mask, temperature=TEMPERATURE, with_entropy=with_entropy,
                         use_kernels=use_kernels, block_v=BLOCK_V)
    return logits, to_cpu(res)


def grad_of(loss: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, leaf, retain_graph=True)
    return g.cpu()


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_rollout,with_entropy", [(True, True), (False, False)], ids=["tis+entropy", "plain"])
def test_matches_policy_loss_in_float64(gen, dtype, with_rollout, with_entropy, use_kernels) -> None:
    seed = gen.initial_seed()
    b = make_batch(gen, n_tokens=20, vocab=300, dtype=dtype)
    rollout = b.rollout if with_rollout else None
    cfg = RLConfig(entropy_coef=0.05 if with_entropy else 0.0)
    before = LAUNCHES.copy()
    logits, res = run_op(b, with_rollout=with_rollout, with_entropy=with_entropy, use_kernels=use_kernels)
    tol = 2e-5 if dtype == torch.float32 else 1.5e-2  # bf16: the logits gradient is stored in bf16

    x, lp, ent = truth_logprobs(b.logits, b.tokens)
    m = b.mask
    close(res.logprobs, torch.where(m, lp, 0.0), 2e-5, seed, "log-probs")
    if with_entropy:
        close(res.entropy, torch.where(m, ent, 0.0), 2e-5, seed, "entropy")
    else:
        assert res.entropy is None

    # 1. log-probs (and entropy) from the op, everything else by policy_loss: the training loss path
    want, want_metrics = policy_loss(lp, b.old.double(), b.adv.double(), m, cfg, rollout_logprobs=rollout,
                                     entropy=ent if with_entropy else None)
    got, got_metrics = policy_loss(res.logprobs, b.old, b.adv, m, cfg, rollout_logprobs=rollout, entropy=res.entropy)
    terms = float(b.adv.abs().mean()) + 1.0  # the loss is a mean of terms of about this size that partly cancel
    close(got, want, 2e-5, seed, "policy_loss on the op's log-probs", scale=terms)
    for key, value in want_metrics.items():
        close(got_metrics[key], value, 1e-4, seed, f"metric {key}", scale=terms)
    close(grad_of(got, logits), grad_of(want, x), tol, seed, "logits gradient through policy_loss")

    # 2. the fused per-token loss: each token against policy_loss on that token alone, the mean with its gradient
    pg_cfg = RLConfig()
    for t in range(len(m)):
        only = torch.zeros_like(m)
        only[t] = True
        one, _ = policy_loss(lp.detach(), b.old.double(), b.adv.double(), only & m, pg_cfg, rollout_logprobs=rollout)
        close(res.loss[t], one, 2e-5, seed, f"per-token loss {t}", scale=terms)
    x, lp, _ = truth_logprobs(b.logits, b.tokens)
    want, _ = policy_loss(lp, b.old.double(), b.adv.double(), m, pg_cfg, rollout_logprobs=rollout)
    got = res.loss.sum() / m.sum()
    close(got, want, 2e-5, seed, "fused token-mean loss", scale=terms)
    close(grad_of(got, logits), grad_of(want, x), tol, seed, "logits gradient of the fused loss")

    ran = {stage: LAUNCHES[stage] - before[stage] for stage in STAGES}
    assert ran == {stage: (2 if use_kernels else 0) if stage.endswith("grad") else (1 if use_kernels else 0)
                   for stage in STAGES}


def test_extreme_logits_padding_and_a_single_token(gen) -> None:
    """Logits of magnitude 1e4, -inf vocab padding (a whole block of it), a one-hot row, a uniform row, one token."""
    seed = gen.initial_seed()
    vocab = 300
    b = make_batch(gen, n_tokens=6, vocab=vocab, dtype=torch.float32, scale=1e4)
    b.logits[:, 130:260] = -torch.inf  # padding: block 2 entirely -inf, blocks 1 and 3 partly
    b.logits[1] = 0.0  # uniform
    b.logits[2] = -torch.inf
    b.logits[2, 299] = 5.0  # the only finite value sits in the last, partial block
    b.tokens[2] = 299
    b.tokens[b.tokens.clamp(130, 259) == b.tokens] = 7
    b.mask[:] = True
    x, lp, ent = truth_logprobs(b.logits, b.tokens)
    b.old = (lp.detach() + 0.1).float()
    for rows in (slice(None), slice(3, 4)):  # the whole batch, then a single token
        sub = Batch(*(t[rows] for t in (b.logits, b.tokens, b.old, b.adv, b.rollout, b.mask)))
        before = LAUNCHES["tis_logprob.shard_stats"]
        logits, res = run_op(sub, with_rollout=True, with_entropy=True)
        assert LAUNCHES["tis_logprob.shard_stats"] == before + 1
        x, lp, ent = truth_logprobs(sub.logits, sub.tokens)
        assert torch.isfinite(res.logprobs).all() and torch.isfinite(res.entropy).all()
        assert (res.logprobs <= 0).all() and (res.entropy >= 0).all()  # never a positive log-prob (verl's bug)
        tol = 1e-6 * 1e4 / TEMPERATURE  # fp32 rounding of logits / temperature at this magnitude
        close(res.logprobs, lp, tol, seed, "log-probs")
        close(res.entropy, ent, tol, seed, "entropy")
        cfg = RLConfig(entropy_coef=0.05)
        want, _ = policy_loss(lp, sub.old.double(), sub.adv.double(), sub.mask, cfg, entropy=ent,
                              rollout_logprobs=sub.rollout)
        got, _ = policy_loss(res.logprobs, sub.old, sub.adv, sub.mask, cfg, entropy=res.entropy,
                             rollout_logprobs=sub.rollout)
        g = grad_of(got, logits)
        assert torch.isfinite(g).all()
        # fp32 logits / temperature are off by ~1e-3 at this magnitude, so near-tied probabilities are off by ~1e-3
        close(g, grad_of(want, x), 1e-2, seed, "logits gradient")


def test_masked_tokens_are_not_read_and_get_zero_gradient(gen) -> None:
    seed = gen.initial_seed()
    b = make_batch(gen, n_tokens=12, vocab=200, dtype=torch.float32)
    b.mask[[3, 7, 8]] = False
    poisoned = b.logits.clone()
    poisoned[~b.mask] = torch.nan  # a masked row is never read, so NaN there cannot leak
    b.tokens[~b.mask] = -100  # an ignore index: out of range, masked
    logits, res = run_op(b, with_rollout=True, with_entropy=True, logits=poisoned)
    outputs = torch.stack([res.loss, res.logprobs, res.entropy])
    assert torch.isfinite(outputs).all() and (outputs[:, ~b.mask] == 0).all()
    g = grad_of(res.loss.sum() + res.logprobs.sum() + res.entropy.sum(), logits)
    assert torch.isfinite(g).all() and (g[~b.mask] == 0).all()
    x, lp, _ = truth_logprobs(b.logits, b.tokens)
    close(res.logprobs[b.mask], lp[b.mask], 2e-5, seed, "log-probs of the unmasked tokens")


def test_simulated_vocab_parallel_split_matches_the_whole_vocab(gen) -> None:
    """Three shards, one all -inf (padding) and one without any sampled token, combined between the passes."""
    seed = gen.initial_seed()
    b = make_batch(gen, n_tokens=10, vocab=500, dtype=torch.bfloat16)
    b.logits[:, 450:] = -torch.inf
    b.tokens = b.tokens % 300  # every sampled token lies in the first two shards
    bounds = [(0, 170), (170, 450), (450, 500)]
    shards = [to_kernel_device(b.logits[:, lo:hi].contiguous()) for lo, hi in bounds]
    tokens, old, adv, rollout, mask = to_kernel_device((b.tokens, b.old, b.adv, b.rollout, b.mask))
    before = LAUNCHES.copy()
    stats = torch.stack([op.shard_stats(s, tokens, mask, lo, TEMPERATURE, True, block_v=BLOCK_V)
                         for s, (lo, _) in zip(shards, bounds)])
    out = op.finalize(stats, old, adv, rollout, mask, 0.2, 0.28, 0.0, 2.0, True)
    x, lp, ent = truth_logprobs(b.logits, b.tokens)
    close(out.logprobs, torch.where(b.mask, lp, 0.0), 2e-5, seed, "log-probs")
    close(out.entropy, torch.where(b.mask, ent, 0.0), 2e-5, seed, "entropy")

    coef_lp = torch.where(b.mask, torch.randn(10, generator=gen), 0.0)
    coef_ent = torch.where(b.mask, torch.randn(10, generator=gen), 0.0)
    coefs = to_kernel_device((coef_lp, coef_ent))
    grad = torch.cat([op.logits_grad(s, tokens, out.lse, out.entropy, *coefs, lo, TEMPERATURE, block_v=BLOCK_V)
                      for s, (lo, _) in zip(shards, bounds)], dim=1)
    want = grad_of((coef_lp.double() * lp + coef_ent.double() * torch.where(b.mask, ent, 0.0)).sum(), x)
    close(grad, want, 1.5e-2, seed, "logits gradient, shard by shard")
    assert LAUNCHES["tis_logprob.shard_stats"] - before["tis_logprob.shard_stats"] == 3
    assert LAUNCHES["tis_logprob.logits_grad"] - before["tis_logprob.logits_grad"] == 3


def test_bad_arguments_are_named() -> None:
    logits, tokens = torch.zeros(4, 10), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature"):
        op.tis_logprob(logits, tokens, temperature=0.0)
    with pytest.raises(ValueError, match="disagree"):
        op.tis_logprob(logits, tokens[:3])
    with pytest.raises(ValueError, match="go together"):
        op.tis_logprob(logits, tokens, torch.zeros(4))
    with pytest.raises(ValueError, match="advantages has shape"):
        op.tis_logprob(logits, tokens, torch.zeros(4), torch.zeros(5))
    old, adv = torch.zeros(4), torch.zeros(4)
    for bad, name in ((dict(tis_clip=0.0), "tis_clip"), (dict(tis_clip_low=3.0), "tis_clip_low"),
                      (dict(eps_clip_low=1.0), "eps_clip_low"), (dict(eps_clip_high=-0.1), "eps_clip_high")):
        with pytest.raises(ValueError, match=name):
            op.tis_logprob(logits, tokens, old, adv, rollout_logprobs=old, **bad)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernel", "reference"])
def test_double_backward_is_refused_not_silently_wrong(gen, use_kernels) -> None:
    """The backward is written by hand and is not itself differentiable: a second derivative (a gradient penalty,
    a Hessian-vector product) must fail loudly rather than come out zero (kernel) or wrong (reference)."""
    b = make_batch(gen, n_tokens=4, vocab=40, dtype=torch.float32)
    logits, res = run_op(b, with_rollout=True, with_entropy=True, use_kernels=use_kernels)
    (g,) = torch.autograd.grad(res.loss.sum() + res.entropy.sum(), logits, create_graph=True)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad((g * g).sum(), logits)
