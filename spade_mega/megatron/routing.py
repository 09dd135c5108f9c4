"""MoE routing replay (``rl.routing_replay``): the experts the old policy chose, replayed in the train steps.

GRPO's token ratio pi_theta / pi_old is noisy for a mixture-of-experts model: after a step the router may send a token
to other experts than the old policy did, and the ratio then compares two different sub-networks. Routing replay
(GSPO's paper; slime's ``--use-routing-replay``, verl's router replay "R2") records every MoE layer's top-k experts
per token in the rollout's old-log-prob pass and makes each train step's forward, and the recompute of its backward,
use them: the first step of a rollout computes the pre-pass's log-probs, later steps keep the old experts (the
router's weights still train, through the probabilities of the replayed experts).

The hook is Megatron-Core's: ``topk_routing_with_score_function`` hands its top-k to the router's ``router_replay``
(:class:`megatron.core.transformer.moe.router_replay.RouterReplay`) with its RECORD / REPLAY_FORWARD /
REPLAY_BACKWARD actions. :class:`LayerReplay` is that class for one router of one trainer: kept out of Megatron's
process-global registry (which would keep every trainer's model alive in a process that trains more than once), it
gives padding rows (-1) the router's own choice and counts, in the forward, the tokens whose own top-k differs from
the replayed one (``routing_replay_drift``: one top-k over the router's scores, no extra forward).

Imported by the trainer after ``compat.install()`` (it imports megatron-core).

Bookkeeping (:class:`RoutingReplay`): a rank routes the tokens of its share of each row: its context-parallel shard
(:meth:`MicroBatch.context_shard`), of which under sequence parallelism its tensor-parallel chunk, for the MoE layers
of its pipeline stage (all its virtual stages). The record pass writes each routed token's experts into one
token-aligned table of the whole batch (each token by exactly one rank of the stage), summed over the stage's ranks
(the tensor-, data- and context-parallel group), and each sample keeps its rows (``TrainSample.routing``: [tokens,
this rank's MoE layers, top-k], uint8 up to 256 experts, else int16, in host memory). A step's forward gathers, for
the positions its rank routes of a micro-batch, each token's rows from its sample (a row's ``sample_ids`` and
``position_ids`` name the sample and the token), whatever rows the step's budget and order packed: replay survives
repacking and reshuffling, and nothing is copied for the other ranks' rows. Megatron's schedules run a micro-batch's backward (and its layers'
recompute) in the order of the forwards, so each layer's recompute takes the targets of the forwards in turn
(REPLAY_BACKWARD's queue): whatever runs between two forward steps of the schedule is a backward.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

if TYPE_CHECKING:
    from spade_mega.megatron.batch import MicroBatch

RECORD, FORWARD, BACKWARD = (RouterReplayAction.RECORD, RouterReplayAction.REPLAY_FORWARD,
                             RouterReplayAction.REPLAY_BACKWARD)
# the collective's dtype per storage dtype: NCCL and gloo sum uint8 but not int16
_REDUCE_DTYPE = {torch.uint8: torch.uint8, torch.int16: torch.int32}
_REDUCE_CHUNK = 1 << 26  # elements per collective (64 MiB of uint8): the table is staged on the device in pieces


def storage_dtype(num_experts: int) -> torch.dtype:
    """The compact integer type that holds an expert index: uint8 up to 256 experts, else int16."""
    if num_experts > 32768:
        raise ValueError(f"routing replay stores expert indices as int16: {num_experts} experts do not fit")
    return torch.uint8 if num_experts <= 256 else torch.int16


def gather_rows(routing: Sequence[torch.Tensor], sample: torch.Tensor, token: torch.Tensor, layers: slice
                ) -> torch.Tensor:
    """[positions, layers, top-k] int64: for each position (its ``sample``, an index into ``routing``, -1 on padding,
    and its ``token`` in that sample) the experts the sample's rows hold for ``layers``; -1 on padding."""
    first = next(r for r in routing if r is not None)
    target = torch.full((len(sample), len(range(*layers.indices(first.shape[1]))), first.shape[-1]), -1,
                        dtype=torch.long)
    for s in sample[sample >= 0].unique().tolist():
        mine = sample == s
        target[mine] = routing[s][token[mine], layers].long()
    return target


class LayerReplay(RouterReplay):
    """Megatron's RouterReplay for one MoE layer of one trainer (see the module docstring for what differs)."""

    def __init__(self) -> None:
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)  # per trainer, not process-global
        self.drift: Optional[torch.Tensor] = None  # [tokens whose own top-k differs, tokens replayed]

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Optional[int] = None,
                        group_topk: Optional[int] = None,
                        default_compute_topk: Optional[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        action = self.router_replay_action
        if action not in (FORWARD, BACKWARD):
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        assert default_compute_topk is not None
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.target_topk_idx if action == FORWARD else self.replay_backward_list.pop(0)
        target = target.to(device=own.device, dtype=own.dtype)
        if target.shape != own.shape:
            raise RuntimeError(f"routing replay: the router of layer {self.layer_number} routes {tuple(own.shape)} "
                               f"(tokens, top-k) but was given {tuple(target.shape)} to replay")
        real = target[:, 0] >= 0  # padding rows (-1) keep the router's own choice
        if action == FORWARD:
            differs = (own.sort(dim=1).values != target.sort(dim=1).values).any(dim=1) & real
            counts = torch.stack([differs.sum(), real.sum()]).double()
            self.drift = counts if self.drift is None else self.drift + counts
        indices = torch.where(real[:, None], target, own)
        return scores.gather(1, indices), indices

    def reset(self) -> None:
        self.clear_indices()
        self.clear_router_replay_action()
        self.drift = None


class RoutingReplay:
    """The replay hooks of a trainer's MoE routers, per model chunk (virtual pipeline stage), in layer order."""

    def __init__(self, chunks: Sequence[Any], num_experts: int, tensor: int, sequence_parallel: bool,
                 tp_rank: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.layers: list[list[LayerReplay]] = []
        for chunk in chunks:
            hooks = []
            for router in (m for m in chunk.modules() if isinstance(m, TopKRouter)):
                router.router_replay = hook = LayerReplay()
                hook.layer_number = router.layer_number
                hooks.append(hook)
            self.layers.append(hooks)
        self.first = [sum(len(h) for h in self.layers[:c]) for c in range(len(self.layers))]
        self.num_layers = sum(len(h) for h in self.layers)  # this rank's MoE layers
        self.dtype = storage_dtype(num_experts)
        self.tensor, self.sequence_parallel, self.tp_rank = tensor, sequence_parallel, tp_rank

    def _local(self, mb: MicroBatch) -> torch.Tensor:
        """Positions of ``mb`` (a row, or its context-parallel shard) that this rank's routers see: under sequence
        parallelism its tensor-parallel chunk (the embedding scatters the sequence), else all."""
        local = torch.arange(mb.length)
        return local.view(self.tensor, -1)[self.tp_rank] if self.sequence_parallel else local

    # --- record (the old-log-prob pass) ---------------------------------------------------------------------

    @contextmanager
    def recording(self, lengths: Sequence[int], topk: int, group: Any, device: torch.device) -> Iterator[Recorder]:
        """Record the routing of a no-grad pass over a batch of samples of ``lengths`` tokens: the pass runs each
        forward inside the recorder's :meth:`Recorder.around`; after the block :meth:`Recorder.per_sample` holds
        every token's routing (summed over ``group``, the stage's ranks, staged through ``device`` in pieces)."""
        recorder = Recorder(self, lengths, topk)
        self._act(RECORD)
        try:
            yield recorder
        finally:
            self._reset()
        if dist.get_world_size(group) > 1:
            reduce_dtype = _REDUCE_DTYPE[self.dtype]
            flat = recorder.table.view(-1)
            for start in range(0, flat.numel(), _REDUCE_CHUNK):
                part = flat[start:start + _REDUCE_CHUNK].to(device=device, dtype=reduce_dtype)
                dist.all_reduce(part, group=group)
                flat[start:start + _REDUCE_CHUNK] = part.to(device="cpu", dtype=self.dtype)

    # --- replay (the train step) ----------------------------------------------------------------------------

    def _tokens(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """For each position this rank's routers see of ``mb``: its sample (index in the batch; -1 on padding) and
        the token's index in that sample (a row restarts its positions at every sample)."""
        local = self._local(mb)
        return mb.sample_ids[0, local], mb.position_ids[0, local]

    @contextmanager
    def around(self, routing: Sequence[torch.Tensor], chunk: int, mb: MicroBatch) -> Iterator[None]:
        """Around the forward of ``mb`` (a row or its context-parallel shard) by model chunk ``chunk`` in a train step
        whose samples have ``routing`` (by index in the batch): its tokens' experts are each layer's target (-1 on
        padding), and stay queued for the layer's backward recompute; until the next forward, router calls are
        recomputes (REPLAY_BACKWARD). Only this rank's positions are gathered, from the samples' own rows."""
        hooks = self.layers[chunk]
        target = gather_rows(routing, *self._tokens(mb), slice(self.first[chunk], self.first[chunk] + len(hooks)))
        for j, hook in enumerate(hooks):
            hook.set_target_indices(target[:, j])
            hook.set_router_replay_action(FORWARD)
        yield
        for hook in hooks:
            hook.set_router_replay_action(BACKWARD)

    @contextmanager
    def replaying(self) -> Iterator[Callable[[], torch.Tensor]]:
        """Around a train step's schedule. Yields ``drift()``: [tokens whose current top-k differed from the replayed
        one, tokens replayed], this rank's sums over its MoE layers and forwards (call it inside the block)."""
        def drift() -> torch.Tensor:
            counts = [h.drift.cpu() for hooks in self.layers for h in hooks if h.drift is not None]
            return torch.stack(counts).sum(0) if counts else torch.zeros(2, dtype=torch.float64)

        try:
            yield drift
        finally:
            self._reset()

    def _act(self, action: RouterReplayAction) -> None:
        for hooks in self.layers:
            for hook in hooks:
                hook.set_router_replay_action(action)

    def _reset(self) -> None:
        for hooks in self.layers:
            for hook in hooks:
                hook.reset()


class Recorder:
    """The routing table of a record pass (:meth:`RoutingReplay.recording`): [batch tokens, layers, top-k]."""

    def __init__(self, replay: RoutingReplay, lengths: Sequence[int], topk: int) -> None:
        self.replay, self.lengths = replay, list(lengths)
        self.offsets = [0]
        for n in self.lengths:
            self.offsets.append(self.offsets[-1] + n)
        self.table = torch.zeros(self.offsets[-1], replay.num_layers, topk, dtype=replay.dtype)

    @contextmanager
    def around(self, chunk: int, mb: MicroBatch) -> Iterator[None]:
        """Around the forward of ``mb`` (a row or its context-parallel shard) by model chunk ``chunk``: then write what
        this rank's routers chose for its tokens. Each token is written by one rank of the stage: the tensor-parallel
        ranks route the same tokens unless the sequence is split."""
        yield
        replay = self.replay
        if not replay.sequence_parallel and replay.tp_rank:
            return
        sample, token = replay._tokens(mb)
        keep = sample >= 0
        dest = torch.tensor(self.offsets)[sample[keep]] + token[keep]  # the tokens' rows in the batch's table
        for j, hook in enumerate(replay.layers[chunk]):
            recorded = hook.get_recorded_indices().cpu()
            self.table[dest, replay.first[chunk] + j] = recorded[keep].to(replay.dtype)

    def per_sample(self) -> list[torch.Tensor]:
        """Each sample's rows of the table ([tokens, layers, top-k] views of it)."""
        return list(torch.split(self.table, self.lengths))
