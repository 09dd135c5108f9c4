"""Fused per-role GRPO advantages: rewards -> per-sample (and optionally per-token) advantages in one launch (two
when a segment crosses a tile edge).

The specification is ``spade_mega.rl.advantages.grpo_advantages`` (the reference this op falls back to): agent samples
are normalised within their environment group, ``(r - mean) / (std + eps)`` with the unbiased std (or only centred,
``std_normalize=False``); designer samples are centred within their skill and multiplied by ``designer_scale``; a group
of one or of equal rewards gives exactly 0; rows with ``valid = False`` get 0 and do not count. Statistics are float64.

How: the host sorts the valid samples by (role, group-or-skill) once (a stable sort, so the order, and with it every
floating-point sum, is deterministic) and hands the kernels the permutation, each sorted position's segment and the
segment offsets. Forward programs own fixed tiles of TILE sorted samples, whatever the segments: a tile's segments
get mean, spread and "all alike" from segmented scans over the tile (``tl.associative_scan``), so 64 groups of 16
cost one program, not 64. A segment that crosses a tile edge (any segment larger than a tile, and the unlucky
small ones) is first summarised per tile by a small launch that reads only the tiles' edge shares; every tile of
that segment then combines all its shares in tile order, so they agree bit for bit and the result does not depend
on scheduling. With a ``[samples, tokens]`` loss mask, a second grid axis over token blocks writes the per-token
advantages in the same launch, so the advantages never make a round trip through memory before the broadcast. The
backward kernel (the op is a ``torch.autograd.Function``) walks each segment with one program.

Layout: constants, the Triton kernels (defined only where Triton imports, under ``if triton is not None``; elsewhere
the reference runs and ``dispatch.kernel_for`` refuses ``kernels.enabled``), the host's sort into segments, the
autograd Function, the API and the ahead-of-time compile specs.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from spade_mega.kernels.dispatch import cdiv, kernel_for, launch
from spade_mega.rl.advantages import DESIGNER, check_rewards, grpo_advantages, token_advantages

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (macOS, some clusters): the references run; kernels.enabled is refused
    triton = None

TILE = 1024  # sorted samples per forward program: 64 SPADE groups of 16, or a 1,024-sample share of a larger one
BLOCK_R = 128  # tiles' shares combined per step for a segment that crosses tiles
BLOCK_S = 256  # samples per step of a segment's loops in the backward (one program per segment); at 4 warps the
# one size that ptxas compiles without a spill under both triton 3.6 and 3.7 (128 spills 8 bytes under 3.6)
BLOCK_W = 8  # rows per step of the token broadcast: an [8, 128] tile of the [samples, tokens] output
BLOCK_L = 128  # tokens per forward program's column block (grid axis 1) when broadcasting to [samples, tokens]
MAX_GRID_Y = 65_535  # CUDA's limit on grid axis 1: wider token broadcasts (8.4M tokens a sample) use the reference


def tile_warps(tile: int) -> int:
    """Warps for a forward program over ``tile`` samples: 4 values per thread per vector (at 1,024 samples, 8 warps
    keep the scans' float64 vectors within ~100 registers; 4 warps took 186)."""
    return max(1, min(8, tile // 128))


class GrpoAdvantages(NamedTuple):
    samples: torch.Tensor  # [N] per-sample advantages
    tokens: Optional[torch.Tensor]  # [N, L] per-token advantages (0 outside the loss mask), when a loss mask was given


if triton is not None:
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
    def _crossing_parts_kernel(rewards_ptr, order_ptr, seg_ptr, offsets_ptr, parts_ptr, n_sorted, TILE: tl.constexpr):
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
        _store_share(rewards_ptr, order_ptr, parts_ptr + tile * 8 + 4, tail_start, (pos < p1) & (pos >= tail_start),
                     pos)

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
    def _grpo_advantage_kernel(rewards_ptr, order_ptr, seg_ptr, offsets_ptr, seg_designer_ptr, parts_ptr, params_ptr,
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
    def _grpo_advantage_grad_kernel(rewards_ptr, seg_designer_ptr, order_ptr, offsets_ptr, params_ptr, grad_out_ptr,
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
else:  # no Triton: kernel_for refuses kernels.enabled
    _crossing_parts_kernel = _grpo_advantage_kernel = _grpo_advantage_grad_kernel = None


class _Segments(NamedTuple):
    order: torch.Tensor  # int32 [M]: valid rows sorted by (role, group-or-skill), stable
    seg: torch.Tensor  # int32 [M]: the segment of each sorted position
    offsets: torch.Tensor  # int32 [segments + 1] into ``order``
    designer: torch.Tensor  # int8 [segments]: 1 for a designer skill, 0 for an agent group
    all_valid: bool
    tile: int  # sorted samples per forward program
    crossing: bool  # some segment crosses a tile edge: the forward needs its first launch


def _segments(group_ids: torch.Tensor, roles: torch.Tensor, skill_ids: torch.Tensor,
              valid: Optional[torch.Tensor], tile: int = TILE) -> _Segments:
    if roles.shape[0] >= 2**31:
        raise ValueError(f"at most 2**31 - 1 samples per call, got {roles.shape[0]}")
    rows = torch.arange(roles.shape[0], device=roles.device) if valid is None else torch.nonzero(valid).flatten()
    designer = roles[rows] == DESIGNER
    ids = torch.where(designer, skill_ids[rows], group_ids[rows]).long()
    # (id, role) order from two stable sorts: packing the role into the id's bits (2 * id + role) wraps around for
    # |id| >= 2**62 and merges groups that the reference keeps apart
    perm = torch.sort(designer.to(torch.uint8), stable=True).indices
    perm = perm[torch.sort(ids[perm], stable=True).indices]
    ids, designer = ids[perm], designer[perm]
    boundary = (ids[1:] != ids[:-1]) | (designer[1:] != designer[:-1])
    starts = torch.nonzero(boundary).flatten() + 1
    edges = torch.tensor([0, ids.numel()], device=ids.device)
    offsets = torch.cat([edges[:1], starts, edges[1:]]) if ids.numel() else edges[:1]
    seg = torch.cat([boundary.new_zeros(min(1, ids.numel())), boundary]).int().cumsum(0, dtype=torch.int32)
    # a segment crosses a tile edge iff some edge inside the batch is not a segment start (groups of 16 fill tiles
    # of 1,024 exactly: then one launch does it all)
    is_start = torch.zeros(ids.numel() + 1, dtype=torch.bool, device=ids.device)
    is_start[offsets] = True
    crossing = not bool(is_start[tile:ids.numel():tile].all())
    return _Segments(rows[perm].int().contiguous(), seg, offsets.int().contiguous(),
                     designer[offsets[:-1]].to(torch.int8), valid is None or rows.numel() == roles.shape[0], tile,
                     crossing)


class GrpoAdvantageFunction(torch.autograd.Function):
    """Per-sample and per-token advantages, differentiable with respect to the rewards."""

    @staticmethod
    def forward(ctx, rewards, segments, params, loss_mask, std_normalize, out_dtype):
        n = rewards.shape[0]
        alloc = torch.empty if segments.all_valid else torch.zeros  # invalid rows are never written: 0
        out = alloc(n, dtype=out_dtype, device=rewards.device)
        tokens = alloc(loss_mask.shape, dtype=out_dtype, device=rewards.device) if loss_mask is not None else None
        n_sorted = segments.order.numel()
        if n_sorted:
            tile = segments.tile
            n_tiles = cdiv(n_sorted, tile)
            parts = torch.empty(n_tiles * 8, dtype=torch.float64, device=rewards.device)  # read only across tiles
            num_warps = tile_warps(tile)
            if segments.crossing:
                launch("grpo_advantage.crossing", _crossing_parts_kernel, (n_tiles,), rewards, segments.order,
                       segments.seg, segments.offsets, parts, n_sorted, TILE=tile, num_warps=num_warps)
            n_cols = 0 if loss_mask is None else loss_mask.shape[1]
            launch("grpo_advantage.forward", _grpo_advantage_kernel,
                   (n_tiles, 1 if loss_mask is None else max(1, cdiv(n_cols, BLOCK_L))), rewards,
                   segments.order, segments.seg, segments.offsets, segments.designer, parts, params, out, loss_mask,
                   tokens, n_sorted, n_cols, 0 if loss_mask is None else loss_mask.stride(0),
                   0 if tokens is None else tokens.stride(0), STD_NORMALIZE=std_normalize, TILE=tile,
                   BLOCK_R=BLOCK_R, BLOCK_W=BLOCK_W, BLOCK_L=BLOCK_L, num_warps=num_warps)
        ctx.save_for_backward(rewards, segments.designer, segments.order, segments.offsets, params, loss_mask)
        ctx.std_normalize = std_normalize
        if tokens is None:
            return out, torch.empty(0, dtype=out_dtype, device=rewards.device)
        return out, tokens

    @staticmethod
    def backward(ctx, grad_samples, grad_tokens):
        rewards, designer, order, offsets, params, loss_mask = ctx.saved_tensors
        grad = grad_samples.double()
        if loss_mask is not None:
            grad = grad + torch.where(loss_mask, grad_tokens.double(), 0.0).sum(dim=1)
        grad_rewards = torch.zeros_like(rewards)
        if offsets.numel() > 1:
            launch("grpo_advantage.backward", _grpo_advantage_grad_kernel,
                   (offsets.numel() - 1,), rewards, designer, order, offsets, params, grad.contiguous(), grad_rewards,
                   STD_NORMALIZE=ctx.std_normalize, BLOCK=BLOCK_S, num_warps=4)
        return grad_rewards, None, None, None, None, None


def _check(rewards: torch.Tensor, group_ids: torch.Tensor, roles: torch.Tensor, skill_ids: torch.Tensor,
           designer_scale: float, valid: Optional[torch.Tensor], loss_mask: Optional[torch.Tensor]) -> None:
    """The reference's input checks, with its messages, so both paths refuse the same inputs alike."""
    check_rewards(rewards)
    n = rewards.shape[0]
    for name, t in (("group_ids", group_ids), ("roles", roles), ("skill_ids", skill_ids)):
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},) like rewards, got {tuple(t.shape)}")
    if n and not ((roles == 0) | (roles == DESIGNER)).all():
        raise ValueError(f"roles must be 0 (agent) or {DESIGNER} (designer)")
    if not (designer_scale >= 0.0 and designer_scale < float("inf")):
        raise ValueError(f"designer_scale must be a finite number >= 0, got {designer_scale!r}")
    if valid is not None and valid.shape != (n,):
        raise ValueError(f"valid must have shape ({n},) like rewards, got {tuple(valid.shape)}")
    if loss_mask is not None and (loss_mask.dim() != 2 or loss_mask.shape[0] != n):
        raise ValueError(f"loss_mask must be [samples, tokens] with {n} rows, got shape {tuple(loss_mask.shape)}")


def grpo_advantage(rewards: torch.Tensor, group_ids: torch.Tensor, roles: torch.Tensor, skill_ids: torch.Tensor,
                   designer_scale: float, *, std_normalize: bool = True, eps: float = 1e-6,
                   valid: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None,
                   use_kernels: bool = True, tile: Optional[int] = None) -> GrpoAdvantages:
    """``rl.advantages.grpo_advantages`` (same arguments), plus with ``loss_mask [N, L]`` (row i = sample i) the
    per-token advantages of ``rl.advantages.token_advantages`` from the same launch. ``use_kernels=False``
    (``kernels.enabled: false``) runs the reference. ``tile``: sorted samples per forward program (a power of two
    >= 16; default ``TILE``); results do not depend on it beyond float64 rounding."""
    tile = TILE if tile is None else tile
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 16, got {tile}")
    too_wide = loss_mask is not None and loss_mask.dim() == 2 and loss_mask.shape[1] > MAX_GRID_Y * BLOCK_L
    # too wide: past CUDA's grid
    if too_wide or kernel_for(_grpo_advantage_kernel, rewards, use_kernels) is None:
        samples = grpo_advantages(rewards, group_ids, roles, skill_ids, designer_scale, std_normalize=std_normalize,
                                  eps=eps, valid=valid)
        return GrpoAdvantages(samples, None if loss_mask is None else token_advantages(samples, loss_mask))
    _check(rewards, group_ids, roles, skill_ids, designer_scale, valid, loss_mask)
    segments = _segments(group_ids, roles, skill_ids, None if valid is None else valid.bool(), tile)
    params = torch.tensor([designer_scale, eps], dtype=torch.float64, device=rewards.device)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    mask = None if loss_mask is None else loss_mask.bool().contiguous()
    samples, tokens = GrpoAdvantageFunction.apply(rewards.contiguous(), segments, params, mask, std_normalize,
                                                  out_dtype)
    return GrpoAdvantages(samples, tokens if loss_mask is not None else None)


def aot_specs() -> list:
    """The launches ``spade_mega.kernels.aot`` compiles for sm_90: fp32 rewards, int32 sorted ids, bool loss mask,
    the default tile."""
    from spade_mega.kernels.aot import AotSpec

    ids = {"order_ptr": "*i32:16", "seg_ptr": "*i32:16", "offsets_ptr": "*i32:16"}
    forward = {"rewards_ptr": "*fp32:16", **ids, "seg_designer_ptr": "*i8:16", "parts_ptr": "*fp64:16",
               "params_ptr": "*fp64:16", "out_ptr": "*fp32:16", "mask_ptr": "*i1:16", "tokens_out_ptr": "*fp32:16",
               "n_sorted": "i32", "n_cols": "i32", "mask_stride": "i32", "tokens_stride": "i32",
               "STD_NORMALIZE": "constexpr", "TILE": "constexpr", "BLOCK_R": "constexpr", "BLOCK_W": "constexpr",
               "BLOCK_L": "constexpr"}
    meta = {"STD_NORMALIZE": True, "TILE": TILE, "BLOCK_R": BLOCK_R, "BLOCK_W": BLOCK_W, "BLOCK_L": BLOCK_L}
    warps = tile_warps(TILE)
    return [
        AotSpec("grpo_advantage.crossing", _crossing_parts_kernel,
                {"rewards_ptr": "*fp32:16", "order_ptr": "*i32:16", "seg_ptr": "*i32:16", "offsets_ptr": "*i32:16",
                 "parts_ptr": "*fp64:16", "n_sorted": "i32", "TILE": "constexpr"}, {"TILE": TILE}, warps,
                f"TILE={TILE}"),
        AotSpec("grpo_advantage.forward", _grpo_advantage_kernel, forward, meta, warps,
                f"TILE={TILE}, token tile {BLOCK_W}x{BLOCK_L}"),
        AotSpec("grpo_advantage.forward_samples", _grpo_advantage_kernel, forward,
                {**meta, "mask_ptr": None, "tokens_out_ptr": None}, warps, f"TILE={TILE}, no token broadcast"),
        AotSpec("grpo_advantage.backward", _grpo_advantage_grad_kernel,
                {"rewards_ptr": "*fp32:16", "seg_designer_ptr": "*i8:16", "order_ptr": "*i32:16",
                 "offsets_ptr": "*i32:16",
                 "params_ptr": "*fp64:16", "grad_out_ptr": "*fp64:16", "grad_in_ptr": "*fp32:16",
                 "STD_NORMALIZE": "constexpr", "BLOCK": "constexpr"},
                {"STD_NORMALIZE": True, "BLOCK": BLOCK_S}, 4, f"BLOCK={BLOCK_S}"),
    ]
