"""Training samples and their packing into micro-batches by a token budget.

A :class:`TrainSample` is one trajectory of either role, all turns in one token sequence (prompt, the model's turns,
the environment's observations). Per-token values are aligned with ``tokens``: ``x[t]`` belongs to token ``t``,
predicted from ``tokens[:t]``, so ``loss_mask[0]`` is always false. Only the model's own tokens are in the loss mask.

Packing (:func:`pack`) is deterministic and needs no communication: every rank is given the same global batch and
computes the same plan. Samples are spread over data-parallel ranks balancing tokens, then packed first-fit-decreasing
into rows of at most ``token_budget`` tokens. A row holds whole samples back to back; attention never crosses a sample
boundary (a block-diagonal causal mask on the local spec, ``cu_seqlens`` for Transformer Engine). Every data-parallel
rank runs the same number of micro-batches (expert-parallel all-to-alls span data-parallel ranks); ranks with fewer
get empty ones. Row lengths are padded to what sequence / context parallelism need; pipeline stages exchange each
micro-batch's shape, except under the interleaved (virtual-stage) schedule, whose rows all get one length. Padding
is marked (``sample_ids == -1``, :attr:`MicroBatch.padding_mask`) so that the MoE routers count real tokens only.

Context parallelism (CP ranks share each row): every segment of a row (a sample, then the row's padding) is padded
to a multiple of 2*CP, and each CP rank holds chunks ``r`` and ``2*CP-1-r`` of every segment
(:meth:`MicroBatch.context_shard`): the load-balanced split that Transformer Engine's THD attention and Megatron's THD
RoPE expect (``thd_get_partitioned_indices``), equal causal work on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence

import torch

from spade_mega.errors import SpadeError

Role = Literal["agent", "designer"]
ROLES: tuple[Role, ...] = ("agent", "designer")


class BatchError(SpadeError):
    """A training sample or batch that cannot be trained on (the message names the sample and the field)."""


def _tensor(value: Any, name: str, index: Optional[int]) -> torch.Tensor:
    """``value`` as a CPU tensor; what torch cannot convert (None, text, ragged lists) is named by sample and field."""
    try:
        return torch.as_tensor(value).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as exc:
        where = f"sample {index}: " if index is not None else ""
        kind = "None" if value is None else type(value).__name__
        raise BatchError(f"{where}{name} must be a sequence of numbers, got {kind} ({exc})") from None


def _as_1d(value: Any, dtype: torch.dtype, name: str, index: Optional[int]) -> torch.Tensor:
    tensor = _tensor(value, name, index)
    if tensor.dim() != 1:
        where = f"sample {index}: " if index is not None else ""
        raise BatchError(f"{where}{name} must be 1-D (one value per token), got shape {tuple(tensor.shape)}")
    return tensor.to(dtype)


@dataclass
class TrainSample:
    """One trajectory for the GRPO step. ``old_logprobs`` (the trainer's own log-probs before the update) are
    computed by the trainer with a no-grad forward when None; ``rollout_logprobs`` are the behaviour policy's, as the
    inference engine reported them (delayed designer samples: the policy of several steps ago), for truncated IS;
    ``ref_logprobs`` the reference policy's (``rl.kl_coef > 0``), computed by the trainer when None. ``routing``
    (``rl.routing_replay``): the experts the old policy routed each token to, [tokens, MoE layers of this rank's
    pipeline stage, top-k] integers, which the train steps replay; recorded by :meth:`Trainer.old_policy`."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    role: Role = "agent"
    rollout_logprobs: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    index: Optional[int] = field(default=None, compare=False)  # position in its batch, for error messages
    ref_logprobs: Optional[torch.Tensor] = None
    routing: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        i = self.index
        tokens = _tensor(self.tokens, "tokens", i)
        # a cast would truncate 2.7 to token 2, or make a mask passed as tokens into tokens 0 and 1, silently
        if tokens.numel() and (tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool):
            raise BatchError(f"{'' if i is None else f'sample {i}: '}tokens must be integer token ids, got "
                             f"{tokens.dtype}")
        self.tokens = _as_1d(tokens, torch.long, "tokens", i)
        self.loss_mask = _as_1d(self.loss_mask, torch.bool, "loss_mask", i)
        self.advantages = _as_1d(self.advantages, torch.float32, "advantages", i)
        n = self.tokens.numel()
        where = f"sample {i}: " if i is not None else ""
        if n < 2:
            raise BatchError(f"{where}needs at least 2 tokens (a prompt token and a generated one), got {n}")
        if self.role not in ROLES:
            raise BatchError(f"{where}role must be one of {ROLES}, got {self.role!r}")
        for name in ("loss_mask", "advantages", "rollout_logprobs", "old_logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            value = _as_1d(value, torch.bool if name == "loss_mask" else torch.float32, name, i)
            if value.numel() != n:
                raise BatchError(f"{where}{name} has {value.numel()} values for {n} tokens")
            setattr(self, name, value)
        if self.routing is not None:
            routing = _tensor(self.routing, "routing", i)
            if routing.dim() != 3 or routing.shape[0] != n or routing.is_floating_point() or \
                    routing.dtype == torch.bool:
                raise BatchError(f"{where}routing must be integer expert indices [tokens ({n}), MoE layers, top-k], "
                                 f"got {routing.dtype} of shape {tuple(routing.shape)}")
            # a step takes -1 for padding (the router's own choice); uint8, what old_policy records, holds none
            if routing.dtype.is_signed and routing.numel() and int(routing.min()) < 0:
                raise BatchError(f"{where}routing must be integer expert indices, each >= 0, got {int(routing.min())}")
            self.routing = routing
        if self.loss_mask[0]:
            raise BatchError(f"{where}loss_mask[0] is true, but the first token has no prefix to predict it from")
        if int(self.tokens.min()) < 0:
            raise BatchError(f"{where}tokens must be >= 0")
        for name in ("advantages", "rollout_logprobs", "old_logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and not bool(torch.isfinite(value[self.loss_mask]).all()):
                raise BatchError(f"{where}{name} is not finite on a loss-mask token")

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def samples_from(records: Sequence[TrainSample]) -> list[TrainSample]:
    """Copy a batch, numbering each sample (its ``index``) by position."""
    if isinstance(records, TrainSample):
        raise BatchError("the batch must be a sequence of TrainSample, got one TrainSample (put it in a list)")
    if not records:
        raise BatchError("the batch is empty")
    for i, s in enumerate(records):
        if not isinstance(s, TrainSample):
            raise BatchError(f"batch item {i} is a {type(s).__name__}, not a TrainSample")
    return [TrainSample(s.tokens, s.loss_mask, s.advantages, s.role, s.rollout_logprobs, s.old_logprobs, index=i,
                        ref_logprobs=s.ref_logprobs, routing=s.routing) for i, s in enumerate(records)]


@dataclass
class MicroBatch:
    """One packed row, shapes [1, L]. ``labels[t] = tokens[t + 1]`` within a sample; per-token values are shifted
    the same way (position t carries the values of the token it predicts). ``sample_ids`` is -1 on padding."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor  # 0 where a sample has none (the trainer passes them to the loss only with rl.kl_coef)
    rollout_logprobs: Optional[torch.Tensor]
    sample_ids: torch.Tensor
    cu_seqlens: torch.Tensor  # segment boundaries in the whole row (samples with their padding, then padding), int32
    samples: list[int]  # indices in the global batch, in row order
    seqlens: list[int]  # tokens of each segment that are not its padding (a sample's length; the row's padding: all)
    row_index: Optional[torch.Tensor] = None  # a context-parallel shard: its positions in the whole row

    @property
    def length(self) -> int:
        """Positions this (shard of a) row holds."""
        return self.tokens.shape[1]

    @property
    def row_length(self) -> int:
        """Positions of the whole row (all context-parallel shards)."""
        return int(self.cu_seqlens[-1])

    def context_shard(self, rank: int, size: int) -> MicroBatch:
        """Context-parallel rank ``rank``'s part of the row: chunks ``rank`` and ``2*size-1-rank`` of each of the
        2*size equal chunks of every segment (segments are padded to a multiple of 2*size by :func:`pack`). The
        segment description (``cu_seqlens``, ``seqlens``, ``samples``) stays the whole row's."""
        if size == 1:
            return self
        if self.row_index is not None:
            raise ValueError("a context-parallel shard cannot be split again")
        bounds = self.cu_seqlens.tolist()
        parts = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if (end - start) % (2 * size):
                raise ValueError(f"segment [{start}, {end}) is not a multiple of 2 x {size} context-parallel ranks")
            chunk = (end - start) // (2 * size)
            for k in (rank, 2 * size - 1 - rank):
                parts.append(torch.arange(start + k * chunk, start + (k + 1) * chunk))
        index = torch.cat(parts)

        def take(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t[:, index]

        return MicroBatch(tokens=take(self.tokens), position_ids=take(self.position_ids), labels=take(self.labels),
                          loss_mask=take(self.loss_mask), advantages=take(self.advantages),
                          old_logprobs=take(self.old_logprobs), ref_logprobs=take(self.ref_logprobs),
                          rollout_logprobs=take(self.rollout_logprobs),
                          sample_ids=take(self.sample_ids), cu_seqlens=self.cu_seqlens, samples=self.samples,
                          seqlens=self.seqlens, row_index=index)

    @property
    def padding_mask(self) -> torch.Tensor:
        """[1, L] bool, True on padding: Megatron's MoE routers leave these positions out of the load-balancing
        loss (which the loss mask does not reach)."""
        return self.sample_ids < 0

    def attention_mask(self) -> torch.Tensor:
        """[1, 1, L, L] bool, True = masked: causal inside each segment, nothing across segments (whole rows)."""
        seg = torch.repeat_interleave(torch.arange(self.cu_seqlens.numel() - 1), torch.diff(self.cu_seqlens).long())
        same = seg[:, None] == seg[None, :]
        causal = torch.ones(self.length, self.length, dtype=torch.bool).tril()
        return ~(same & causal)[None, None]

    def packed_seq_params(self, device: torch.device) -> Any:
        """Transformer Engine's THD description of the row (attention per segment, RoPE restarting per segment)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        padded = self.cu_seqlens.to(device=device, dtype=torch.int32)
        longest = int(torch.diff(padded).max())
        if torch.equal(torch.diff(self.cu_seqlens), torch.tensor(self.seqlens, dtype=self.cu_seqlens.dtype)):
            return PackedSeqParams(qkv_format="thd", cu_seqlens_q=padded, cu_seqlens_kv=padded, max_seqlen_q=longest,
                                   max_seqlen_kv=longest)
        # segments padded for context parallelism: the real lengths, and where each segment starts in the row
        real = torch.tensor([0] + self.seqlens, dtype=torch.int32).cumsum(0).to(device=device, dtype=torch.int32)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
                               cu_seqlens_kv_padded=padded, max_seqlen_q=longest, max_seqlen_kv=longest)


@dataclass
class PackPlan:
    """Micro-batches per data-parallel rank (each rank runs ``micro_batches[dp_rank]``, all the same count)."""

    micro_batches: list[list[MicroBatch]]

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches[0])

    @property
    def num_real_micro_batches(self) -> int:
        """Micro-batches holding a sample, over all data-parallel ranks (the others are all padding)."""
        return sum(bool(mb.samples) for mbs in self.micro_batches for mb in mbs)


def _round_up(value: int, multiple: int) -> int:
    return max(multiple, math.ceil(value / multiple) * multiple)


def _assign_ranks(samples: Sequence[TrainSample], dp: int) -> list[list[TrainSample]]:
    load = [0] * dp
    shares: list[list[TrainSample]] = [[] for _ in range(dp)]
    for sample in sorted(samples, key=lambda s: (-len(s), s.index)):
        rank = min(range(dp), key=lambda r: (load[r], r))
        load[rank] += len(sample)
        shares[rank].append(sample)
    return shares


def _bins(samples: Sequence[TrainSample], budget: int, segment_multiple: int) -> list[list[TrainSample]]:
    bins: list[list[TrainSample]] = []
    room: list[int] = []
    for sample in sorted(samples, key=lambda s: (-len(s), s.index)):
        size = _round_up(len(sample), segment_multiple)
        for b, free in enumerate(room):
            if size <= free:
                bins[b].append(sample)
                room[b] -= size
                break
        else:
            bins.append([sample])
            room.append(budget - size)
    return [sorted(b, key=lambda s: s.index) for b in bins]


def _row(samples: Sequence[TrainSample], length: int, segment_multiple: int) -> MicroBatch:
    tokens = torch.zeros(length, dtype=torch.long)
    positions = torch.zeros(length, dtype=torch.long)
    labels = torch.zeros(length, dtype=torch.long)
    mask = torch.zeros(length, dtype=torch.bool)
    adv = torch.zeros(length)
    old = torch.zeros(length)
    ref = torch.zeros(length)
    rollout = torch.zeros(length) if any(s.rollout_logprobs is not None for s in samples) else None
    ids = torch.full((length,), -1, dtype=torch.long)
    bounds = [0]
    at = 0
    for s in samples:
        n = len(s)
        end = at + n
        tokens[at:end] = s.tokens
        positions[at:at + _round_up(n, segment_multiple)] = torch.arange(_round_up(n, segment_multiple))
        labels[at:end - 1] = s.tokens[1:]
        mask[at:end - 1] = s.loss_mask[1:]
        adv[at:end - 1] = s.advantages[1:]
        if s.old_logprobs is not None:
            old[at:end - 1] = s.old_logprobs[1:]
        if s.ref_logprobs is not None:
            ref[at:end - 1] = s.ref_logprobs[1:]
        if rollout is not None and s.rollout_logprobs is not None:  # pack() checked: all samples or none
            rollout[at:end - 1] = s.rollout_logprobs[1:]
        ids[at:end] = s.index
        at += _round_up(n, segment_multiple)  # the sample's own padding (context parallelism) is in its segment
        bounds.append(at)
    seqlens = [len(s) for s in samples]
    if at < length:
        positions[at:] = torch.arange(length - at)
        bounds.append(length)
        seqlens.append(length - at)
    return MicroBatch(tokens=tokens[None], position_ids=positions[None], labels=labels[None], loss_mask=mask[None],
                      advantages=adv[None], old_logprobs=old[None], ref_logprobs=ref[None],
                      rollout_logprobs=None if rollout is None else rollout[None], sample_ids=ids[None],
                      cu_seqlens=torch.tensor(bounds, dtype=torch.int32), samples=[s.index for s in samples],
                      seqlens=seqlens)


def row_length_multiple(tensor: int = 1, context: int = 1, sequence_parallel: bool = False) -> int:
    """What every row length must be a multiple of: 2*CP under context parallelism (each CP rank two equal chunks of
    every segment), and each CP rank's share a multiple of TP under sequence parallelism."""
    multiple = 2 * context if context > 1 else 1
    return math.lcm(multiple, context * tensor) if sequence_parallel else multiple


def row_capacity(token_budget: int, length_multiple: int = 1, context: int = 1) -> int:
    """Tokens one row holds: ``token_budget`` per rank times the ``context``-parallel ranks sharing a row, rounded
    down to the row length multiple."""
    return token_budget * context // length_multiple * length_multiple


def sample_room(length: int, context: int = 1) -> int:
    """Row positions a sample of ``length`` tokens takes: itself, padded to a multiple of 2*CP under context
    parallelism."""
    return _round_up(length, 2 * context) if context > 1 else length


def pack(samples: Sequence[TrainSample], *, token_budget: int, data_parallel: int = 1, length_multiple: int = 1,
         count_multiple: int = 1, common_length: bool = False, context: int = 1) -> PackPlan:
    """Plan the micro-batches of a global batch.

    ``token_budget`` is per rank: a row holds ``token_budget * context`` tokens, each of the ``context``-parallel
    ranks one share of it; under context parallelism every sample is padded to a multiple of 2 * ``context``
    (the load-balanced split of :meth:`MicroBatch.context_shard`). ``length_multiple``: every row length is a
    multiple of it (TP for sequence parallelism, 2*CP for context parallelism, both when both); rows stay within the
    budget padding included, so they hold at most the budget rounded down to that multiple. ``count_multiple``: the
    micro-batch count is a multiple of it (the interleaved pipeline schedule needs PP). ``common_length``: all rows
    of a rank get the longest row's length (the interleaved schedule's fixed shapes).
    """
    if not samples:
        raise BatchError("the batch is empty")
    if token_budget < 2:
        raise BatchError(f"token budget (parallel.max_tokens_per_gpu) must be >= 2, got {token_budget}")
    if context > 1 and length_multiple % (2 * context):
        raise ValueError(f"rows split over {context} context-parallel ranks need a length multiple of "
                         f"{2 * context}, got {length_multiple}")
    capacity = row_capacity(token_budget, length_multiple, context)
    limit = f"parallel.max_tokens_per_gpu = {token_budget}"
    if capacity != token_budget:
        limit = f"{capacity} = parallel.max_tokens_per_gpu ({token_budget})"
        if context > 1:
            limit += f" x parallel.context ({context})"
        if capacity != token_budget * context:
            limit += f" rounded down to a multiple of {length_multiple} (the row length multiple: parallel.tensor " \
                     "under sequence parallelism, 2 x parallel.context under context parallelism)"
    if capacity < 2:
        raise BatchError(f"the micro-batch token budget {limit} holds no sample; raise it")
    for s in samples:
        if s.index is None:
            raise BatchError("samples must be numbered: build the batch with samples_from()")
        if sample_room(len(s), context) > capacity:
            padded = f" ({sample_room(len(s), context)} padded to a multiple of 2 x parallel.context)" \
                if context > 1 else ""
            raise BatchError(f"sample {s.index} has {len(s)} tokens{padded}, more than the micro-batch token budget "
                             f"{limit}; raise it or cap the rollout length")
    missing = [s.index for s in samples if s.rollout_logprobs is None]
    if missing and len(missing) < len(samples):
        raise BatchError(f"sample {missing[0]}: rollout_logprobs missing while other samples of the batch have them "
                         "(give them for all samples or none: truncated IS needs every sample's behaviour policy)")
    segment_multiple = 2 * context if context > 1 else 1
    per_rank = [_bins(share, capacity, segment_multiple) for share in _assign_ranks(samples, data_parallel)]
    count = max(len(bins) for bins in per_rank)
    count = math.ceil(count / count_multiple) * count_multiple
    plan = []
    for bins in per_rank:
        bins = bins + [[] for _ in range(count - len(bins))]
        lengths = [_round_up(sum(sample_room(len(s), context) for s in b), length_multiple) for b in bins]
        if common_length:
            lengths = [max(lengths)] * len(lengths)
        plan.append([_row(b, n, segment_multiple) for b, n in zip(bins, lengths)])
    return PackPlan(plan)
