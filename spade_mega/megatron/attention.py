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

Context parallelism (which Megatron's local attention refuses: only Transformer Engine's has it) comes as the packed
THD layout, ``packed_seq_params`` with the row's segment boundaries: each CP rank holds chunks ``r`` and
``2*CP-1-r`` of every segment (:meth:`spade_mega.megatron.batch.MicroBatch.context_shard`), its queries and keys
already rotated at their positions in the segment (Megatron's THD RoPE). Keys and values are all-gathered over the
CP group (Megatron's sequence-parallel gather with the CP group: its backward reduce-scatters their gradients back to
the rank that owns them), put back in row order, and each segment's local queries attend causally to the segment's
keys by their positions in it. Every rank holds all keys for a moment (no ring): simple and exact, for the CPU path.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
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


def context_order(bounds: list[int], size: int) -> torch.Tensor:
    """For each row position, its index in the concatenation of the ``size`` context-parallel shards (rank 0's
    positions, then rank 1's, ...): what puts all-gathered keys back in row order."""
    local = bounds[-1] // size
    order = torch.empty(bounds[-1], dtype=torch.long)
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = (end - start) // (2 * size)
        at = start // size  # the segment's offset in every rank's shard
        for k in range(2 * size):
            rank, second = (k, 0) if k < size else (2 * size - 1 - k, chunk)
            order[start + k * chunk:start + (k + 1) * chunk] = \
                torch.arange(chunk) + rank * local + at + second
    return order


class PackedSegmentAttention(DotProductAttention):
    """``DotProductAttention`` computed per segment of a packed row when the mask allows it, and over
    context-parallel ranks for the packed THD layout (see the module)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        # Megatron's local attention asserts context_parallel_size == 1 (only TE's has CP); this one has it
        single = copy.copy(config)
        single.context_parallel_size = 1
        super().__init__(single, *args, **kwargs)
        self.config = config

    def _plain(self) -> bool:
        """No dropout, softmax offset, layer scaling or window: what the per-segment computation reproduces."""
        return not (self.training and self.config.attention_dropout > 0 or self.config.apply_query_key_layer_scaling
                    or self.config.softmax_type != "vanilla" or self.config.window_size is not None)

    def _bounds(self, query: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> Optional[list[int]]:
        if attention_mask is None or query.size(1) != 1 or not self._plain():
            return None
        if not hasattr(attention_mask, _BOUNDS):
            setattr(attention_mask, _BOUNDS, segment_bounds(attention_mask))
        bounds = getattr(attention_mask, _BOUNDS)
        return bounds if bounds is not None and bounds[-1] == query.size(0) else None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Any = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        bounds = self._bounds(query, attention_mask) if attention_bias is None else None
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

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any) -> torch.Tensor:
        """THD inputs ([t, heads, dim], this CP rank's shard of the row): causal attention per segment, keys and
        values gathered over the context-parallel group."""
        if params.qkv_format != "thd" or not self._plain():
            raise ValueError("the local attention takes packed_seq_params only as the trainer builds them: THD, "
                             "without attention dropout, softmax offset, layer scaling or a window")
        padded = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        bounds = padded.tolist()
        size = ps.get_context_parallel_world_size()
        rank = ps.get_context_parallel_rank()
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if size > 1:
            cp_group = ps.get_context_parallel_group()
            order = context_order(bounds, size).to(key.device)
            key = gather_from_sequence_parallel_region(key, True, cp_group).index_select(0, order)
            value = gather_from_sequence_parallel_region(value, True, cp_group).index_select(0, order)
        # [t, heads, dim] -> [1, heads, t, dim]; query groups shared as Megatron's repeat_interleave does
        q = query.permute(1, 0, 2)[None]
        k = key.repeat_interleave(groups, dim=1).permute(1, 0, 2)[None]
        v = value.repeat_interleave(groups, dim=1).permute(1, 0, 2)[None]
        parts = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            # this rank's queries of the segment (all of it, or chunks rank and 2*size-1-rank): positions in it
            chunk = (end - start) // (2 * size)
            positions = torch.arange(end - start) if size == 1 else \
                torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                           torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)])
            at = start // size
            visible = torch.arange(end - start)[None, :] <= positions[:, None]
            parts.append(F.scaled_dot_product_attention(q[:, :, at:at + positions.numel()], k[:, :, start:end],
                                                        v[:, :, start:end], attn_mask=visible.to(q.device),
                                                        scale=self.softmax_scale))
        context = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        # [1, heads, t, dim] -> [t, heads * dim]
        return context[0].permute(1, 0, 2).reshape(query.size(0), self.hidden_size_per_partition)
