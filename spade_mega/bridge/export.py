"""Megatron -> Hugging Face: full tensors gathered from tensor-, expert- and pipeline-parallel shards, streamed in
buckets on global rank 0.

A collective: every trainer rank calls :func:`export_hf` and iterates it to the end. Each rank first lists the
shards it holds (one small ``all_gather_object``); then, weight by weight in checkpoint order, the rank chosen to
provide each shard (the lowest rank holding it: one data-parallel replica provides everything) sends it to rank 0,
which joins the shards into Hugging Face tensors (:mod:`spade_mega.bridge.mapping`) and yields them in buckets of at
most ``bucket_mb`` MiB (a single larger tensor is a bucket alone). Other ranks yield nothing. Rank 0 holds at most
one bucket plus the weight being joined, so a model larger than one host's memory still streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
import torch.distributed as dist

from spade_mega.bridge.mapping import BridgeError, Rule, global_name, weight_table
from spade_mega.inference.base import WeightStream

if TYPE_CHECKING:
    from spade_mega.megatron.train import Trainer

Bucket = dict[str, torch.Tensor]
SOURCE = 0  # the rank the buckets come out on


@dataclass(frozen=True)
class Shard:
    """This rank's piece of one Megatron weight: shard ``index`` of ``count``."""

    tensor: torch.Tensor
    index: int
    count: int


def agree(message: Optional[str]) -> None:
    """Raise on every rank if any rank has an error ``message`` (its own, else the lowest failing rank's): a rank
    that raised alone would leave the others waiting in their next collective."""
    messages: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    if message is not None:
        raise BridgeError(message)
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if failed:
        raise BridgeError(f"rank {failed[0][0]}: {failed[0][1]}")


def _chunks(trainer: "Trainer") -> list[Any]:
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(trainer.model))


def rules_of(trainer: "Trainer") -> dict[str, Rule]:
    return {rule.megatron: rule for rule in weight_table(trainer.model_cfg, trainer.backend.te)}


def local_shards(trainer: "Trainer", rules: dict[str, Rule]) -> dict[str, Shard]:
    """This rank's parameters by global Megatron name, with their shard position. A parameter the table does not
    know is an error (an architecture feature the bridge would silently drop)."""
    from megatron.core import parallel_state as ps

    dense = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    expert = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    shards: dict[str, Shard] = {}
    for chunk in _chunks(trainer):
        for local, param in chunk.named_parameters():
            name = global_name(chunk, local)
            rule = rules.get(name)
            if rule is None:
                raise BridgeError(f"Megatron parameter {name} (local {local}) has no Hugging Face counterpart in the "
                                  f"Qwen3 bridge table; the model has a feature the bridge does not convert")
            index, count = (0, 1) if rule.transform.dim is None else expert if rule.expert else dense
            shards[name] = Shard(param, index, count)
    return shards


@dataclass(frozen=True)
class _Planned:
    """Where each shard of one weight comes from, and its shape and dtype."""

    providers: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype


def _plan(rules: dict[str, Rule], shards: dict[str, Shard]) -> dict[str, _Planned]:
    mine = [(name, s.index, s.count, tuple(s.tensor.shape), str(s.tensor.dtype)) for name, s in shards.items()]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    providers: dict[str, dict[int, int]] = {}
    meta: dict[str, tuple[int, tuple[int, ...], str]] = {}
    for rank, entries in enumerate(everyone):
        for name, index, count, shape, dtype in entries:
            providers.setdefault(name, {}).setdefault(index, rank)  # ranks ascend: the lowest holder provides
            meta.setdefault(name, (count, shape, dtype))
    plan = {}
    for name, rule in rules.items():
        if not rule.export:
            continue
        if name not in meta:
            raise BridgeError(f"no rank holds Megatron parameter {name}: the model was built without it")
        count, shape, dtype = meta[name]
        missing = [i for i in range(count) if i not in providers[name]]
        if missing:
            raise BridgeError(f"no rank holds shard(s) {missing} of {count} of Megatron parameter {name}")
        # the joined shapes, on the meta device: checked on every rank alike, before anything is sent
        joined = rule.transform.to_hf([torch.empty(shape, device="meta")] * count)
        for hf, want, tensor in zip(rule.hf, rule.shapes, joined):
            if tuple(tensor.shape) != want:
                raise BridgeError(f"Megatron parameter {name} ({count} shard(s) of {list(shape)}) joins into "
                                  f"{hf} of shape {list(tensor.shape)}; the architecture gives {list(want)}")
        plan[name] = _Planned(tuple(providers[name][i] for i in range(count)), shape, getattr(torch, dtype[6:]))
    return plan


def export_hf(trainer: "Trainer", bucket_mb: Optional[float] = None) -> WeightStream:
    """The model's weights as Hugging Face tensors in buckets of at most ``bucket_mb`` MiB (default
    ``bridge.bucket_mb``), yielded on global rank 0; other ranks yield nothing. Its ``manifest`` names every
    weight with its shape, on every rank, before the transfer starts. Collective: every rank calls it and
    iterates the result to the end.

    What can be checked before the transfer (the bucket limit, the parameters against the table, the joined shapes)
    is checked in this call, on every rank alike, and raises here on every rank: never inside the iteration, where
    rank 0's consumer (an engine) would catch it as its own failure while the other ranks raised.

    Tensors are copies (a bucket does not change when training goes on), on the trainer's device, in the
    parameters' dtype. Parameters are detached rather than read under ``torch.no_grad()``: a grad-mode context held
    across a ``yield`` would be restored by whoever resumes the generator last, leaving the caller's mode switched."""
    trainer.offloader.check_loaded("a weight export")
    mb = trainer.cfg.bridge.bucket_mb if bucket_mb is None else bucket_mb
    limit = int(mb * 2**20)
    message, shards = None, {}
    rules = rules_of(trainer)
    try:
        if limit <= 0:
            raise BridgeError(f"bucket_mb must be > 0, got {mb}")
        shards = local_shards(trainer, rules)
    except BridgeError as exc:
        message = str(exc)
    agree(message)
    plan = _plan(rules, shards)
    manifest = tuple((hf, tuple(shape)) for name in plan for hf, shape in zip(rules[name].hf, rules[name].shapes))
    return WeightStream(manifest, _stream(trainer, rules, shards, plan, limit))


def _stream(trainer: "Trainer", rules: dict[str, Rule], shards: dict[str, Shard], plan: dict[str, _Planned],
            limit: int) -> Iterator[Bucket]:
    """The transfer of :func:`export_hf`, weight by weight in ``plan`` order."""
    rank = dist.get_rank()
    device = trainer.backend.device
    bucket: Bucket = {}
    size = 0
    for name, planned in plan.items():
        pieces: list[torch.Tensor] = []
        live: set[int] = set()  # storages of this rank's own parameters among the pieces
        for provider in planned.providers:
            if rank == SOURCE:
                if provider == SOURCE:
                    pieces.append(shards[name].tensor.detach())
                    live.add(pieces[-1].untyped_storage().data_ptr())
                else:
                    piece = torch.empty(planned.shape, dtype=planned.dtype, device=device)
                    dist.recv(piece, provider)
                    pieces.append(piece)
            elif rank == provider:
                dist.send(shards[name].tensor.detach().contiguous(), SOURCE)
        if rank != SOURCE:
            continue
        rule = rules[name]
        for hf, tensor in zip(rule.hf, rule.transform.to_hf(pieces)):
            tensor = tensor.contiguous()
            if tensor.untyped_storage().data_ptr() in live:  # a view of a parameter (replicated weights)
                tensor = tensor.clone()
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > limit:
                yield bucket
                bucket, size = {}, 0
            bucket[hf] = tensor
            size += nbytes
    if bucket:
        yield bucket
