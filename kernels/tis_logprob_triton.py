"""The Triton kernels of ``tis_logprob`` (see tis_logprob.py for the op, its stages and their references).

Imported by ``dispatch.kernel_for`` only when a kernel is to run, so that nothing else needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

NEG_INF = tl.constexpr(float("-inf"))  # a kernel may read a module global only as a constexpr


@triton.jit
def shard_stats_kernel(logits_ptr, tokens_ptr, mask_ptr, stats_ptr, stride_row, n_tokens, vocab_shard, vocab_start,
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


@triton.jit
def finalize_kernel(stats_ptr, n_shards, old_ptr, rollout_ptr, adv_ptr, mask_ptr,
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


@triton.jit
def logits_grad_kernel(logits_ptr, tokens_ptr, lse_ptr, entropy_ptr, coef_lp_ptr, coef_ent_ptr, grad_ptr,
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
