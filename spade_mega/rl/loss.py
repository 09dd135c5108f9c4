"""The GRPO policy loss for both roles: PPO-clip with asymmetric epsilon (or GSPO's sequence-level ratio,
``rl.policy_loss``), truncated importance sampling, optional KL to a reference policy and entropy bonus. Plain torch:
the trainer's Triton kernels (``kernels.enabled``) give only the log-probs it takes; the kernel's own fused per-token
loss (kernels/tis_logprob.py, for the benchmark) must match the PPO branch.

GSPO (Group Sequence Policy Optimization, Zheng et al. 2025), as verl's ``compute_policy_loss_gspo`` and slime's
``compute_gspo_kl`` have it: sample i's ratio is ``s_i = exp(mean over its loss tokens of (logprobs - old_logprobs))``,
the geometric mean of its token ratios, and each token carries ``s_i,t = sg[s_i] * exp(logprobs_t - sg[logprobs_t])``
(equal to s_i; its gradient ``s_i * grad logprobs_t``), clipped to ``[1 - eps_clip_low, 1 + eps_clip_high]`` like a
PPO ratio. With ``seq-mean-token-mean`` (the only aggregation GSPO takes) a sample's term is its clipped surrogate
``min(s_i A_i, clip(s_i) A_i)`` and each token's gradient ``s_i * A_i * grad logprobs_t / |y_i|``. Since the sequence
mean is a stopped value, a context-parallel shard gets it from ``sample_sums`` like the other per-sample sums. The
truncated IS weight multiplies each token's clipped term as in PPO (verl and slime apply theirs per token too), at
``rl.tis_level``: ``sequence`` gives every token of a sample the sample's weight, correcting the whole sequence term.

Log-probabilities, per token:

- ``logprobs``: the policy being trained (carries the gradient).
- ``old_logprobs``: the training engine's policy before this update (the PPO anchor).
- ``rollout_logprobs``: the behaviour policy that sampled the tokens, as the inference engine reported it. For agent
  samples it differs from ``old_logprobs`` only by the train/inference engine mismatch; for delayed designer samples
  it is the policy of ``designer_delay`` steps ago. Either way the truncated IS weight
  ``clamp(exp(old_logprobs - rollout_logprobs), tis_clip_low, tis_clip)`` corrects for it, per token or per sequence
  (``rl.tis_level``), with no gradient through it.

Layouts: every tensor is [batch, tokens] (row = sample), or packed 1-D [tokens] with ``sample_ids`` [tokens] naming
each token's sample (needed by sequence-level TIS and the sequence-mean aggregations). A call that holds only part of
some samples (a context-parallel shard of a row) passes ``sample_sums``, which sums per-token values over each token's
whole sample (the other shards' tokens included): the per-sample quantities, sequence-level TIS log-weights and
loss-token counts, then equal those of the whole sample.

Micro-batches and data parallelism: the loss is ``sum_t weight_t * loss_t`` over masked tokens, where the weight
carries the normaliser. Pass ``normalizer`` = the *global* count over the whole global batch (all micro-batches, all
data-parallel ranks) and the returned losses are shares that sum to the global loss, so summed gradients equal the
full-batch gradient. The count is loss-mask tokens for ``token-mean`` and samples with at least one loss token for the
``seq-mean-*`` modes; :func:`loss_normalizer` gives one call's count, to be summed (all-reduced) over the global batch.
A framework that rescales the loss must have that undone: Megatron-Core's schedule divides each micro-batch loss by
the number of micro-batches (unless ``calculate_per_token_loss``) and its data-parallel reduction averages gradients,
so multiply the returned loss by ``num_microbatches * data_parallel_size`` there.
Without ``normalizer`` the call's own count is used (the loss of one self-contained batch).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from spade_mega.config.schema import RLConfig

LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: a larger log-ratio is a broken token; clamping keeps exp and its grad finite
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
POLICY_LOSSES = ("ppo", "gspo")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
LOW_VAR_KL_LIMIT = 10.0  # verl's clamp of its low_var_kl (k3): a token past it adds a constant, no gradient


def _flatten(loss_mask: torch.Tensor, sample_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-token sample index (compacted to 0..S-1) for either layout."""
    if loss_mask.dim() == 2:
        if sample_ids is not None:
            raise ValueError("sample_ids is only for packed (1-D) inputs; [batch, tokens] rows are the samples")
        b, t = loss_mask.shape
        return torch.arange(b, device=loss_mask.device).repeat_interleave(t)
    if loss_mask.dim() != 1:
        raise ValueError(f"inputs must be [batch, tokens] or packed [tokens], got shape {tuple(loss_mask.shape)}")
    if sample_ids is None:
        return torch.zeros(loss_mask.shape[0], dtype=torch.long, device=loss_mask.device)
    if sample_ids.shape != loss_mask.shape:
        raise ValueError(f"sample_ids must have shape {tuple(loss_mask.shape)}, got {tuple(sample_ids.shape)}")
    return torch.unique(sample_ids, return_inverse=True)[1]


def _segment_sum(values: torch.Tensor, seg: torch.Tensor, num: int) -> torch.Tensor:
    return values.new_zeros(num).index_add(0, seg, values)


SampleSums = Callable[[torch.Tensor], torch.Tensor]  # flat per-token values -> per token, the sum over its sample


def _sample_sums(values: torch.Tensor, seg: torch.Tensor, sample_sums: Optional[SampleSums]) -> torch.Tensor:
    """Per token, the sum of ``values`` over its sample: over this call's tokens, or ``sample_sums``'s."""
    if sample_sums is not None:
        return sample_sums(values)
    return _segment_sum(values, seg, int(seg.max()) + 1 if seg.numel() else 0)[seg]


def loss_normalizer(loss_mask: torch.Tensor, aggregation: str, sample_ids: Optional[torch.Tensor] = None) -> int:
    """This call's share of the normaliser: loss tokens (token-mean) or samples with a loss token (seq-mean-*)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    mask = loss_mask.bool()
    if aggregation == "token-mean":
        return int(mask.sum())
    if mask.dim() == 1 and sample_ids is None:
        raise ValueError(f"packed inputs need sample_ids for {aggregation!r}")
    seg = _flatten(mask, sample_ids)
    num = int(seg.max()) + 1 if seg.numel() else 0
    return int((_segment_sum(mask.flatten().double(), seg, num) > 0).sum())


def truncated_is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: RLConfig,
    *,
    sample_ids: Optional[torch.Tensor] = None,
    sample_sums: Optional[SampleSums] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated IS weights ``clamp(exp(old - rollout), tis_clip_low, tis_clip)`` per token, and the raw ratios.

    With ``cfg.tis_level == "sequence"`` the log-ratio is summed over each sample's loss tokens and every token of the
    sample carries the sample's weight. Both results are flat [tokens], detached, 0 on tokens outside the mask; the
    raw ratio (for metrics) is capped at exp(50) so it stays finite in float32. The weight never exceeds ``tis_clip``.
    """
    if old_logprobs.shape != rollout_logprobs.shape or old_logprobs.shape != loss_mask.shape:
        raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs {tuple(rollout_logprobs.shape)} "
                         f"and loss_mask {tuple(loss_mask.shape)} must have one shape")
    if loss_mask.dim() == 1 and sample_ids is None and cfg.tis_level == "sequence":
        raise ValueError("packed inputs need sample_ids for sequence-level TIS")
    dtype = torch.float64 if old_logprobs.dtype == torch.float64 else torch.float32
    mask = loss_mask.bool().flatten()
    zero = torch.zeros((), dtype=dtype, device=old_logprobs.device)
    log_w = torch.where(mask, old_logprobs.detach().flatten().to(dtype) - rollout_logprobs.detach().flatten().to(dtype),
                        zero)
    if cfg.tis_level == "sequence":
        log_w = _sample_sums(log_w, _flatten(loss_mask, sample_ids), sample_sums)
    raw = torch.exp(log_w.clamp(max=50.0))
    weight = torch.exp(log_w.clamp(max=math.log(cfg.tis_clip))).clamp(cfg.tis_clip_low, cfg.tis_clip)
    return torch.where(mask, weight, zero), torch.where(mask, raw, zero)


def kl_to_reference(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(current || reference) from the sampled tokens' log-probs (Schulman's estimators, as
    verl names them), differentiable in ``logprobs``. With x = ref_logprobs - logprobs: ``k1`` -x (unbiased, but
    negative on some tokens; its gradient does not depend on the reference at all), ``k2`` x^2 / 2 (biased, >= 0),
    ``k3`` e^x - x - 1 (unbiased, >= 0, low variance: the GRPO paper's, the default), ``low_var_kl`` k3 clamped to
    LOW_VAR_KL_LIMIT (verl's: a token that far from the reference stops pulling). x is clamped to
    +-LOG_RATIO_LIMIT in k3 and low_var_kl so that e^x stays finite."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"rl.kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs).square()
    x = (ref_logprobs - logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    k3 = torch.exp(x) - x - 1.0
    return k3.clamp(max=LOW_VAR_KL_LIMIT) if estimator == "low_var_kl" else k3


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: RLConfig,
    *,
    rollout_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    sample_ids: Optional[torch.Tensor] = None,
    normalizer: Optional[float] = None,
    sample_sums: Optional[SampleSums] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of one (micro-)batch and its metrics.

    All tensors share one shape ([batch, tokens] or packed [tokens]); ``advantages`` are per token (see
    :func:`spade_mega.rl.advantages.token_advantages`). ``entropy`` is the per-token entropy of the current policy,
    with its graph, needed when ``cfg.entropy_coef > 0``; ``ref_logprobs`` are needed when ``cfg.kl_coef > 0``.
    Tokens outside ``loss_mask`` get exactly zero gradient, whatever their values (padding may hold -inf or NaN).

    Metrics (detached 0-d tensors, means over this call's loss tokens; combine calls weighted by ``num_tokens``, and
    ``tis_ratio_max`` by max): ``pg_loss``, ``clip_frac`` (tokens whose clipped branch was taken; under GSPO the
    tokens of clipped samples, the paper's clipped-token fraction), ``approx_kl`` (k3 estimate of KL(old || current),
    per token in both losses), with rollout_logprobs ``tis_ratio_mean``/``tis_ratio_max`` (untruncated IS ratio) and
    ``tis_truncated_frac``, with ref_logprobs ``kl_ref`` (:func:`kl_to_reference`, ``rl.kl_estimator``), with
    entropy ``entropy``. GSPO adds ``seq_clip_frac``, the fraction of samples clipped, a mean over ``num_sequences``
    (this call's samples, each counted as its share of its loss tokens, so a context-parallel shard's counts add up
    to whole samples over the CP group): combine calls weighted by ``num_sequences``.
    """
    if cfg.loss_aggregation not in AGGREGATIONS:
        raise ValueError(f"rl.loss_aggregation must be one of {AGGREGATIONS}, got {cfg.loss_aggregation!r}")
    if cfg.policy_loss not in POLICY_LOSSES:
        raise ValueError(f"rl.policy_loss must be one of {POLICY_LOSSES}, got {cfg.policy_loss!r}")
    gspo = cfg.policy_loss == "gspo"
    if gspo and cfg.loss_aggregation != "seq-mean-token-mean":
        raise ValueError(f"rl.policy_loss 'gspo' needs rl.loss_aggregation 'seq-mean-token-mean' (a sample's term is "
                         f"the mean over its tokens, every sample weighs the same), got {cfg.loss_aggregation!r}")
    shape = logprobs.shape
    named = {"old_logprobs": old_logprobs, "advantages": advantages, "loss_mask": loss_mask,
             "rollout_logprobs": rollout_logprobs, "ref_logprobs": ref_logprobs, "entropy": entropy}
    for name, t in named.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logprobs")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("rl.kl_coef > 0 needs ref_logprobs (log-probs of the reference policy)")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("rl.entropy_coef > 0 needs the per-token entropy of the current policy")
    needs_segments = (cfg.loss_aggregation != "token-mean"
                      or (rollout_logprobs is not None and cfg.tis_level == "sequence"))
    if logprobs.dim() == 1 and sample_ids is None and needs_segments:
        raise ValueError(f"packed inputs need sample_ids for loss_aggregation {cfg.loss_aggregation!r} "
                         "or sequence-level TIS")

    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    mask = loss_mask.bool().flatten()
    seg = _flatten(loss_mask, sample_ids)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)

    def clean(t: torch.Tensor, keep_grad: bool = False) -> torch.Tensor:
        """Masked positions replaced by 0 *before* any arithmetic, so garbage there cannot reach a gradient."""
        t = t.flatten().to(dtype)
        return torch.where(mask, t if keep_grad else t.detach(), zero)

    lp, old, adv = clean(logprobs, True), clean(old_logprobs), clean(advantages)
    token_log_ratio = (lp - old).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    # per token, the loss tokens of its sample (all context-parallel shards'): seq-mean-token-mean's and GSPO's
    tokens_per_sample = _sample_sums(mask.to(dtype), seg, sample_sums) \
        if cfg.loss_aggregation == "seq-mean-token-mean" else None
    if gspo:  # log s_i,t = sg[mean_i(logprobs - old)] + logprobs_t - sg[logprobs_t]
        seq_log_ratio = _sample_sums((lp - old).detach(), seg, sample_sums) / tokens_per_sample.clamp(min=1.0)
        log_ratio = (seq_log_ratio + lp - lp.detach()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    else:
        log_ratio = token_log_ratio
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - cfg.eps_clip_low, 1.0 + cfg.eps_clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)

    metrics: dict[str, torch.Tensor] = {}
    if rollout_logprobs is not None:
        weight, raw = truncated_is_weights(old_logprobs, rollout_logprobs, loss_mask, cfg, sample_ids=sample_ids,
                                           sample_sums=sample_sums)
        pg = pg * weight
        metrics["tis_ratio_mean"] = raw[mask].mean() if mask.any() else zero
        metrics["tis_ratio_max"] = raw[mask].max() if mask.any() else zero
        metrics["tis_truncated_frac"] = ((raw > cfg.tis_clip) | (raw < cfg.tis_clip_low))[mask].to(dtype).mean() \
            if mask.any() else zero

    per_token = pg
    if ref_logprobs is not None:
        kl = kl_to_reference(lp, clean(ref_logprobs), cfg.kl_estimator)
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl
        metrics["kl_ref"] = kl.detach()[mask].mean() if mask.any() else zero
    if entropy is not None:
        ent = clean(entropy, True)
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * ent
        metrics["entropy"] = ent.detach()[mask].mean() if mask.any() else zero

    local = loss_normalizer(loss_mask, cfg.loss_aggregation, sample_ids)
    norm = float(local) if normalizer is None else float(normalizer)
    if not norm >= local:  # NaN too: the global count is a sum of every call's count
        raise ValueError(f"normalizer {normalizer!r} is below this call's own count {local} "
                         f"({cfg.loss_aggregation!r}); pass the count over the whole global batch: loss_normalizer "
                         "summed over every micro-batch and data-parallel rank")
    if tokens_per_sample is not None:
        weight_t = 1.0 / (tokens_per_sample.clamp(min=1.0) * max(norm, 1.0))
    else:
        weight_t = torch.full_like(per_token, 1.0 / max(norm, 1.0))
    loss = torch.where(mask, per_token * weight_t, zero).sum()

    with torch.no_grad():
        n = mask.sum()
        denom = n.clamp(min=1).to(dtype)
        metrics["pg_loss"] = torch.where(mask, pg, zero).sum() / denom
        clipped = mask & (pg_clipped > pg_unclipped)
        metrics["clip_frac"] = clipped.sum().to(dtype) / denom
        k3 = (torch.exp(token_log_ratio) - 1.0) - token_log_ratio
        metrics["approx_kl"] = torch.where(mask, k3, zero).sum() / denom
        if gspo:
            share = torch.where(mask, 1.0 / tokens_per_sample.clamp(min=1.0), zero)  # sums to 1 over a sample
            num_sequences = share.sum()
            metrics["seq_clip_frac"] = torch.where(clipped, share, zero).sum() / \
                torch.where(num_sequences > 0, num_sequences, torch.ones_like(num_sequences))
            metrics["num_sequences"] = num_sequences
        metrics["num_tokens"] = n.to(dtype)
    return loss, metrics
