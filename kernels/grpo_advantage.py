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
backward kernel (the op is a ``torch.autograd.Function``) walks each segment with one program. The kernels are in
``grpo_advantage_triton.py``, imported (with Triton) only when they run.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from spade_mega.kernels.dispatch import cdiv, kernel_for, launch, triton_kernels
from spade_mega.rl.advantages import DESIGNER, check_rewards, grpo_advantages, token_advantages

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
            kernels = triton_kernels("grpo_advantage")
            tile = segments.tile
            n_tiles = cdiv(n_sorted, tile)
            parts = torch.empty(n_tiles * 8, dtype=torch.float64, device=rewards.device)  # read only across tiles
            num_warps = tile_warps(tile)
            if segments.crossing:
                launch("grpo_advantage.crossing", kernels.crossing_parts_kernel, (n_tiles,), rewards, segments.order,
                       segments.seg, segments.offsets, parts, n_sorted, TILE=tile, num_warps=num_warps)
            n_cols = 0 if loss_mask is None else loss_mask.shape[1]
            launch("grpo_advantage.forward", kernels.grpo_advantage_kernel,
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
            launch("grpo_advantage.backward", triton_kernels("grpo_advantage").grpo_advantage_grad_kernel,
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
    if too_wide or kernel_for("grpo_advantage", "grpo_advantage_kernel", rewards, use_kernels) is None:
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

    kernels = triton_kernels("grpo_advantage")

    ids = {"order_ptr": "*i32:16", "seg_ptr": "*i32:16", "offsets_ptr": "*i32:16"}
    forward = {"rewards_ptr": "*fp32:16", **ids, "seg_designer_ptr": "*i8:16", "parts_ptr": "*fp64:16",
               "params_ptr": "*fp64:16", "out_ptr": "*fp32:16", "mask_ptr": "*i1:16", "tokens_out_ptr": "*fp32:16",
               "n_sorted": "i32", "n_cols": "i32", "mask_stride": "i32", "tokens_stride": "i32",
               "STD_NORMALIZE": "constexpr", "TILE": "constexpr", "BLOCK_R": "constexpr", "BLOCK_W": "constexpr",
               "BLOCK_L": "constexpr"}
    meta = {"STD_NORMALIZE": True, "TILE": TILE, "BLOCK_R": BLOCK_R, "BLOCK_W": BLOCK_W, "BLOCK_L": BLOCK_L}
    warps = tile_warps(TILE)
    return [
        AotSpec("grpo_advantage.crossing", kernels.crossing_parts_kernel,
                {"rewards_ptr": "*fp32:16", "order_ptr": "*i32:16", "seg_ptr": "*i32:16", "offsets_ptr": "*i32:16",
                 "parts_ptr": "*fp64:16", "n_sorted": "i32", "TILE": "constexpr"}, {"TILE": TILE}, warps,
                f"TILE={TILE}"),
        AotSpec("grpo_advantage.forward", kernels.grpo_advantage_kernel, forward, meta, warps,
                f"TILE={TILE}, token tile {BLOCK_W}x{BLOCK_L}"),
        AotSpec("grpo_advantage.forward_samples", kernels.grpo_advantage_kernel, forward,
                {**meta, "mask_ptr": None, "tokens_out_ptr": None}, warps, f"TILE={TILE}, no token broadcast"),
        AotSpec("grpo_advantage.backward", kernels.grpo_advantage_grad_kernel,
                {"rewards_ptr": "*fp32:16", "seg_designer_ptr": "*i8:16", "order_ptr": "*i32:16",
                 "offsets_ptr": "*i32:16",
                 "params_ptr": "*fp64:16", "grad_out_ptr": "*fp64:16", "grad_in_ptr": "*fp32:16",
                 "STD_NORMALIZE": "constexpr", "BLOCK": "constexpr"},
                {"STD_NORMALIZE": True, "BLOCK": BLOCK_S}, 4, f"BLOCK={BLOCK_S}"),
    ]
