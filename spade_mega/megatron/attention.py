"""Core attention of the local (torch) layers: per packed segment, through torch's fused attention.

Megatron's local ``DotProductAttention`` materialises the full [heads, L, L] score matrix of a packed row, masks it
with the block-diagonal causal mask the trainer gives (:meth:`spade_mega.megatron.batch.MicroBatch.attention_mask`)
and backpropagates through the softmax of all of it. On a 4k-token row that is most of a CPU train step (measured:
~90% of a step of the tiny demo model, almost all in attention's backward). The same attention, computed segment by
segment with ``scaled_dot_product_attention(is_causal=True)``, never forms the scores (flash kernel on CPU), skips the
masked upper triangle and every cross-segment block, and gives the same values up to float rounding.

The fast path is taken only for the mask it is exactly equivalent to: batch 1, no dropout, no softmax offset or
layer scaling, and a boolean mask that is causal within segments and masks everything across them (checked once
per mask tensor). Anything else goes to Megatron's implementation unchanged.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

_BOUNDS = "_spade_segment_bounds"  # cached on the mask tensor: every layer of a forward gets the same one


def segment_bounds(mask: torch.Tensor) -> Optional[list[int]]:
    """Segment boundaries [0, ..., L] when ``mask`` ([1, 1, L, L] bool, True = masked) is block-diagonal causal,
    else None. A segment starts where a position cannot see its predecessor."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[:2] != (1, 1) or mask.shape[2] != mask.shape[3]:
        return None
    m = mask[0, 0]
    length = m.shape[0]
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=m.device), m.diagonal(-1)]).nonzero()[:, 0]
    bounds = starts.tolist() + [length]
    seg = torch.repeat_interleave(torch.arange(len(bounds) - 1, device=m.device),
                                  torch.diff(torch.tensor(bounds, device=m.device)))
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(length, length, dtype=torch.bool, device=m.device).tril()
    return bounds if torch.equal(m, ~allowed) else None


class PackedSegmentAttention(DotProductAttention):
    """``DotProductAttention`` computed per segment of a packed row when the mask allows it (see the module)."""

    def _bounds(self, query: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> Optional[list[int]]:
        if (attention_mask is None or query.size(1) != 1 or self.training and self.config.attention_dropout > 0
                or self.config.apply_query_key_layer_scaling or self.config.softmax_type != "vanilla"
                or self.config.window_size is not None):
            return None
        if not hasattr(attention_mask, _BOUNDS):
            setattr(attention_mask, _BOUNDS, segment_bounds(attention_mask))
        bounds = getattr(attention_mask, _BOUNDS)
        return bounds if bounds is not None and bounds[-1] == query.size(0) else None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Any = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params: Any = None) -> torch.Tensor:
        bounds = self._bounds(query, attention_mask) if attention_bias is None and packed_seq_params is None else None
        if bounds is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        # [s, 1, heads, dim] -> [1, heads, s, dim]; query groups shared as Megatron's repeat_interleave does
        q = query.permute(1, 2, 0, 3)
        k = key.repeat_interleave(groups, dim=2).permute(1, 2, 0, 3)
        v = value.repeat_interleave(groups, dim=2).permute(1, 2, 0, 3)
        parts = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                                scale=self.softmax_scale)
                 for a, b in zip(bounds[:-1], bounds[1:])]
        context = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        # [1, heads, s, dim] -> [s, 1, heads * dim]
        return context.permute(2, 0, 1, 3).reshape(query.size(0), 1, self.hidden_size_per_partition)
