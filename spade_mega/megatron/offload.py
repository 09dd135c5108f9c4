"""The trainer's device memory released while a colocated rollout engine generates (``parallel.offload_trainer``).

A server engine that shares the trainer's GPUs frees its own memory while the trainer steps (inference.release_memory);
this is the other half, slime's torch_memory_saver offload done with storages: after a rollout's training, weight
sync and checkpoint, every device storage of the trainer's state is resized to zero. Parameters (the DDP param
buffers and any parameter outside one) and the optimizer's state (Adam's moments, the fp32 main parameters or
distributed-optimizer shards of each chained optimizer) are first copied into host memory (pinned on CUDA, packed
into the KL reference's buckets: reference.host_copies); gradients are only freed (every step zeroes them first).
Before the next rollout's trainer work they are reallocated and copied back, bit for bit.

The tensors keep their storage objects, so every view of it (a parameter inside a DDP buffer, the optimizer's shard of
it, a gradient's ``main_grad``) is valid again after the reload; while released, the storage's size is 0
(``untyped_storage().size()``) and the trainer refuses whatever would touch it (a forward or step, a save or load, a
weight export or load): torch reads a released CPU storage at a null address (a segmentation fault). Device-generic:
on CPU the same storages are released (the tests' path); Megatron-Core's own helpers (offload_grad_buffers,
offload_to_cpu) cover only parts of this and only on CUDA. The host copies are allocated at the first offload and
reused (their sizes change only when the optimizer first creates its state: the earlier copies are freed before the
new ones are allocated), so the host holds one copy of this rank's parameters and optimizer state for the run
(docs/megatron.md, "Memory").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from spade_mega.config.errors import ConfigError
from spade_mega.megatron.reference import host_copies

if TYPE_CHECKING:
    from spade_mega.megatron.train import Trainer


def offloads_trainer(setting: object, engine_releases_memory: bool) -> bool:
    """``parallel.offload_trainer`` resolved: auto is on where the engine releases its memory for training on the
    same GPUs (inference.release_memory resolved) and a CUDA device is present; true forces it (also on CPU)."""
    if setting != "auto":
        return bool(setting)
    return engine_releases_memory and torch.cuda.is_available()


@dataclass(frozen=True)
class Offloaded:
    """What one :meth:`TrainerOffload.offload` released on this rank."""

    nbytes: int  # device memory released: parameters, optimizer state and gradients
    copied_nbytes: int  # of which copied to host memory (parameters and optimizer state)
    seconds: float


class TrainerOffload:
    """Releases and restores this rank's trainer state on its device; see the module docstring."""

    def __init__(self, trainer: "Trainer") -> None:
        self._trainer = trainer
        self._host: list[torch.Tensor] = []  # host copies of the kept storages, reused across offloads
        self._kept: list[tuple[torch.UntypedStorage, int]] = []  # (storage, bytes) copied, while offloaded
        self._freed: list[tuple[torch.UntypedStorage, int]] = []  # gradient storages, while offloaded

    @property
    def offloaded(self) -> bool:
        return bool(self._kept or self._freed)

    @property
    def host_nbytes(self) -> int:
        """Host memory the copies take (held from the first offload on)."""
        return sum(h.numel() for h in self._host)

    def offload(self) -> Offloaded:
        """Copy parameters and optimizer state to host memory, then release every device storage of the trainer."""
        if self.offloaded:
            raise RuntimeError("the trainer's memory is already offloaded (reload it first)")
        started = time.perf_counter()
        kept, freed = self._storages()
        sizes = [s.nbytes() for s in kept]
        flats = [_bytes_of(s) for s in kept]
        if [h.numel() for h in self._host] != sizes:
            # the old copies freed first: torch's pinned allocator caches a freed block for a request of its size, so
            # copies still alive now would stay pinned for the run beside the new ones
            self._host = []
            try:
                self._host = host_copies(flats, pin=self._on_cuda)
            except (RuntimeError, MemoryError) as exc:  # a pinned allocation on CUDA: 'CUDA error: out of memory'
                if not isinstance(exc, MemoryError) and "memory" not in str(exc).lower():
                    raise
                raise ConfigError("parallel.offload_trainer", f"this rank's trainer state needs {sum(sizes) / 1e9:.2f} "
                                  f"GB of host memory{' (pinned)' if self._on_cuda else ''} to be offloaded, which "
                                  f"could not be allocated ({str(exc).splitlines()[0]}); the trainer keeps it on its "
                                  "device. Every rank of a node holds its own copy (docs/megatron.md, \"Memory\"): "
                                  "free host memory on the nodes, or set parallel.offload_trainer false") from exc
        for host, flat in zip(self._host, flats):
            host.copy_(flat, non_blocking=True)
        self._synchronize()  # the copies are complete before their source is freed
        self._kept = [(s, s.nbytes()) for s in kept]
        self._freed = [(s, s.nbytes()) for s in freed]
        for storage, _ in self._kept + self._freed:
            storage.resize_(0)
        if self._on_cuda:
            torch.cuda.empty_cache()  # back to the driver, for the engine's KV cache
        return Offloaded(sum(n for _, n in self._kept + self._freed), sum(sizes), time.perf_counter() - started)

    def reload(self) -> float:
        """Reallocate every released storage: parameters and optimizer state copied back, gradients zeroed. The
        seconds it took (0 when nothing was offloaded)."""
        if not self.offloaded:
            return 0.0
        started = time.perf_counter()
        for storage, nbytes in self._kept + self._freed:
            storage.resize_(nbytes)
        for (storage, _), host in zip(self._kept, self._host):
            _bytes_of(storage).copy_(host, non_blocking=True)
        for storage, _ in self._freed:
            _bytes_of(storage).zero_()
        self._synchronize()
        self._kept, self._freed = [], []
        return time.perf_counter() - started

    def check_loaded(self, what: str) -> None:
        """Refuse ``what`` (a forward, a save) while the state is offloaded: it would read freed storage."""
        if self.offloaded:
            raise RuntimeError(f"{what}: the trainer's memory is offloaded (parallel.offload_trainer); reload it "
                               "first (Trainer.offloader.reload())")

    # --- which storages -----------------------------------------------------------------------------------------

    def _storages(self) -> tuple[list[torch.UntypedStorage], list[torch.UntypedStorage]]:
        """The distinct non-empty device storages of the trainer's state: those to keep (parameters, optimizer
        state), those to free (gradients). A storage is taken once however many tensors view it."""
        trainer = self._trainer
        device = trainer.backend.device
        seen: set[int] = set()

        def distinct(tensors: Iterator[Optional[torch.Tensor]]) -> list[torch.UntypedStorage]:
            found = []
            for t in tensors:
                if not isinstance(t, torch.Tensor) or t.device.type != device.type:
                    continue
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    found.append(storage)
            return found

        buffers = [b for chunk in trainer.model for b in chunk.buffers + chunk.expert_parallel_buffers]
        params = [p for chunk in trainer.model for p in chunk.module.parameters()]
        optimizers = [o.optimizer for o in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])]
        main = [p for o in optimizers for group in o.param_groups for p in group["params"]]
        freed = distinct(iter([b.grad_data for b in buffers] + [getattr(p, "main_grad", None) for p in params] +
                              [p.grad for p in params + main]))
        kept = distinct(iter([b.param_data for b in buffers] + params + main +
                             [v for o in optimizers for state in o.state.values() for v in state.values()]))
        return kept, freed

    @property
    def _on_cuda(self) -> bool:
        return self._trainer.backend.device.type == "cuda"

    def _synchronize(self) -> None:
        if self._on_cuda:
            torch.cuda.synchronize()


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor (whatever dtypes view it)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
