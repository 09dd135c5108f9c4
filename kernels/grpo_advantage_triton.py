"""The Triton kernels of ``grpo_advantage`` (see grpo_advantage.py for the op, how it tiles the sorted samples and its
reference).

Imported by ``dispatch.kernel_for`` only when a kernel is to run, so that nothing else needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _narrow(x, dtype: tl.constexpr):
    """float64 -> ``dtype`` through float32, as torch rounds a double to bf16/fp16 (and the interpreter mis-converts
    float64 to bf16 directly)."""
    if dtype == tl.float64:
        return x
    return x.to(tl.float32).to(dtype)


@triton.jit
def _segment_mean(rewards_ptr, order_ptr, start, end, BLOCK: tl.constexpr):
    """Mean of a segment's rewards (float64) and whether they are all equal (then the advantages are exactly 0)."""
    total = tl.zeros((BLOCK,), tl.float64)
    hi = tl.full((BLOCK,), float("-inf"), tl.float64)
    lo = tl.full((BLOCK,), float("inf"), tl.float64)
    for pos in range(start, end, BLOCK):
        offs = pos + tl.arange(0, BLOCK)
        inb = offs < end
        r = tl.load(rewards_ptr + tl.load(order_ptr + offs, mask=inb, other=0), mask=inb, other=0).to(tl.float64)
        total += r
        hi = tl.maximum(hi, tl.where(inb, r, float("-inf")))
        lo = tl.minimum(lo, tl.where(inb, r, float("inf")))
    return tl.sum(total, axis=0) / (end - start).to(tl.float64), tl.max(hi, axis=0) == tl.min(lo, axis=0)


@triton.jit
def _segment_scale(rewards_ptr, grad_ptr, order_ptr, start, end, mean, WITH_GRAD: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Second pass: sum of squared deviations, and for the backward sum(g) and sum(g * (r - mean))."""
    m2 = tl.zeros((BLOCK,), tl.float64)
    sum_g = tl.zeros((BLOCK,), tl.float64)
    sum_gc = tl.zeros((BLOCK,), tl.float64)
    for pos in range(start, end, BLOCK):
        offs = pos + tl.arange(0, BLOCK)
        inb = offs < end
        idx = tl.load(order_ptr + offs, mask=inb, other=0)
        c = tl.where(inb, tl.load(rewards_ptr + idx, mask=inb, other=0).to(tl.float64) - mean, 0.0)
        m2 += c * c
        if WITH_GRAD:
            g = tl.load(grad_ptr + idx, mask=inb, other=0).to(tl.float64)
            sum_g += g
            sum_gc += g * c
    return tl.sum(m2, axis=0), tl.sum(sum_g, axis=0), tl.sum(sum_gc, axis=0)


@triton.jit
def _seg_add3(f1, a1, b1, f2, a2, b2):
    """Segmented sum of two values: ``f`` marks the first element of a segment piece, where the sums restart."""
    return f1 | f2, tl.where(f2 != 0, a2, a1 + a2), tl.where(f2 != 0, b2, b1 + b2)


@triton.jit
def _seg_add2(f1, a1, f2, a2):
    return f1 | f2, tl.where(f2 != 0, a2, a1 + a2)


@triton.jit
def _piece_stats(rewards_ptr, order_ptr, positions, in_piece, first_reward):
    """(count, sum, sum of squares about the piece's own mean, count unlike the segment's first reward) of the
    sorted positions where ``in_piece``: one tile's share of a segment that crosses tiles."""
    idx = tl.load(order_ptr + positions, mask=in_piece, other=0)
    r = tl.load(rewards_ptr + idx, mask=in_piece, other=0).to(tl.float64)
    n = tl.sum(in_piece.to(tl.float64), axis=0)
    total = tl.sum(tl.where(in_piece, r, 0.0), axis=0)
    c = tl.where(in_piece, r - total / tl.maximum(n, 1.0), 0.0)
    unlike = tl.sum((in_piece & (r != first_reward)).to(tl.float64), axis=0)
    return n, total, tl.sum(c * c, axis=0), unlike


@triton.jit
def _store_share(rewards_ptr, order_ptr, share_ptr, seg_start, in_piece, positions):
    """One tile's share of a segment, as 4 float64: count, sum, squares about its mean, count unlike the segment's
    first reward."""
    first_reward = tl.load(rewards_ptr + tl.load(order_ptr + seg_start)).to(tl.float64)
    n, total, m2, unlike = _piece_stats(rewards_ptr, order_ptr, positions, in_piece, first_reward)
    tl.store(share_ptr, n)
    tl.store(share_ptr + 1, total)
    tl.store(share_ptr + 2, m2)
    tl.store(share_ptr + 3, unlike)


@triton.jit
def crossing_parts_kernel(rewards_ptr, order_ptr, seg_ptr, offsets_ptr, parts_ptr, n_sorted, TILE: tl.constexpr):
    """Pass 1 (only when the sorted samples span several tiles): each tile's share of the segment at its start
    (slot 0) and of the segment at its end (slot 1), the only ones that can cross a tile boundary. Reads just those
    shares, so small segments cost a few samples a tile."""
    tile = tl.program_id(0)
    p0 = tile * TILE
    p1 = p0 + tl.minimum(n_sorted - p0, TILE)  # not p0 + TILE: that overflows int32 near 2**31 samples
    pos = p0 + tl.arange(0, TILE)
    head = tl.load(seg_ptr + p0)
    tail = tl.load(seg_ptr + p1 - 1)
    _store_share(rewards_ptr, order_ptr, parts_ptr + tile * 8, tl.load(offsets_ptr + head),
                 (pos < p1) & (pos < tl.load(offsets_ptr + head + 1)), pos)
    tail_start = tl.load(offsets_ptr + tail)
    _store_share(rewards_ptr, order_ptr, parts_ptr + tile * 8 + 4, tail_start, (pos < p1) & (pos >= tail_start), pos)


@triton.jit
def _combined_stats(parts_ptr, seg_start, seg_end, TILE: tl.constexpr, BLOCK_R: tl.constexpr):
    """(mean, sum of squares about it, count unlike the first reward) of a segment that crosses tiles, from its
    tiles' shares in tile order (Chan et al.'s pairwise combination): every tile of the segment computes exactly
    the same numbers, so its samples agree and the result is deterministic."""
    t0 = seg_start // TILE
    t1 = (seg_end - 1) // TILE
    n_acc = tl.zeros((BLOCK_R,), tl.float64)
    sum_acc = tl.zeros((BLOCK_R,), tl.float64)
    unlike_acc = tl.zeros((BLOCK_R,), tl.float64)
    for t in range(t0, t1 + 1, BLOCK_R):
        tiles = t + tl.arange(0, BLOCK_R)
        ok = tiles <= t1
        base = parts_ptr + (tiles * 2 + tl.where(tiles * TILE >= seg_start, 0, 1)) * 4  # its head or tail share
        n_acc += tl.load(base, mask=ok, other=0.0)
        sum_acc += tl.load(base + 1, mask=ok, other=0.0)
        unlike_acc += tl.load(base + 3, mask=ok, other=0.0)
    mean = tl.sum(sum_acc, axis=0) / (seg_end - seg_start).to(tl.float64)
    m2_acc = tl.zeros((BLOCK_R,), tl.float64)
    for t in range(t0, t1 + 1, BLOCK_R):
        tiles = t + tl.arange(0, BLOCK_R)
        ok = tiles <= t1
        base = parts_ptr + (tiles * 2 + tl.where(tiles * TILE >= seg_start, 0, 1)) * 4
        n = tl.load(base, mask=ok, other=1.0)
        d = tl.load(base + 1, mask=ok, other=0.0) / n - mean
        m2_acc += tl.where(ok, tl.load(base + 2, mask=ok, other=0.0) + n * d * d, 0.0)
    return mean, tl.sum(m2_acc, axis=0), tl.sum(unlike_acc, axis=0)


@triton.jit
def grpo_advantage_kernel(rewards_ptr, order_ptr, seg_ptr, offsets_ptr, seg_designer_ptr, parts_ptr, params_ptr,
                           out_ptr, mask_ptr, tokens_out_ptr, n_sorted, n_cols, mask_stride, tokens_stride,
                           STD_NORMALIZE: tl.constexpr, TILE: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_W: tl.constexpr, BLOCK_L: tl.constexpr):
    """Program (tile, column block): the advantages of TILE consecutive sorted samples. Segments inside the tile
    get their statistics from segmented scans over the tile; the (at most two) that cross its edges from pass 1's
    shares. Column block 0 writes the per-sample advantages; with a loss mask, each column block writes its
    BLOCK_L tokens of every row in the tile."""
    tile = tl.program_id(0)
    col_block = tl.program_id(1)
    p0 = tile * TILE
    p1 = p0 + tl.minimum(n_sorted - p0, TILE)  # not p0 + TILE: that overflows int32 near 2**31 samples
    local = tl.arange(0, TILE)
    pos = p0 + local
    inb = pos < p1
    seg = tl.load(seg_ptr + pos, mask=inb, other=0)
    start = tl.load(offsets_ptr + seg, mask=inb, other=0)
    end = tl.load(offsets_ptr + seg + 1, mask=inb, other=1)
    idx = tl.load(order_ptr + pos, mask=inb, other=0)
    r = tl.load(rewards_ptr + idx, mask=inb, other=0).to(tl.float64)
    count = (end - start).to(tl.float64)

    # segments inside the tile: segmented sums, read back at each segment's last element
    last = tl.minimum(tl.maximum(end - 1 - p0, 0), TILE - 1)
    piece_start = ((pos == start) | (local == 0)).to(tl.int32)
    first_reward = tl.gather(r, tl.minimum(tl.maximum(start - p0, 0), TILE - 1), 0)
    _, sums, unlikes = tl.associative_scan((piece_start, r, (r != first_reward).to(tl.float64)), 0, _seg_add3)
    mean = tl.gather(sums, last, 0) / count
    unlike = tl.gather(unlikes, last, 0)
    c = r - mean
    _, squares = tl.associative_scan((piece_start, c * c), 0, _seg_add2)
    m2 = tl.gather(squares, last, 0)

    # the segments at the tile's edges, when they cross it: their statistics from every tile they span
    head = tl.load(seg_ptr + p0)
    tail = tl.load(seg_ptr + p1 - 1)
    head_start, head_end = tl.load(offsets_ptr + head), tl.load(offsets_ptr + head + 1)
    tail_start, tail_end = tl.load(offsets_ptr + tail), tl.load(offsets_ptr + tail + 1)
    crossing = (start < p0) | (end > p1)
    if (head_start < p0) | (head_end > p1):
        h_mean, h_m2, h_unlike = _combined_stats(parts_ptr, head_start, head_end, TILE, BLOCK_R)
        at_head = crossing & (seg == head)
        mean = tl.where(at_head, h_mean, mean)
        m2 = tl.where(at_head, h_m2, m2)
        unlike = tl.where(at_head, h_unlike, unlike)
    if (tail != head) & ((tail_start < p0) | (tail_end > p1)):
        t_mean, t_m2, t_unlike = _combined_stats(parts_ptr, tail_start, tail_end, TILE, BLOCK_R)
        at_tail = crossing & (seg == tail)
        mean = tl.where(at_tail, t_mean, mean)
        m2 = tl.where(at_tail, t_m2, m2)
        unlike = tl.where(at_tail, t_unlike, unlike)

    designer = tl.load(seg_designer_ptr + seg, mask=inb, other=0) != 0
    factor = tl.where(designer, tl.load(params_ptr), 1.0)  # advantage = (r - mean) * factor
    if STD_NORMALIZE:
        std = tl.sqrt(m2 / tl.maximum(count - 1.0, 1.0))
        factor = tl.where(designer, factor, 1.0 / (std + tl.load(params_ptr + 1)))
    factor = tl.where(unlike == 0.0, 0.0, factor)  # one sample, or all alike: exactly 0
    adv = _narrow((r - mean) * factor, out_ptr.dtype.element_ty)
    tl.store(out_ptr + idx, adv, mask=inb & (col_block == 0))
    if mask_ptr is not None:
        cols = col_block * BLOCK_L + tl.arange(0, BLOCK_L)
        for row in range(0, p1 - p0, BLOCK_W):
            rows = row + tl.arange(0, BLOCK_W)
            row_idx = tl.gather(idx, rows, 0).to(tl.int64)  # row * stride overflows 32 bits on big batches
            row_adv = tl.gather(adv, rows, 0)
            inside = ((p0 + rows) < p1)[:, None] & (cols < n_cols)[None, :]
            keep = tl.load(mask_ptr + row_idx[:, None] * mask_stride + cols[None, :], mask=inside, other=0) != 0
            tl.store(tokens_out_ptr + row_idx[:, None] * tokens_stride + cols[None, :],
                     tl.where(keep, row_adv[:, None], 0.0).to(tokens_out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def grpo_advantage_grad_kernel(rewards_ptr, seg_designer_ptr, order_ptr, offsets_ptr, params_ptr, grad_out_ptr,
                                grad_in_ptr, STD_NORMALIZE: tl.constexpr, BLOCK: tl.constexpr):
    """d/dr of the segment's advantages: centring is its own adjoint; the std adds -c * sum(g c) / (d^2 s (n-1))."""
    seg = tl.program_id(0)
    start = tl.load(offsets_ptr + seg)
    end = tl.load(offsets_ptr + seg + 1)
    count = (end - start).to(tl.float64)
    designer = tl.load(seg_designer_ptr + seg) != 0
    designer_scale = tl.load(params_ptr)
    eps = tl.load(params_ptr + 1)
    mean, flat = _segment_mean(rewards_ptr, order_ptr, start, end, BLOCK)
    m2, sum_g, sum_gc = _segment_scale(rewards_ptr, grad_out_ptr, order_ptr, start, end, mean, True, BLOCK)
    factor = tl.where(designer, designer_scale, 1.0)
    coupling = 0.0  # grad_c = factor * g - coupling * c
    if STD_NORMALIZE:
        dof = tl.maximum(count - 1.0, 1.0)
        std = tl.sqrt(m2 / dof)
        denom = std + eps
        factor = tl.where(designer, factor, 1.0 / denom)
        std_safe = tl.where(std == 0.0, 1.0, std)  # std 0: every c is 0, and so is the coupling term
        coupling = tl.where(designer | (std == 0.0), 0.0, sum_gc / (denom * denom * std_safe * dof))
    factor = tl.where(flat, 0.0, factor)
    coupling = tl.where(flat, 0.0, coupling)
    mean_grad_c = factor * sum_g / count  # sum(c) = 0, so the coupling term has mean 0
    for pos in range(start, end, BLOCK):
        offs = pos + tl.arange(0, BLOCK)
        inb = offs < end
        idx = tl.load(order_ptr + offs, mask=inb, other=0)
        c = tl.load(rewards_ptr + idx, mask=inb, other=0).to(tl.float64) - mean
        g = tl.load(grad_out_ptr + idx, mask=inb, other=0).to(tl.float64)
        tl.store(grad_in_ptr + idx, _narrow(factor * g - coupling * c - mean_grad_c, grad_in_ptr.dtype.element_ty),
                 mask=inb)
