"""Fused log-prob, entropy, PPO-clip and truncated importance sampling (TIS) on (vocab-parallel) logits.

From logits ``[tokens, vocab]`` (bf16/fp16/fp32; a tensor-parallel rank holds a contiguous vocab shard) this computes,
per token, the log-prob of the sampled token under ``softmax(logits / temperature)``, optionally the entropy and, given
``old_logprobs`` and advantages, the per-token loss of ``spade_mega.rl.loss.policy_loss``: the PPO ratio
``exp(clamp(logprob - old, +-20))`` clipped to ``[1 - eps_clip_low, 1 + eps_clip_high]``, times the TIS weight
``clamp(exp(old - rollout), tis_clip_low, tis_clip)`` (no gradient through it). Its backward writes the gradient on the
logits directly.

Why fused: the unfused path writes a full fp32 log-softmax ``[tokens, vocab]`` (at vocab 151,936 that is 600 KB per
token) and reads it back twice. Here the forward reads the logits once, keeping an online softmax (running max, sum of
exponentials and, for the entropy, a running sum of ``e * (x - max)``) in registers, and the backward reads them once
more and writes the gradient once.

Stages (each a Triton kernel with its plain-torch reference beside it, which runs where no kernel can):
  1. ``shard_stats``: one pass over this rank's vocab shard -> per-token partials ``[4, T]``: running max, sum of
     exponentials under that max, sum of ``e * (x - max)`` and the sampled token's tempered logit if in the shard.
  2. ``gather_partials``: the partials of all tensor-parallel ranks (Megatron's vocab-parallel logits), 4 floats each.
  3. ``finalize``: combine the partials -> log-sum-exp, log-prob, entropy; then ratio, TIS weight, per-token loss and
     ``d loss / d logprob``. Its reference takes the TIS weight from ``rl.loss.truncated_is_weights``.
  4. backward ``logits_grad``: ``(c_lp * (onehot - p) - c_ent * p * (log p + H)) / temperature`` for each shard element.

Layout: the stages in that order, each as kernel, reference and the function that picks one; then the autograd
Function, the API and the ahead-of-time compile specs. Triton is optional: the kernels are defined only where it
imports (under ``if triton is not None``); elsewhere the references run and ``dispatch.kernel_for`` refuses
``kernels.enabled``.

Tokens whose ``loss_mask`` is 0 are skipped (their logits are not read) and get loss, log-prob and entropy 0 and a zero
gradient. Token ids outside ``[0, vocab)`` must be masked; they are never read out of bounds either way.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from spade_mega.config.schema import RLConfig
from spade_mega.kernels.dispatch import cdiv, kernel_for, launch, next_power_of_2
from spade_mega.rl.loss import LOG_RATIO_LIMIT, truncated_is_weights

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (macOS, some clusters): the references run; kernels.enabled is refused
    triton = None

MAX_BLOCK_V = 4096  # vocab elements per loop step: 16 fp32 values per thread at 8 warps, no register spills on sm_90
BLOCK_T = 512  # tokens per program in the per-token finalize stage (4 a thread)
if triton is not None:
    NEG_INF = tl.constexpr(float("-inf"))  # a kernel may read a module global only as a constexpr


class TisLogprobResult(NamedTuple):
    loss: torch.Tensor  # per-token TIS-weighted clipped surrogate, 0 where masked
    logprobs: torch.Tensor  # log-prob of the sampled token under the tempered policy, 0 where masked
    entropy: Optional[torch.Tensor]  # per-token entropy of the tempered policy (when asked for), 0 where masked


def vocab_launch_config(vocab_shard: int, block_v: Optional[int] = None) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for the two passes over the vocab; also what the ahead-of-time compile check uses."""
    block = block_v or min(MAX_BLOCK_V, next_power_of_2(max(vocab_shard, 16)))
    return block, 8 if block >= 2048 else 4


# --------------------------------------------------------------------------------------------------- 1. shard stats
if triton is not None:
    @triton.jit
    def _shard_stats_kernel(logits_ptr, tokens_ptr, mask_ptr, stats_ptr, stride_row, n_tokens, vocab_shard, vocab_start,
                            temperature, WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_row
        n_cols = vocab_shard
        if mask_ptr is not None:
            n_cols = tl.where(tl.load(mask_ptr + row) != 0, vocab_shard, 0)  # a masked token reads nothing
        m = tl.full((), NEG_INF, tl.float32)
        s = tl.full((), 0.0, tl.float32)
        acc = tl.full((), 0.0, tl.float32)
        for start in range(0, n_cols, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            x = tl.load(base + offs, mask=offs < n_cols, other=NEG_INF).to(tl.float32) / temperature
            m_new = tl.maximum(m, tl.max(x, axis=0))
            m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)  # all -inf so far: keep exp() away from (-inf) - (-inf)
            shift = tl.where(m == NEG_INF, 0.0, m - m_safe)
            alpha = tl.where(m == NEG_INF, 0.0, tl.exp(shift))
            e = tl.exp(x - m_safe)
            if WITH_ENTROPY:
                d = tl.where(x == NEG_INF, 0.0, x - m_safe)
                acc = alpha * (acc + s * shift) + tl.sum(e * d, axis=0)
            s = s * alpha + tl.sum(e, axis=0)
            m = m_new
        local = tl.load(tokens_ptr + row) - vocab_start
        in_shard = (local >= 0) & (local < n_cols)
        # the same fp32 division as in the loop: x_tok <= max, so a log-prob is never positive
        x_tok = tl.load(base + local, mask=in_shard, other=0.0).to(tl.float32) / temperature
        tl.store(stats_ptr + row, m)
        tl.store(stats_ptr + n_tokens + row, s)
        tl.store(stats_ptr + 2 * n_tokens + row, acc)
        tl.store(stats_ptr + 3 * n_tokens + row, tl.where(in_shard, x_tok, 0.0))
else:  # no Triton: kernel_for refuses kernels.enabled
    _shard_stats_kernel = None


def shard_stats_reference(logits: torch.Tensor, tokens: torch.Tensor, loss_mask: Optional[torch.Tensor],
                          vocab_start: int, temperature: float, with_entropy: bool) -> torch.Tensor:
    """Plain-torch ``shard_stats``: partials ``[4, T]`` (max, sum exp, sum e*(x-max), sampled logit or 0)."""
    x = logits.float() / temperature
    vocab = x.shape[-1]
    m = x.amax(dim=-1)
    m_safe = torch.where(m == -torch.inf, 0.0, m)
    e = torch.exp(x - m_safe[:, None])
    s = e.sum(dim=-1)
    acc = ((e * torch.where(x == -torch.inf, 0.0, x - m_safe[:, None])).sum(dim=-1) if with_entropy
           else torch.zeros_like(s))
    local = tokens.long() - vocab_start
    in_shard = (local >= 0) & (local < vocab)
    x_tok = torch.where(in_shard, x.gather(1, local.clamp(0, vocab - 1)[:, None]).squeeze(1), 0.0)
    if loss_mask is not None:
        active = loss_mask.bool()
        m, s, acc, x_tok = (torch.where(active, v, fill)
                            for v, fill in ((m, -torch.inf), (s, 0.0), (acc, 0.0), (x_tok, 0.0)))
    return torch.stack([m, s, acc, x_tok])


def shard_stats(logits: torch.Tensor, tokens: torch.Tensor, loss_mask: Optional[torch.Tensor], vocab_start: int,
                temperature: float, with_entropy: bool, use_kernels: bool = True,
                block_v: Optional[int] = None) -> torch.Tensor:
    kernel = kernel_for(_shard_stats_kernel, logits, use_kernels)
    if kernel is None:
        return shard_stats_reference(logits, tokens, loss_mask, vocab_start, temperature, with_entropy)
    n_tokens, vocab_shard = logits.shape
    stats = torch.empty(4, n_tokens, dtype=torch.float32, device=logits.device)
    block, num_warps = vocab_launch_config(vocab_shard, block_v)
    launch("tis_logprob.shard_stats", kernel, (n_tokens,), logits, tokens, loss_mask, stats,
           logits.stride(0), n_tokens, vocab_shard, vocab_start, temperature,
           WITH_ENTROPY=with_entropy, BLOCK_V=block, num_warps=num_warps)
    return stats


# --------------------------------------------------------------------------------------------------- 2. TP gather
def gather_partials(stats: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """``[4, T]`` on each tensor-parallel rank -> ``[ranks, 4, T]`` everywhere (4 floats per token on the wire)."""
    if group is None or dist.get_world_size(group) == 1:
        return stats[None]
    parts = [torch.empty_like(stats) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, stats.contiguous(), group=group)
    return torch.stack(parts)


# --------------------------------------------------------------------------------------------------- 3. finalize
if triton is not None:
    @triton.jit
    def _finalize_kernel(stats_ptr, n_shards, old_ptr, rollout_ptr, adv_ptr, mask_ptr,
                         loss_ptr, logprob_ptr, entropy_ptr, lse_ptr, dlogprob_ptr,
                         n_tokens, eps_clip_low, eps_clip_high, tis_clip_low, tis_clip, log_tis_clip, log_ratio_limit,
                         WITH_ENTROPY: tl.constexpr, BLOCK_T: tl.constexpr):
        offs = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        inb = offs < n_tokens
        big_m = tl.full((BLOCK_T,), NEG_INF, tl.float32)
        for r in range(0, n_shards):
            big_m = tl.maximum(big_m, tl.load(stats_ptr + 4 * r * n_tokens + offs, mask=inb, other=NEG_INF))
        m_safe = tl.where(big_m == NEG_INF, 0.0, big_m)
        total = tl.zeros((BLOCK_T,), tl.float32)
        acc = tl.zeros((BLOCK_T,), tl.float32)
        x_tok = tl.zeros((BLOCK_T,), tl.float32)
        for r in range(0, n_shards):
            part = stats_ptr + 4 * r * n_tokens + offs
            m_r = tl.load(part, mask=inb, other=NEG_INF)
            s_r = tl.load(part + n_tokens, mask=inb, other=0.0)
            shift = tl.where(m_r == NEG_INF, 0.0, m_r - m_safe)
            scale = tl.where(m_r == NEG_INF, 0.0, tl.exp(shift))
            total += s_r * scale
            if WITH_ENTROPY:
                acc += scale * (tl.load(part + 2 * n_tokens, mask=inb, other=0.0) + s_r * shift)
            x_tok += tl.load(part + 3 * n_tokens, mask=inb, other=0.0)
        active = inb
        if mask_ptr is not None:
            active = active & (tl.load(mask_ptr + offs, mask=inb, other=0) != 0)
        total = tl.where(active, total, 1.0)  # masked and padding lanes: keep log(0) and 0/0 out of the way
        log_total = tl.log(total)
        lse = big_m + log_total
        logprob = x_tok - lse
        tl.store(logprob_ptr + offs, tl.where(active, logprob, 0.0), mask=inb)
        tl.store(lse_ptr + offs, tl.where(active, lse, 0.0), mask=inb)
        if WITH_ENTROPY:
            tl.store(entropy_ptr + offs, tl.where(active, log_total - acc / total, 0.0), mask=inb)
        if old_ptr is not None:
            old = tl.load(old_ptr + offs, mask=active, other=0.0)
            adv = tl.load(adv_ptr + offs, mask=active, other=0.0)
            log_ratio = logprob - old
            in_range = (log_ratio >= -log_ratio_limit) & (log_ratio <= log_ratio_limit)
            ratio = tl.exp(tl.minimum(tl.maximum(log_ratio, -log_ratio_limit), log_ratio_limit))
            surrogate = -adv * ratio
            clipped = -adv * tl.minimum(tl.maximum(ratio, 1.0 - eps_clip_low), 1.0 + eps_clip_high)
            weight = tl.full((BLOCK_T,), 1.0, tl.float32)
            if rollout_ptr is not None:
                log_w = old - tl.load(rollout_ptr + offs, mask=active, other=0.0)
                weight = tl.minimum(tl.maximum(tl.exp(tl.minimum(log_w, log_tis_clip)), tis_clip_low), tis_clip)
            loss = weight * tl.maximum(surrogate, clipped)
            # d(-A * ratio) / d logprob = -A * ratio while the unclipped branch is taken and the log-ratio is in range
            dlogprob = tl.where((surrogate >= clipped) & in_range, weight * surrogate, 0.0)
            tl.store(loss_ptr + offs, tl.where(active, loss, 0.0), mask=inb)
            tl.store(dlogprob_ptr + offs, tl.where(active, dlogprob, 0.0), mask=inb)
else:  # no Triton: kernel_for refuses kernels.enabled
    _finalize_kernel = None


class _Finalized(NamedTuple):
    loss: torch.Tensor  # zeros without old_logprobs
    logprobs: torch.Tensor
    entropy: torch.Tensor  # zeros when not asked for
    lse: torch.Tensor
    dlogprob: torch.Tensor  # d loss / d logprob per token; zeros without old_logprobs


def finalize_reference(partials: torch.Tensor, old_logprobs: Optional[torch.Tensor],
                       advantages: Optional[torch.Tensor], rollout_logprobs: Optional[torch.Tensor],
                       loss_mask: Optional[torch.Tensor], eps_clip_low: float, eps_clip_high: float,
                       tis_clip_low: float, tis_clip: float, with_entropy: bool) -> _Finalized:
    """Plain-torch ``finalize``: combine the per-shard partials; the PPO-clip and TIS terms as ``rl.loss`` has them."""
    m_r, s_r, acc_r, x_r = partials.unbind(1)
    big_m = m_r.amax(dim=0)
    m_safe = torch.where(big_m == -torch.inf, 0.0, big_m)
    shift = torch.where(m_r == -torch.inf, 0.0, m_r - m_safe)
    scale = torch.where(m_r == -torch.inf, 0.0, torch.exp(shift))
    active = torch.ones_like(big_m, dtype=torch.bool) if loss_mask is None else loss_mask
    total = torch.where(active, (s_r * scale).sum(dim=0), 1.0)
    log_total = torch.log(total)
    lse = big_m + log_total
    logprobs = x_r.sum(dim=0) - lse
    entropy = (log_total - (scale * (acc_r + s_r * shift)).sum(dim=0) / total if with_entropy
               else torch.zeros_like(lse))
    loss = dlogprob = torch.zeros_like(lse)
    if old_logprobs is not None:
        point = torch.where(active, logprobs, 0.0).requires_grad_(True)
        with torch.enable_grad():
            ratio = torch.exp((point - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
            surrogate = -advantages * ratio
            clipped = -advantages * ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high)
            loss = torch.maximum(surrogate, clipped)
            if rollout_logprobs is not None:
                cfg = RLConfig(tis_level="token", tis_clip=tis_clip, tis_clip_low=tis_clip_low)
                loss = loss * truncated_is_weights(old_logprobs, rollout_logprobs, active, cfg)[0]
            (dlogprob,) = torch.autograd.grad(loss.sum(), point)
        loss = loss.detach()
    return _Finalized(*(torch.where(active, v, 0.0) for v in (loss, logprobs, entropy, lse, dlogprob)))


def finalize(partials: torch.Tensor, old_logprobs: Optional[torch.Tensor], advantages: Optional[torch.Tensor],
             rollout_logprobs: Optional[torch.Tensor], loss_mask: Optional[torch.Tensor], eps_clip_low: float,
             eps_clip_high: float, tis_clip_low: float, tis_clip: float, with_entropy: bool,
             use_kernels: bool = True) -> _Finalized:
    kernel = kernel_for(_finalize_kernel, partials, use_kernels)
    if kernel is None:
        return finalize_reference(partials, old_logprobs, advantages, rollout_logprobs, loss_mask, eps_clip_low,
                                  eps_clip_high, tis_clip_low, tis_clip, with_entropy)
    n_shards, _, n_tokens = partials.shape
    out = _Finalized(*(torch.empty(n_tokens, dtype=torch.float32, device=partials.device) for _ in range(5)))
    if not with_entropy:
        out.entropy.zero_()
    if old_logprobs is None:
        out.loss.zero_()
        out.dlogprob.zero_()
    block = min(BLOCK_T, next_power_of_2(max(n_tokens, 16)))
    launch("tis_logprob.finalize", kernel, (cdiv(n_tokens, block),), partials, n_shards,
           old_logprobs, rollout_logprobs, advantages, loss_mask, out.loss, out.logprobs, out.entropy, out.lse,
           out.dlogprob, n_tokens, eps_clip_low, eps_clip_high, tis_clip_low, tis_clip, math.log(tis_clip),
           LOG_RATIO_LIMIT, WITH_ENTROPY=with_entropy, BLOCK_T=block, num_warps=4)
    return out


# --------------------------------------------------------------------------------------------------- 4. backward
if triton is not None:
    @triton.jit
    def _logits_grad_kernel(logits_ptr, tokens_ptr, lse_ptr, entropy_ptr, coef_lp_ptr, coef_ent_ptr, grad_ptr,
                            stride_row, grad_stride_row, vocab_shard, vocab_start, temperature,
                            WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c_lp = tl.load(coef_lp_ptr + row) / temperature
        c_ent = 0.0
        entropy = 0.0
        if WITH_ENTROPY:
            c_ent = tl.load(coef_ent_ptr + row) / temperature
            entropy = tl.load(entropy_ptr + row)
        n_read = tl.where((c_lp != 0.0) | (c_ent != 0.0), vocab_shard, 0)  # masked tokens: write zeros, read nothing
        lse = tl.load(lse_ptr + row)
        local = tl.load(tokens_ptr + row) - vocab_start
        base = logits_ptr + row * stride_row
        out = grad_ptr + row * grad_stride_row
        for start in range(0, vocab_shard, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            inb = offs < vocab_shard
            x = tl.load(base + offs, mask=offs < n_read, other=NEG_INF).to(tl.float32) / temperature
            p = tl.exp(x - lse)
            g = c_lp * (tl.where(offs == local, 1.0, 0.0) - p)
            if WITH_ENTROPY:
                g -= c_ent * p * (tl.where(p > 0.0, x - lse, 0.0) + entropy)  # p = 0 at x = -inf: no 0 * inf
            tl.store(out + offs, g.to(grad_ptr.dtype.element_ty), mask=inb)
else:  # no Triton: kernel_for refuses kernels.enabled
    _logits_grad_kernel = None


def logits_grad_reference(logits: torch.Tensor, tokens: torch.Tensor, lse: torch.Tensor,
                          entropy: Optional[torch.Tensor], coef_lp: torch.Tensor, coef_ent: Optional[torch.Tensor],
                          vocab_start: int, temperature: float) -> torch.Tensor:
    """Plain-torch backward: d/dlogits of ``sum(coef_lp * logprob + coef_ent * entropy)`` over this vocab shard."""
    x = logits.float() / temperature
    p = torch.exp(x - lse[:, None])
    local = tokens.long() - vocab_start
    onehot = torch.arange(x.shape[-1], device=x.device)[None, :] == local[:, None]
    g = coef_lp[:, None] * (onehot.float() - p)
    if entropy is not None:
        g -= coef_ent[:, None] * p * (torch.where(p > 0, x - lse[:, None], 0.0) + entropy[:, None])
    live = ((coef_lp != 0) | (coef_ent != 0)) if entropy is not None else coef_lp != 0
    return torch.where(live[:, None], g / temperature, 0.0).to(logits.dtype)


def logits_grad(logits: torch.Tensor, tokens: torch.Tensor, lse: torch.Tensor, entropy: Optional[torch.Tensor],
                coef_lp: torch.Tensor, coef_ent: Optional[torch.Tensor], vocab_start: int, temperature: float,
                use_kernels: bool = True, block_v: Optional[int] = None) -> torch.Tensor:
    kernel = kernel_for(_logits_grad_kernel, logits, use_kernels)
    if kernel is None:
        return logits_grad_reference(logits, tokens, lse, entropy, coef_lp, coef_ent, vocab_start, temperature)
    n_tokens, vocab_shard = logits.shape
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    block, num_warps = vocab_launch_config(vocab_shard, block_v)
    launch("tis_logprob.logits_grad", kernel, (n_tokens,), logits, tokens, lse, entropy, coef_lp,
           coef_ent, grad, logits.stride(0), grad.stride(0), vocab_shard, vocab_start, temperature,
           WITH_ENTROPY=entropy is not None, BLOCK_V=block, num_warps=num_warps)
    return grad


# --------------------------------------------------------------------------------------------------- autograd + API
class TisLogprobFunction(torch.autograd.Function):
    """Outputs (loss, logprobs, entropy) per token, each differentiable with respect to the logits shard."""

    @staticmethod
    def forward(ctx, logits, tokens, old_logprobs, advantages, rollout_logprobs, loss_mask, temperature,
                eps_clip_low, eps_clip_high, tis_clip_low, tis_clip, with_entropy, vocab_start, tp_group,
                use_kernels, block_v):
        stats = shard_stats(logits, tokens, loss_mask, vocab_start, temperature, with_entropy, use_kernels, block_v)
        out = finalize(gather_partials(stats, tp_group), old_logprobs, advantages, rollout_logprobs, loss_mask,
                       eps_clip_low, eps_clip_high, tis_clip_low, tis_clip, with_entropy, use_kernels)
        ctx.save_for_backward(logits, tokens, loss_mask, out.lse, out.entropy, out.dlogprob)
        ctx.config = (temperature, with_entropy, vocab_start, use_kernels, block_v)
        if old_logprobs is None:
            ctx.mark_non_differentiable(out.loss)
        if not with_entropy:
            ctx.mark_non_differentiable(out.entropy)
        return out.loss, out.logprobs, out.entropy

    @staticmethod
    def backward(ctx, grad_loss, grad_logprobs, grad_entropy):
        logits, tokens, loss_mask, lse, entropy, dlogprob = ctx.saved_tensors
        temperature, with_entropy, vocab_start, use_kernels, block_v = ctx.config
        coef_lp = grad_loss.float() * dlogprob + grad_logprobs.float()
        coef_ent = grad_entropy.float() if with_entropy else None
        if loss_mask is not None:  # masked outputs are the constant 0, whatever gradient arrives for them
            coef_lp = torch.where(loss_mask, coef_lp, 0.0)
            coef_ent = None if coef_ent is None else torch.where(loss_mask, coef_ent, 0.0)
        grad = logits_grad(logits, tokens, lse, entropy if with_entropy else None, coef_lp.contiguous(),
                           None if coef_ent is None else coef_ent.contiguous(), vocab_start, temperature,
                           use_kernels, block_v)
        if torch.is_grad_enabled():  # create_graph=True: this gradient depends on the logits, but not through autograd
            grad = _FirstOrderOnly.apply(grad.detach(), logits)
        return (grad,) + (None,) * 15


class _FirstOrderOnly(torch.autograd.Function):
    """Passes the logits gradient through and refuses to be differentiated: a second derivative (a gradient
    penalty, a Hessian-vector product) fails loudly instead of coming out zero or missing terms.
    (``once_differentiable`` would not: it fires only when an incoming gradient requires grad.)"""

    @staticmethod
    def forward(ctx, grad, logits):  # the logits only tie the output into their graph
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError("tis_logprob has no second derivative: its gradient on the logits is computed by hand, "
                           "so double backward (create_graph=True through it) is not supported")


def tis_logprob(logits: torch.Tensor, tokens: torch.Tensor, old_logprobs: Optional[torch.Tensor] = None,
                advantages: Optional[torch.Tensor] = None, *, rollout_logprobs: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, temperature: float = 1.0, eps_clip_low: float = 0.2,
                eps_clip_high: float = 0.28, tis_clip_low: float = 0.0, tis_clip: float = 2.0,
                with_entropy: bool = False, tp_group: Optional[dist.ProcessGroup] = None,
                vocab_start: Optional[int] = None, use_kernels: bool = True,
                block_v: Optional[int] = None) -> TisLogprobResult:
    """Per-token log-probs, (optionally) entropy and TIS-weighted PPO-clip loss from ``logits [..., vocab_shard]``.

    ``tokens``, ``old_logprobs``, ``advantages``, ``rollout_logprobs`` (the behaviour policy; None = no TIS) and
    ``loss_mask`` have the logits' leading shape. Without ``old_logprobs`` and ``advantages`` only log-probs (and
    entropy) are computed and ``loss`` is None. With ``tp_group`` the logits are this rank's vocab shard starting at
    ``vocab_start`` (default: rank * shard width, Megatron's layout). ``use_kernels=False`` (``kernels.enabled:
    false``) runs the plain-torch references; ``block_v`` overrides the vocab block (tests).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0.0 <= eps_clip_low < 1.0 or not eps_clip_high >= 0.0:
        raise ValueError(f"eps_clip_low must be in [0, 1) and eps_clip_high >= 0, got {eps_clip_low}, {eps_clip_high}")
    if not 0.0 <= tis_clip_low <= tis_clip or not tis_clip > 0.0:
        raise ValueError(f"needs 0 <= tis_clip_low <= tis_clip and tis_clip > 0, got tis_clip_low {tis_clip_low}, "
                         f"tis_clip {tis_clip}")
    if (old_logprobs is None) != (advantages is None):
        raise ValueError("old_logprobs and advantages go together: give both for the loss, or neither")
    if rollout_logprobs is not None and old_logprobs is None:
        raise ValueError("rollout_logprobs (truncated IS) needs old_logprobs and advantages")
    lead = tokens.shape
    if logits.shape[:-1] != lead:
        raise ValueError(f"logits {tuple(logits.shape)} and tokens {tuple(lead)} disagree on the token dimensions")
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages),
                    ("rollout_logprobs", rollout_logprobs), ("loss_mask", loss_mask)):
        if t is not None and t.shape != lead:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(lead)} like tokens")
    rows = logits.reshape(-1, logits.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if vocab_start is None:
        vocab_start = 0 if tp_group is None else dist.get_rank(tp_group) * rows.shape[-1]

    def flat(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
        return None if t is None else t.detach().reshape(-1).to(dtype).contiguous()

    loss, logprobs, entropy = TisLogprobFunction.apply(
        rows, flat(tokens, tokens.dtype), flat(old_logprobs, torch.float32), flat(advantages, torch.float32),
        flat(rollout_logprobs, torch.float32), flat(loss_mask, torch.bool), float(temperature), float(eps_clip_low),
        float(eps_clip_high), float(tis_clip_low), float(tis_clip), with_entropy, int(vocab_start), tp_group,
        use_kernels, block_v)
    return TisLogprobResult(loss.view(lead) if old_logprobs is not None else None, logprobs.view(lead),
                            entropy.view(lead) if with_entropy else None)


def aot_specs() -> list:
    """The launches ``spade_mega.kernels.aot`` compiles for sm_90: Qwen3 vocab 151,936 in bf16, mask, TIS; the two
    vocab passes with the entropy (the metric, or rl.entropy_coef > 0) and without (the SPADE recipe's loss)."""
    from spade_mega.kernels.aot import AotSpec

    block, warps = vocab_launch_config(151_936)
    vocab_pass = {"tokens_ptr": "*i64:16", "stride_row": "i32:16", "vocab_shard": "i32:16", "vocab_start": "i32",
                  "temperature": "fp32", "WITH_ENTROPY": "constexpr", "BLOCK_V": "constexpr"}
    specs = []
    for entropy in (True, False):
        tag = "" if entropy else " (no entropy)"
        specs += [
            AotSpec("tis_logprob.shard_stats" + tag, _shard_stats_kernel,
                    {"logits_ptr": "*bf16:16", "mask_ptr": "*i1:16", "stats_ptr": "*fp32:16", "n_tokens": "i32",
                     **vocab_pass},
                    {"WITH_ENTROPY": entropy, "BLOCK_V": block}, warps, f"bf16, BLOCK_V={block}"),
            AotSpec("tis_logprob.logits_grad" + tag, _logits_grad_kernel,
                    {"logits_ptr": "*bf16:16", "lse_ptr": "*fp32:16", "entropy_ptr": "*fp32:16",
                     "coef_lp_ptr": "*fp32:16", "coef_ent_ptr": "*fp32:16", "grad_ptr": "*bf16:16",
                     "grad_stride_row": "i32:16", **vocab_pass},
                    {"WITH_ENTROPY": entropy, "BLOCK_V": block,
                     **({} if entropy else {"entropy_ptr": None, "coef_ent_ptr": None})}, warps,
                    f"bf16, BLOCK_V={block}"),
        ]
    return specs + [
        AotSpec("tis_logprob.finalize", _finalize_kernel,
                {"stats_ptr": "*fp32:16", "n_shards": "i32", "old_ptr": "*fp32:16", "rollout_ptr": "*fp32:16",
                 "adv_ptr": "*fp32:16", "mask_ptr": "*i1:16", "loss_ptr": "*fp32:16", "logprob_ptr": "*fp32:16",
                 "entropy_ptr": "*fp32:16", "lse_ptr": "*fp32:16", "dlogprob_ptr": "*fp32:16", "n_tokens": "i32",
                 "eps_clip_low": "fp32", "eps_clip_high": "fp32", "tis_clip_low": "fp32", "tis_clip": "fp32",
                 "log_tis_clip": "fp32", "log_ratio_limit": "fp32", "WITH_ENTROPY": "constexpr",
                 "BLOCK_T": "constexpr"},
                {"WITH_ENTROPY": True, "BLOCK_T": BLOCK_T}, 4, f"BLOCK_T={BLOCK_T}"),
    ]
