"""Fused per-role GRPO advantages: rewards -> per-sample (and optionally per-token) advantages in one launch.

The specification is ``spade_mega.rl.advantages.grpo_advantages`` (the reference this op falls back to): agent samples
are normalised within their environment group, ``(r - mean) / (std + eps)`` with the unbiased std (or only centred,
``std_normalize=False``); designer samples are centred within their skill and multiplied by ``designer_scale``; a group
of one or of equal rewards gives exactly 0; rows with ``valid = False`` get 0 and do not count. Statistics are float64.

How: the host sorts the valid samples by (role, group-or-skill) once (a stable sort, so the order, and with it every
floating-point sum, is deterministic) and hands the kernel the permutation and segment offsets. One program per segment
then makes three passes over its samples (mean and range, second moment, write), all segment sizes and counts alike, and
with a ``[samples, tokens]`` loss mask writes the per-token advantages in the same launch, so the advantages never make
a round trip through memory before the broadcast. The backward kernel (the op is a ``torch.autograd.Function``) uses
the same segments.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from spade_mega.kernels.dispatch import launch, use_kernel
from spade_mega.rl.advantages import DESIGNER, check_rewards, grpo_advantages, token_advantages

BLOCK_S = 128  # samples per step of a segment's statistics loops; SPADE groups hold 16
BLOCK_W = 8  # samples per step of the write loop with a token broadcast: an [8, 128] tile is 8 values a thread
# (72 registers); without one the write loop steps BLOCK_S samples at a time
BLOCK_L = 128  # tokens per step when broadcasting to [samples, tokens]


class GrpoAdvantages(NamedTuple):
    samples: torch.Tensor  # [N] per-sample advantages
    tokens: Optional[torch.Tensor]  # [N, L] per-token advantages (0 outside the loss mask), when a loss mask was given


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
def _grpo_advantage_kernel(rewards_ptr, roles_ptr, order_ptr, offsets_ptr, params_ptr, out_ptr, mask_ptr,
                           tokens_out_ptr, n_cols, mask_stride, tokens_stride, STD_NORMALIZE: tl.constexpr,
                           BLOCK: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_L: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(offsets_ptr + seg)
    end = tl.load(offsets_ptr + seg + 1)
    designer = tl.load(roles_ptr + tl.load(order_ptr + start)) == 1
    designer_scale = tl.load(params_ptr)
    eps = tl.load(params_ptr + 1)
    mean, flat = _segment_mean(rewards_ptr, order_ptr, start, end, BLOCK)
    factor = tl.where(designer, designer_scale, 1.0)  # advantage = (r - mean) * factor
    if STD_NORMALIZE:
        m2, _, _ = _segment_scale(rewards_ptr, rewards_ptr, order_ptr, start, end, mean, False, BLOCK)
        var = m2 / tl.maximum((end - start).to(tl.float64) - 1.0, 1.0)
        factor = tl.where(designer, factor, 1.0 / (tl.sqrt(var) + eps))
    factor = tl.where(flat, 0.0, factor)
    for pos in range(start, end, BLOCK_W):
        offs = pos + tl.arange(0, BLOCK_W)
        inb = offs < end
        idx = tl.load(order_ptr + offs, mask=inb, other=0)
        adv = (tl.load(rewards_ptr + idx, mask=inb, other=0).to(tl.float64) - mean) * factor
        adv = _narrow(adv, out_ptr.dtype.element_ty)
        tl.store(out_ptr + idx, adv, mask=inb)
        if mask_ptr is not None:
            for col in range(0, n_cols, BLOCK_L):
                cols = col + tl.arange(0, BLOCK_L)
                inside = inb[:, None] & (cols < n_cols)[None, :]
                keep = tl.load(mask_ptr + idx[:, None] * mask_stride + cols[None, :], mask=inside, other=0) != 0
                tl.store(tokens_out_ptr + idx[:, None] * tokens_stride + cols[None, :],
                         tl.where(keep, adv[:, None], 0.0).to(tokens_out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _grpo_advantage_grad_kernel(rewards_ptr, roles_ptr, order_ptr, offsets_ptr, params_ptr, grad_out_ptr,
                                grad_in_ptr, STD_NORMALIZE: tl.constexpr, BLOCK: tl.constexpr):
    """d/dr of the segment's advantages: centring is its own adjoint; the std adds -c * sum(g c) / (d^2 s (n-1))."""
    seg = tl.program_id(0)
    start = tl.load(offsets_ptr + seg)
    end = tl.load(offsets_ptr + seg + 1)
    count = (end - start).to(tl.float64)
    designer = tl.load(roles_ptr + tl.load(order_ptr + start)) == 1
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


class _Segments(NamedTuple):
    order: torch.Tensor  # valid rows sorted by (role, group-or-skill), stable
    offsets: torch.Tensor  # [segments + 1] into ``order``
    all_valid: bool


def _segments(group_ids: torch.Tensor, roles: torch.Tensor, skill_ids: torch.Tensor,
              valid: Optional[torch.Tensor]) -> _Segments:
    rows = torch.arange(roles.shape[0], device=roles.device) if valid is None else torch.nonzero(valid).flatten()
    designer = roles[rows] == DESIGNER
    key = torch.where(designer, skill_ids[rows], group_ids[rows]).long() * 2 + designer.long()
    key, perm = torch.sort(key, stable=True)
    starts = torch.nonzero(key[1:] != key[:-1]).flatten() + 1
    edges = torch.tensor([0, key.numel()], device=key.device)
    offsets = torch.cat([edges[:1], starts, edges[1:]]) if key.numel() else edges[:1]
    return _Segments(rows[perm].contiguous(), offsets.contiguous(), valid is None or rows.numel() == roles.shape[0])


class GrpoAdvantageFunction(torch.autograd.Function):
    """Per-sample and per-token advantages, differentiable with respect to the rewards."""

    @staticmethod
    def forward(ctx, rewards, roles, segments, params, loss_mask, std_normalize, out_dtype):
        n = rewards.shape[0]
        alloc = torch.empty if segments.all_valid else torch.zeros  # invalid rows are never written: 0
        out = alloc(n, dtype=out_dtype, device=rewards.device)
        tokens = alloc(loss_mask.shape, dtype=out_dtype, device=rewards.device) if loss_mask is not None else None
        n_segments = segments.offsets.numel() - 1
        if n_segments:
            launch("grpo_advantage.forward", _grpo_advantage_kernel, (n_segments,), rewards, roles, segments.order,
                   segments.offsets, params, out, loss_mask, tokens, 0 if loss_mask is None else loss_mask.shape[1],
                   0 if loss_mask is None else loss_mask.stride(0), 0 if tokens is None else tokens.stride(0),
                   STD_NORMALIZE=std_normalize, BLOCK=BLOCK_S, BLOCK_W=BLOCK_S if loss_mask is None else BLOCK_W,
                   BLOCK_L=BLOCK_L, num_warps=4)
        ctx.save_for_backward(rewards, roles, segments.order, segments.offsets, params, loss_mask)
        ctx.std_normalize = std_normalize
        if tokens is None:
            return out, torch.empty(0, dtype=out_dtype, device=rewards.device)
        return out, tokens

    @staticmethod
    def backward(ctx, grad_samples, grad_tokens):
        rewards, roles, order, offsets, params, loss_mask = ctx.saved_tensors
        grad = grad_samples.double()
        if loss_mask is not None:
            grad = grad + torch.where(loss_mask, grad_tokens.double(), 0.0).sum(dim=1)
        grad_rewards = torch.zeros_like(rewards)
        if offsets.numel() > 1:
            launch("grpo_advantage.backward", _grpo_advantage_grad_kernel, (offsets.numel() - 1,), rewards, roles,
                   order, offsets, params, grad.contiguous(), grad_rewards, STD_NORMALIZE=ctx.std_normalize,
                   BLOCK=BLOCK_S, num_warps=4)
        return grad_rewards, None, None, None, None, None, None


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
                   use_kernels: bool = True) -> GrpoAdvantages:
    """``rl.advantages.grpo_advantages`` (same arguments), plus with ``loss_mask [N, L]`` (row i = sample i) the
    per-token advantages of ``rl.advantages.token_advantages`` from the same launch. ``use_kernels=False``
    (``kernels.enabled: false``) runs the reference."""
    if not use_kernel(_grpo_advantage_kernel, rewards, use_kernels):
        samples = grpo_advantages(rewards, group_ids, roles, skill_ids, designer_scale, std_normalize=std_normalize,
                                  eps=eps, valid=valid)
        return GrpoAdvantages(samples, None if loss_mask is None else token_advantages(samples, loss_mask))
    _check(rewards, group_ids, roles, skill_ids, designer_scale, valid, loss_mask)
    segments = _segments(group_ids, roles, skill_ids, None if valid is None else valid.bool())
    params = torch.tensor([designer_scale, eps], dtype=torch.float64, device=rewards.device)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    mask = None if loss_mask is None else loss_mask.bool().contiguous()
    samples, tokens = GrpoAdvantageFunction.apply(rewards.contiguous(), roles.contiguous(), segments, params, mask,
                                                  std_normalize, out_dtype)
    return GrpoAdvantages(samples, tokens if loss_mask is not None else None)


def aot_specs() -> list:
    """The launches ``spade_mega.kernels.aot`` compiles for sm_90: fp32 rewards, int64 ids, bool loss mask."""
    from spade_mega.kernels.aot import AotSpec

    common = {"rewards_ptr": "*fp32:16", "roles_ptr": "*i64:16", "order_ptr": "*i64:16", "offsets_ptr": "*i64:16",
              "params_ptr": "*fp64:16"}
    forward = {**common, "out_ptr": "*fp32:16", "mask_ptr": "*i1:16", "tokens_out_ptr": "*fp32:16", "n_cols": "i32",
               "mask_stride": "i32", "tokens_stride": "i32", "STD_NORMALIZE": "constexpr", "BLOCK": "constexpr",
               "BLOCK_W": "constexpr", "BLOCK_L": "constexpr"}
    return [
        AotSpec("grpo_advantage.forward", _grpo_advantage_kernel, forward,
                {"STD_NORMALIZE": True, "BLOCK": BLOCK_S, "BLOCK_W": BLOCK_W, "BLOCK_L": BLOCK_L}, 4,
                f"BLOCK={BLOCK_S}, token tile {BLOCK_W}x{BLOCK_L}"),
        AotSpec("grpo_advantage.forward_samples", _grpo_advantage_kernel, forward,
                {"STD_NORMALIZE": True, "BLOCK": BLOCK_S, "BLOCK_W": BLOCK_S, "BLOCK_L": BLOCK_L,
                 "mask_ptr": None, "tokens_out_ptr": None}, 4, f"BLOCK={BLOCK_S}, no token broadcast"),
        AotSpec("grpo_advantage.backward", _grpo_advantage_grad_kernel,
                {**common, "grad_out_ptr": "*fp64:16", "grad_in_ptr": "*fp32:16", "STD_NORMALIZE": "constexpr",
                 "BLOCK": "constexpr"},
                {"STD_NORMALIZE": True, "BLOCK": BLOCK_S}, 4, f"BLOCK={BLOCK_S}"),
    ]
