"""Trainer -> rollout engine: the one call the self-play loop makes after each optimizer step."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional

import torch.distributed as dist

from spade_mega.bridge.export import SOURCE, Bucket, export_hf
from spade_mega.bridge.mapping import BridgeError
from spade_mega.inference.base import WeightStream

if TYPE_CHECKING:
    from spade_mega.inference.base import Engine
    from spade_mega.megatron.train import Trainer


@dataclass(frozen=True)
class SyncStats:
    """One weight update, the same on every rank: what was sent and how long the whole collective took."""

    version: int
    tensors: int
    bytes: int
    buckets: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 2**20 / max(self.seconds, 1e-9)


def sync_weights(trainer: "Trainer", engine: Optional["Engine"], version: int, *,
                 bucket_mb: Optional[float] = None) -> SyncStats:
    """Stream the trainer's current weights into ``engine`` as weight version ``version``.

    Collective: every trainer rank calls it; the engine lives on global rank 0 (the others pass ``engine=None``).
    The engine sees Hugging Face names and full tensors in buckets of at most ``bucket_mb`` MiB (default
    ``bridge.bucket_mb``). If the engine refuses the update, its error is raised on rank 0 and a
    :class:`BridgeError` naming it on the other ranks, after the transfer has been drained on every rank (so all
    ranks stay in step)."""
    start = time.perf_counter()
    counts = [0, 0, 0]  # tensors, bytes, buckets

    def counted(buckets: Iterator[Bucket]) -> Iterator[Bucket]:
        for bucket in buckets:
            counts[0] += len(bucket)
            counts[1] += sum(t.numel() * t.element_size() for t in bucket.values())
            counts[2] += 1
            yield bucket

    stream = export_hf(trainer, bucket_mb)
    buckets = WeightStream(stream.manifest, counted(iter(stream)))
    failure: Optional[BaseException] = None
    if dist.get_rank() == SOURCE:
        try:
            if engine is None:
                raise BridgeError("sync_weights: global rank 0 was given no engine (the rollout engine lives there)")
            engine.update_weights(buckets, version)
        except Exception as exc:  # every rank must learn of it; re-raised below
            failure = exc
    for _ in buckets:  # what the engine left unread (all of it on the other ranks)
        pass
    box: list = [None if failure is None else f"{type(failure).__name__}: {failure}", counts]
    dist.broadcast_object_list(box, src=SOURCE)
    if failure is not None:
        raise failure
    if box[0] is not None:
        raise BridgeError(f"the rollout engine on rank {SOURCE} refused weight version {version}: {box[0]}")
    tensors, nbytes, nbuckets = box[1]
    return SyncStats(version, tensors, nbytes, nbuckets, time.perf_counter() - start)
