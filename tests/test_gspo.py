"""GSPO (rl.policy_loss gspo): policy_loss against float64 references written from the paper's formulas (loss and
gradients with respect to log-probs and logits), sequence-level clipping on both sides, its metrics, equality with
PPO on one-token samples, context-parallel shards, the fused log-prob kernels, and the config's refusals."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from spade_mega.config import ConfigError, load_config
from spade_mega.config.schema import KernelsConfig, RLConfig
from spade_mega.kernels import grpo
from spade_mega.kernels.dispatch import LAUNCHES
from spade_mega.rl.loss import policy_loss
from kernel_support import to_cpu, to_kernel_device

GSPO = RLConfig(policy_loss="gspo", loss_aggregation="seq-mean-token-mean", eps_clip_low=3e-4, eps_clip_high=4e-4)
VOCAB = 50
# per sample: its mean log-ratio (current - old) and the sign of its advantage; lengths (loss tokens among them).
# Above 1 + 4e-4 with A > 0 and below 1 - 3e-4 with A < 0: clipped (no gradient); above with A < 0 and below with
# A > 0: the unclipped branch; inside the range: unclipped. A one-token sample and one without loss tokens.
PLAN = [(1e-3, +1), (-1e-3, -1), (1e-3, -1), (-1e-3, +1), (1e-4, +1), (-2e-4, -1), (5e-4, +1), (0.0, -1)]
LENGTHS = [9, 7, 12, 5, 8, 10, 1, 6]
CLIPPED = [True, True, False, False, False, False, True, False]  # sample 6 (one token) clips above; 7 has no tokens


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def batch(seed: int) -> dict:
    """[samples, tokens] logits, sampled tokens, loss mask, old log-probs placing each sample's mean log-ratio as PLAN
    says (around it, per-token noise of 0.05), per-sample advantages of PLAN's signs, rollout log-probs."""
    g = torch.Generator().manual_seed(seed)
    rows, width = len(PLAN), max(LENGTHS)
    logits = torch.randn(rows, width, VOCAB, generator=g, dtype=torch.float64) * 2
    tokens = torch.randint(0, VOCAB, (rows, width), generator=g)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = torch.rand(n, generator=g) > 0.25
        mask[i, n - 1] = True  # at least one loss token, and the one-token sample's only token
    mask[7] = False  # sample 7: no loss token at all
    lp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    noise = 0.05 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    noise = torch.where(mask, noise, 0.0)
    noise = noise - torch.where(mask, noise.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1), 0.0)
    shift = torch.tensor([d for d, _ in PLAN], dtype=torch.float64)[:, None]
    old = lp.detach() - shift - noise  # mean over a sample's loss tokens of lp - old = its PLAN shift
    size = 0.5 + torch.rand(rows, 1, generator=g, dtype=torch.float64)
    adv = (torch.tensor([a for _, a in PLAN], dtype=torch.float64)[:, None] * size).expand(rows, width).clone()
    rollout = old + 0.2 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    return dict(logits=logits, tokens=tokens, mask=mask, old=old, adv=adv, rollout=rollout)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)


def paper_gspo(lp, old, adv, mask, cfg: RLConfig, seq_weights=None) -> torch.Tensor:
    """GSPO's objective as the paper writes it (sequence level), negated: over the G samples with a loss token,
    -1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i), s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|),
    the gradient flowing through s_i itself; each sample's term times its sequence-level IS weight when given."""
    terms = []
    for i in range(lp.shape[0]):
        m = mask[i]
        if not m.any():
            continue
        s = torch.exp((lp[i][m] - old[i][m]).mean())
        a = adv[i][m][0]
        term = -torch.minimum(s * a, s.clamp(1 - cfg.eps_clip_low, 1 + cfg.eps_clip_high) * a)
        terms.append(term if seq_weights is None else term * seq_weights[i])
    return torch.stack(terms).mean()


def gspo_token(lp, old, adv, mask, cfg: RLConfig, token_weights: torch.Tensor) -> torch.Tensor:
    """The paper's GSPO-token form, token by token: s_i,t = sg[s_i] pi(y_i,t) / sg[pi(y_i,t)], each token's clipped
    term times its token-level IS weight (verl's and slime's placement), token mean per sample, mean over samples."""
    terms = []
    for i in range(lp.shape[0]):
        idx = mask[i].nonzero().flatten().tolist()
        if not idx:
            continue
        s_i = torch.exp(sum(lp[i, t] - old[i, t] for t in idx) / len(idx)).detach()
        per_token = []
        for t in idx:
            s = s_i * torch.exp(lp[i, t] - lp[i, t].detach())
            clipped = s.clamp(1 - cfg.eps_clip_low, 1 + cfg.eps_clip_high)
            per_token.append(-torch.minimum(s * adv[i, t], clipped * adv[i, t]) * token_weights[i, t])
        terms.append(sum(per_token) / len(idx))
    return sum(terms) / len(terms)


def truncated(log_w: torch.Tensor, cfg: RLConfig) -> torch.Tensor:
    return torch.exp(log_w).clamp(cfg.tis_clip_low, cfg.tis_clip)


@pytest.mark.parametrize("tis", [None, "sequence", "token"])
def test_gspo_loss_and_gradients_match_the_papers_formula(tis) -> None:
    """Loss and gradients (with respect to the log-probs and to the logits) equal the float64 reference; without IS
    weights and with sequence-level ones it is the sequence-level formula itself (gradient through s_i), with
    token-level ones the GSPO-token form with each token weighted."""
    b = batch(fresh_seed())
    cfg = replace(GSPO, tis_level=tis or "token")
    mask, old, adv = b["mask"], b["old"], b["adv"]
    logits = b["logits"].clone().requires_grad_(True)
    lp = logprobs_of(logits, b["tokens"])
    lp_leaf = lp.detach().clone().requires_grad_(True)
    rollout = b["rollout"] if tis else None
    loss, metrics = policy_loss(lp_leaf, old, adv, mask, cfg, rollout_logprobs=rollout)
    (grad_lp,) = torch.autograd.grad(loss, lp_leaf)
    (grad_logits,) = torch.autograd.grad(policy_loss(lp, old, adv, mask, cfg, rollout_logprobs=rollout)[0], logits)

    ref_lp = lp.detach().clone().requires_grad_(True)
    log_w = torch.where(mask, old - b["rollout"], 0.0)
    if tis == "token":
        want = gspo_token(ref_lp, old, adv, mask, cfg, truncated(log_w, cfg))
    else:
        want = paper_gspo(ref_lp, old, adv, mask, cfg,
                          truncated(log_w.sum(1), cfg) if tis == "sequence" else None)
    (want_grad_lp,) = torch.autograd.grad(want, ref_lp)
    ref_logits = b["logits"].clone().requires_grad_(True)
    lp_ref = logprobs_of(ref_logits, b["tokens"])
    if tis == "token":
        again = gspo_token(lp_ref, old, adv, mask, cfg, truncated(log_w, cfg))
    else:
        again = paper_gspo(lp_ref, old, adv, mask, cfg, truncated(log_w.sum(1), cfg) if tis == "sequence" else None)
    (want_grad_logits,) = torch.autograd.grad(again, ref_logits)

    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_lp, want_grad_lp, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(grad_logits, want_grad_logits, rtol=1e-10, atol=1e-14)
    assert torch.count_nonzero(grad_lp[~mask]) == 0  # off the mask, and the sample without loss tokens
    for i, clipped in enumerate(CLIPPED):  # a clipped sample gets no gradient at all, the others on every token
        tokens = mask[i]
        assert (grad_lp[i][tokens] == 0).all() == clipped or not tokens.any(), f"sample {i}"
        assert (grad_lp[i][tokens] != 0).all() or clipped or not tokens.any(), f"sample {i}"
    assert metrics["seq_clip_frac"].item() == pytest.approx(3 / 7)  # samples 0, 1, 6 of the 7 with loss tokens
    assert metrics["num_sequences"].item() == pytest.approx(7)
    tokens_clipped = sum(int(mask[i].sum()) for i, c in enumerate(CLIPPED) if c)
    assert metrics["clip_frac"].item() == pytest.approx(tokens_clipped / int(mask.sum()))
    token_log_ratio = torch.where(mask, lp.detach() - old, 0.0)  # approx_kl stays the per-token k3 estimate
    k3 = (torch.exp(token_log_ratio) - 1 - token_log_ratio)[mask].mean()
    assert metrics["approx_kl"].item() == pytest.approx(k3.item(), rel=1e-10)


def test_each_tokens_gradient_is_the_sequence_ratio_times_its_log_prob_gradient_over_the_length() -> None:
    """d loss / d logprob_t = -s_i A_i / (|y_i| G) for every loss token of an unclipped sample (GSPO's equal token
    weighting inside a sample), 0 elsewhere."""
    b = batch(fresh_seed())
    mask, old, adv = b["mask"], b["old"], b["adv"]
    lp = logprobs_of(b["logits"], b["tokens"]).detach().requires_grad_(True)
    loss, _ = policy_loss(lp, old, adv, mask, GSPO)
    loss.backward()
    samples = int(mask.any(1).sum())
    for i, clipped in enumerate(CLIPPED):
        if clipped or not mask[i].any():
            continue
        m = mask[i]
        s = torch.exp((lp[i][m] - old[i][m]).mean()).detach()
        want = -s * adv[i][m] / (int(m.sum()) * samples)
        torch.testing.assert_close(lp.grad[i][m], want, rtol=1e-12, atol=0.0)


def test_masked_positions_may_hold_anything_and_packed_equals_rows() -> None:
    """Garbage (NaN, -inf) off the mask changes nothing and gets zero gradient; the packed layout with sample ids
    gives the [samples, tokens] result (what the trainer passes)."""
    b = batch(fresh_seed())
    mask, old, adv = b["mask"], b["old"], b["adv"]
    lp0 = logprobs_of(b["logits"], b["tokens"]).detach()
    clean_lp = lp0.clone().requires_grad_(True)
    want, want_m = policy_loss(clean_lp, old, adv, mask, GSPO, rollout_logprobs=b["rollout"])
    want.backward()
    junk = torch.full_like(lp0, float("nan"))
    dirty_lp = torch.where(mask, lp0, float("-inf")).requires_grad_(True)
    got, got_m = policy_loss(dirty_lp, torch.where(mask, old, junk), torch.where(mask, adv, junk), mask, GSPO,
                             rollout_logprobs=torch.where(mask, b["rollout"], junk))
    got.backward()
    assert torch.equal(got, want) and torch.equal(dirty_lp.grad, clean_lp.grad)
    packed_lp = lp0.flatten().clone().requires_grad_(True)
    ids = torch.arange(len(PLAN)).repeat_interleave(lp0.shape[1])
    packed, packed_m = policy_loss(packed_lp, old.flatten(), adv.flatten(), mask.flatten(), GSPO,
                                   rollout_logprobs=b["rollout"].flatten(), sample_ids=ids)
    packed.backward()
    torch.testing.assert_close(packed, want, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(packed_lp.grad, clean_lp.grad.flatten(), rtol=1e-12, atol=0.0)
    for key in ("seq_clip_frac", "num_sequences", "clip_frac", "pg_loss", "tis_ratio_mean"):
        assert packed_m[key].item() == pytest.approx(want_m[key].item()) == pytest.approx(got_m[key].item())


@pytest.mark.parametrize("tis_level", ["token", "sequence"])
def test_one_token_samples_make_gspo_ppo(tis_level: str) -> None:
    """With one loss token per sample the sequence ratio is the token ratio: GSPO's loss, gradient and clip
    fraction are PPO's (with the same clip range), under seq-mean-token-mean and token-mean alike (one token per
    sample: the same normaliser)."""
    g = torch.Generator().manual_seed(fresh_seed())
    n = 12
    lp = (-3 + torch.randn(n, 1, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = lp.detach() + 1e-3 * torch.randn(n, 1, generator=g, dtype=torch.float64)
    adv, mask = torch.randn(n, 1, generator=g, dtype=torch.float64), torch.ones(n, 1, dtype=torch.bool)
    # whatever the seed, one sample clips (ratio e^1e-3 above 1 + 4e-4, A > 0) and one trains (ratio 1): left to the
    # draw, all 12 stayed inside the range for ~1 seed in 330
    old[0], old[1], adv[:2] = lp.detach()[0] - 1e-3, lp.detach()[1], 1.0
    rollout = old + 0.3 * torch.randn(n, 1, generator=g, dtype=torch.float64)
    cfg = replace(GSPO, tis_level=tis_level)
    gspo, gspo_m = policy_loss(lp, old, adv, mask, cfg, rollout_logprobs=rollout)
    (gspo_grad,) = torch.autograd.grad(gspo, lp)
    assert 0 < gspo_m["clip_frac"].item() < 1
    assert gspo_m["seq_clip_frac"].item() == pytest.approx(gspo_m["clip_frac"].item())
    for aggregation in ("seq-mean-token-mean", "token-mean"):
        ppo_cfg = replace(cfg, policy_loss="ppo", loss_aggregation=aggregation)
        ppo, ppo_m = policy_loss(lp, old, adv, mask, ppo_cfg, rollout_logprobs=rollout)
        (ppo_grad,) = torch.autograd.grad(ppo, lp)
        torch.testing.assert_close(gspo, ppo, rtol=1e-12, atol=0.0)
        torch.testing.assert_close(gspo_grad, ppo_grad, rtol=1e-12, atol=0.0)
        for key in ("pg_loss", "clip_frac", "approx_kl"):
            assert gspo_m[key].item() == pytest.approx(ppo_m[key].item(), rel=1e-12)


def test_on_policy_gspo_is_ppo_with_seq_mean_token_mean() -> None:
    """At a rollout's first optimizer step the old log-probs are the current ones: every ratio is 1 inside both clip
    ranges, and GSPO's loss and gradient are PPO's under the same aggregation (the losses part from the second
    step on, docs/megatron.md)."""
    b = batch(fresh_seed())
    lp = logprobs_of(b["logits"], b["tokens"]).detach().requires_grad_(True)
    old, adv, mask = lp.detach().clone(), b["adv"], b["mask"]
    gspo, _ = policy_loss(lp, old, adv, mask, GSPO, rollout_logprobs=b["rollout"])
    ppo, _ = policy_loss(lp, old, adv, mask, replace(GSPO, policy_loss="ppo"), rollout_logprobs=b["rollout"])
    torch.testing.assert_close(gspo, ppo, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(torch.autograd.grad(gspo, lp)[0], torch.autograd.grad(ppo, lp)[0], rtol=1e-12,
                               atol=0.0)


def test_longer_samples_differ_from_ppo() -> None:
    """The same inputs under PPO give another loss (its per-token ratios clip token by token): GSPO is not a
    renaming of PPO with seq-mean-token-mean."""
    b = batch(fresh_seed())
    lp = logprobs_of(b["logits"], b["tokens"])
    gspo, _ = policy_loss(lp, b["old"], b["adv"], b["mask"], GSPO)
    ppo, _ = policy_loss(lp, b["old"], b["adv"], b["mask"], replace(GSPO, policy_loss="ppo"))
    assert abs(gspo.item() - ppo.item()) > 1e-6


def test_context_parallel_shards_total_the_sequence_mean_over_the_group() -> None:
    """A packed row split into two interleaved shards (as CP ranks hold it), run at once in two threads whose
    ``sample_sums`` all-reduce over the whole row as Trainer._sample_sums does: the shards' losses add up to the
    whole row's, their gradients are its gradient, their sample counts add up to whole samples and the combined
    sample clip fraction is the row's. Without the sums a shard's sequence mean is its own tokens' (another loss)."""
    b = batch(fresh_seed())
    lp0 = logprobs_of(b["logits"], b["tokens"]).detach().flatten()
    ids = torch.arange(len(PLAN)).repeat_interleave(b["mask"].shape[1])
    old, adv, mask, rollout = (b[k].flatten() for k in ("old", "adv", "mask", "rollout"))
    cfg = replace(GSPO, tis_level="sequence")
    normalizer = float(b["mask"].any(1).sum())
    whole_lp = lp0.clone().requires_grad_(True)
    whole, whole_m = policy_loss(whole_lp, old, adv, mask, cfg, rollout_logprobs=rollout, sample_ids=ids,
                                 normalizer=normalizer)
    whole.backward()

    positions = torch.arange(len(lp0))
    shards = [positions[(positions // 2) % 2 == r] for r in range(2)]  # chunks of 2 tokens, alternating ranks
    barrier = threading.Barrier(2, timeout=30)
    rows = [torch.zeros(len(lp0), dtype=torch.float64) for _ in shards]

    def run(rank: int, with_rollout: bool = True) -> tuple:
        index = shards[rank]

        def sample_sums(values: torch.Tensor) -> torch.Tensor:  # an all-reduce of the row over the two shards
            rows[rank] = torch.zeros(len(lp0), dtype=values.dtype).index_copy(0, index, values.detach())
            barrier.wait()
            row = rows[0] + rows[1]
            barrier.wait()
            return torch.zeros(len(PLAN), dtype=row.dtype).index_add(0, ids, row)[ids[index]]

        shard_lp = lp0[index].clone().requires_grad_(True)
        loss, m = policy_loss(shard_lp, old[index], adv[index], mask[index], cfg,
                              rollout_logprobs=rollout[index] if with_rollout else None, sample_ids=ids[index],
                              normalizer=normalizer, sample_sums=sample_sums)
        loss.backward()
        return loss.item(), shard_lp.grad, m

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, range(2)))
    grads = torch.zeros_like(lp0)
    for index, (_, grad, _) in zip(shards, results):
        grads[index] = grad
    assert sum(r[0] for r in results) == pytest.approx(whole.item(), rel=1e-12)
    torch.testing.assert_close(grads, whole_lp.grad, rtol=1e-10, atol=1e-16)
    counts = [r[2]["num_sequences"].item() for r in results]
    assert sum(counts) == pytest.approx(whole_m["num_sequences"].item()) == pytest.approx(7)
    clipped = sum(c * r[2]["seq_clip_frac"].item() for c, r in zip(counts, results))
    assert clipped / sum(counts) == pytest.approx(whole_m["seq_clip_frac"].item())

    with ThreadPoolExecutor(2) as pool:  # no IS weights: only GSPO's sequence mean needs the other shard
        summed = list(pool.map(run, range(2), [False, False]))
    first = shards[0]
    alone, _ = policy_loss(lp0[first], old[first], adv[first], mask[first], cfg, sample_ids=ids[first],
                           normalizer=normalizer)
    assert abs(alone.item() - summed[0][0]) > 1e-9


def test_policy_loss_refuses_gspo_with_another_aggregation() -> None:
    b = batch(fresh_seed())
    lp = logprobs_of(b["logits"], b["tokens"])
    for aggregation in ("token-mean", "seq-mean-token-sum"):
        with pytest.raises(ValueError, match=r"rl.policy_loss 'gspo' needs rl.loss_aggregation "
                                             rf"'seq-mean-token-mean'.*got '{aggregation}'"):
            policy_loss(lp, b["old"], b["adv"], b["mask"], replace(GSPO, loss_aggregation=aggregation))
    with pytest.raises(ValueError, match=r"rl.policy_loss must be one of \('ppo', 'gspo'\), got 'grpo'"):
        policy_loss(lp, b["old"], b["adv"], b["mask"], replace(GSPO, policy_loss="grpo"))


def test_the_config_refuses_gspo_with_ppos_aggregation_or_clip_defaults() -> None:
    """GSPO's config: seq-mean-token-mean and clip ranges of its own are required, each refusal naming the key and
    what to set; the paper's settings load; ppo stays the default."""
    assert load_config(None, []).rl.policy_loss == "ppo"
    paper = ["rl.policy_loss=gspo", "rl.loss_aggregation=seq-mean-token-mean", "rl.eps_clip_low=3e-4",
             "rl.eps_clip_high=4e-4"]
    cfg = load_config(None, paper).rl
    assert (cfg.policy_loss, cfg.eps_clip_low, cfg.eps_clip_high) == ("gspo", 3e-4, 4e-4)
    with pytest.raises(ConfigError, match="must be seq-mean-token-mean with rl.policy_loss gspo") as err:
        load_config(None, paper[:1] + paper[2:])
    assert err.value.path == "rl.loss_aggregation"
    with pytest.raises(ConfigError, match=r"left at the PPO default 0.2 .*rl.eps_clip_low 3e-4 and rl.eps_clip_high "
                                          "4e-4") as err:
        load_config(None, paper[:2])
    assert err.value.path == "rl.eps_clip_low"
    # one bound set, the other forgotten at PPO's: refused naming the forgotten one
    with pytest.raises(ConfigError, match="left at the PPO default 0.2 ") as err:
        load_config(None, paper[:2] + ["rl.eps_clip_high=4e-4"])
    assert err.value.path == "rl.eps_clip_low"
    with pytest.raises(ConfigError, match="left at the PPO default 0.28 ") as err:
        load_config(None, paper[:3])
    assert err.value.path == "rl.eps_clip_high"
    assert load_config(None, paper[:2] + ["rl.eps_clip_low=0.1", "rl.eps_clip_high=0.3"]).rl.eps_clip_low == 0.1
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rl.policy_loss=grpo"])
    assert err.value.path == "rl.policy_loss"


def test_gspo_through_the_fused_log_prob_kernels() -> None:
    """kernels.enabled: the trainer's kernels give the log-probs (and their backward into the logits), GSPO runs on
    top in torch; the loss, metrics and logits gradient equal the plain-torch path's (fp32, on the kernel device)."""
    b = batch(fresh_seed())
    rows = {"tokens": b["tokens"], "old_logprobs": b["old"].float(), "advantages": b["adv"].float(),
            "loss_mask": b["mask"], "rollout_logprobs": b["rollout"].float()}
    cfg = replace(GSPO, tis_level="sequence")

    def run(kernels: KernelsConfig) -> tuple:
        logits = to_kernel_device(b["logits"].float()).requires_grad_(True)
        loss, metrics = grpo.policy_loss_from_logits(logits=logits, rl=cfg, kernels=kernels, temperature=1.0,
                                                     **{k: to_kernel_device(v) for k, v in rows.items()})
        loss.backward()
        return to_cpu((loss.detach(), metrics, logits.grad))

    before = LAUNCHES.copy()
    off = run(KernelsConfig(enabled=False))
    assert LAUNCHES == before
    on = run(KernelsConfig(enabled=True))
    assert LAUNCHES["tis_logprob.shard_stats"] == before["tis_logprob.shard_stats"] + 1
    assert LAUNCHES["tis_logprob.logits_grad"] == before["tis_logprob.logits_grad"] + 1
    torch.testing.assert_close(on[0], off[0], rtol=1e-5, atol=1e-7)
    for key in ("pg_loss", "clip_frac", "seq_clip_frac", "num_sequences", "approx_kl"):
        torch.testing.assert_close(on[1][key], off[1][key], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(on[2], off[2], rtol=1e-4, atol=1e-7)
    assert on[2].abs().sum() > 0
