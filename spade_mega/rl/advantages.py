"""Per-role GRPO advantages, the plain-torch reference the fused Triton kernel is checked against.

- Agent samples are normalised within their environment's group of rollouts: ``(r - mean) / (std + eps)``, the std
  being the unbiased (Bessel) one, as in GRPO, verl and slime; ``std_normalize=False`` keeps only the centring
  (Dr. GRPO).
- Designer samples are centred within their skill and multiplied by ``designer_scale`` (``env_reward_scale``); never
  divided by a std, because a skill holds only a handful of designer samples per update and their std blows up.
- A group of one, or a group whose rewards are all equal, gives exactly 0 (never NaN): there is nothing to compare.
- Rows with ``valid = False`` (a masked designer sample) get 0 and do not count in their group's statistics.

Statistics are computed in float64 on the (small) per-sample vector; the result has the rewards' floating dtype.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch

AGENT = 0
DESIGNER = 1
MAX_ABS_REWARD = 1e6  # SPADE rewards are bounded (clipped returns, penalties in [-1, 0]); larger means a bug upstream


def ids_of(labels: Sequence[Hashable]) -> torch.Tensor:
    """Integer ids for labels (environment ids, skill names), numbered by first appearance."""
    index: dict[Hashable, int] = {}
    return torch.tensor([index.setdefault(label, len(index)) for label in labels], dtype=torch.long)


def check_rewards(rewards: torch.Tensor) -> None:
    """Refuse rewards that would make advantages meaningless (wrong shape, NaN or inf), naming the rows."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [samples], got shape {tuple(rewards.shape)}")
    if rewards.numel() and not torch.isfinite(rewards).all():
        raise ValueError(f"rewards must be finite; got non-finite values at rows "
                         f"{torch.nonzero(~torch.isfinite(rewards)).flatten()[:8].tolist()}")
    if rewards.numel() and rewards.abs().max() > MAX_ABS_REWARD:
        raise ValueError(f"rewards must lie within +-{MAX_ABS_REWARD:g}, got {rewards.abs().max().item():g}")


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    roles: torch.Tensor,
    skill_ids: torch.Tensor,
    designer_scale: float,
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
    valid: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Advantages of a mixed batch, one per sample: the single op the Triton kernel fuses.

    ``rewards`` [N] float; ``group_ids`` [N] int (environment group, used for agent rows); ``roles`` [N] int
    (:data:`AGENT` or :data:`DESIGNER`); ``skill_ids`` [N] int (used for designer rows); ``valid`` [N] bool or None.
    Agent rows are grouped by ``group_ids``, designer rows by ``skill_ids``; the two roles never share a group.
    """
    check_rewards(rewards)
    n = rewards.shape[0]
    for name, t in (("group_ids", group_ids), ("roles", roles), ("skill_ids", skill_ids)):
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},) like rewards, got {tuple(t.shape)}")
    if n and not ((roles == AGENT) | (roles == DESIGNER)).all():
        raise ValueError(f"roles must be {AGENT} (agent) or {DESIGNER} (designer)")
    if not (designer_scale >= 0.0 and designer_scale < float("inf")):
        raise ValueError(f"designer_scale must be a finite number >= 0, got {designer_scale!r}")
    if valid is None:
        valid = torch.ones(n, dtype=torch.bool, device=rewards.device)
    elif valid.shape != (n,):
        raise ValueError(f"valid must have shape ({n},) like rewards, got {tuple(valid.shape)}")

    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    out = torch.zeros(n, dtype=torch.float64, device=rewards.device)
    rows = torch.nonzero(valid.bool()).flatten()
    if rows.numel() == 0:
        return out.to(out_dtype)

    r = rewards[rows].to(torch.float64)
    is_designer = roles[rows] == DESIGNER
    key = torch.where(is_designer, skill_ids[rows], group_ids[rows]).long()
    _, seg = torch.unique(torch.stack([is_designer.long(), key]), dim=1, return_inverse=True)
    num = int(seg.max()) + 1
    zeros = torch.zeros(num, dtype=torch.float64, device=r.device)

    count = zeros.index_add(0, seg, torch.ones_like(r))
    centred = r - (zeros.index_add(0, seg, r) / count)[seg]
    hi = zeros.scatter_reduce(0, seg, r, "amax", include_self=False)
    lo = zeros.scatter_reduce(0, seg, r, "amin", include_self=False)
    centred = torch.where((hi == lo)[seg], torch.zeros_like(centred), centred)  # exact 0, not a rounding residue

    if std_normalize:
        var = zeros.index_add(0, seg, centred * centred) / (count - 1.0).clamp(min=1.0)
        denom = var.sqrt()[seg] + eps
        agent = centred / torch.where(denom > 0, denom, torch.ones_like(denom))  # eps = 0 and a constant group
    else:
        agent = centred
    out[rows] = torch.where(is_designer, centred * designer_scale, agent)
    return out.to(out_dtype)


def agent_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, std_normalize: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Agent advantages: normalised within each environment's group of rollouts."""
    roles = torch.full_like(group_ids, AGENT)
    return grpo_advantages(rewards, group_ids, roles, group_ids, 0.0, std_normalize=std_normalize, eps=eps)


def designer_advantages(rewards: torch.Tensor, skill_ids: torch.Tensor, scale: float, *,
                        valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Designer advantages: centred within each skill, times ``scale`` (``env_reward_scale``); masked rows get 0."""
    roles = torch.full_like(skill_ids, DESIGNER)
    return grpo_advantages(rewards, skill_ids, roles, skill_ids, scale, valid=valid)


def token_advantages(advantages: torch.Tensor, loss_mask: torch.Tensor,
                     sample_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Broadcast per-sample advantages to tokens; tokens outside the loss mask get 0.

    ``loss_mask`` is [batch, tokens] (row i is sample i), or packed [tokens] with ``sample_ids`` [tokens] giving each
    token's sample as its position in ``advantages`` (padding outside the mask may carry any id). In multi-turn
    episodes the mask covers only the model's own tokens: the environment's observations (and the prompt) are
    context, never trained on.
    """
    if loss_mask.dim() == 2:
        if sample_ids is not None:
            raise ValueError("sample_ids is only for packed (1-D) loss masks")
        if loss_mask.shape[0] != advantages.shape[0]:
            raise ValueError(f"loss_mask has {loss_mask.shape[0]} rows but there are {advantages.shape[0]} advantages")
        per_token = advantages[:, None].expand(loss_mask.shape)
    elif loss_mask.dim() == 1:
        if sample_ids is None or sample_ids.shape != loss_mask.shape:
            raise ValueError("a packed (1-D) loss_mask needs sample_ids of the same shape")
        live, ids = loss_mask.bool(), sample_ids.long()
        n = advantages.shape[0]
        bad = live & ((ids < 0) | (ids >= n))
        if bad.any():
            raise ValueError(f"sample_ids on loss tokens must be positions in advantages (0..{n - 1}), got "
                             f"{ids[bad].unique()[:8].tolist()}")
        if n == 0:  # nothing to train on: every token is outside the mask
            return torch.zeros(loss_mask.shape, dtype=advantages.dtype, device=advantages.device)
        per_token = advantages[torch.where(live, ids, torch.zeros_like(ids))]
    else:
        raise ValueError(f"loss_mask must be [batch, tokens] or packed [tokens], got shape {tuple(loss_mask.shape)}")
    return torch.where(loss_mask.bool(), per_token, torch.zeros_like(per_token))
