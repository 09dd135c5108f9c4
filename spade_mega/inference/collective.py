"""The process group a weight update travels over from the trainer to a server's workers
(``inference.weight_transfer: collective``): torch only, imported on both sides (the trainer, which has no vLLM,
and the server's workers, through :mod:`spade_mega.inference.vllm_worker`).

One group per server: the trainer's global rank 0 is rank 0 (it hosts the TCP rendezvous store), the server's
workers are ranks 1.. (each takes its own weights from the full tensors, as from a checkpoint). Gloo when there is no
CUDA, NCCL on GPU. A group is standalone (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` over its own store), outside
``torch.distributed``'s default group, so the trainer's own collectives never wait on a server and vice versa; every
operation on it has the group's timeout, so a server that dies or stalls mid-transfer fails the update instead of
hanging the trainer.

A bucket travels as one broadcast of a byte buffer: its tensors packed one after another, each at an offset
aligned to :data:`ALIGN` bytes so that every piece can be viewed back in its own dtype; the receiver learns the
names, dtypes and shapes over HTTP before the bytes arrive (:func:`layout`)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Optional, Sequence

import torch
import torch.distributed as dist

# the name vLLM's weight-transfer factory knows the server side by, and the worker extension whose import registers
# it (spade_mega.inference.vllm_worker: it imports vLLM, so the trainer never imports it)
VLLM_BACKEND = "spade"
VLLM_EXTENSION = "spade_mega.inference.vllm_worker.SpadeWorkerExtension"
ALIGN = 16  # bytes: the widest element (complex64/float64: 8) twice over
Backend = Literal["gloo", "nccl"]


def default_backend() -> Backend:
    return "nccl" if torch.cuda.is_available() else "gloo"


@dataclass
class Group:
    """A rank's end of one trainer -> server group (its store kept alive with it)."""

    store: dist.Store
    process_group: dist.ProcessGroup
    backend: Backend
    rank: int
    world_size: int

    @classmethod
    def join(cls, store: dist.Store, backend: Backend, rank: int, world_size: int, timeout_s: float,
             name: str) -> "Group":
        """Rank ``rank`` of the group named ``name`` over ``store`` (:func:`rendezvous`). Blocks until every rank
        has joined, at most ``timeout_s``."""
        timeout = timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore(name, store)
        if backend == "gloo":
            group: dist.ProcessGroup = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        return cls(store, group, backend, rank, world_size)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def broadcast(self, buffer: torch.Tensor, timeout_s: Optional[float] = None) -> "dist.Work":
        """Start broadcasting ``buffer`` from rank 0 (received in place elsewhere); ``wait()`` the result, which
        fails after ``timeout_s`` (default: the group's timeout)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        if timeout_s is not None:
            options.timeout = timedelta(seconds=timeout_s)
        return self.process_group.broadcast([buffer], options)

    def close(self) -> None:
        """Drop the group (abort it: a peer that died leaves nothing to shut down cleanly)."""
        try:
            self.process_group.abort()
        except RuntimeError:  # already gone
            pass


def rendezvous(host: str, port: int, world_size: int, *, host_it: bool, timeout_s: float) -> dist.TCPStore:
    """The group's TCP store: hosted by the trainer (``host_it``; ``port`` 0 picks a free one, read it from
    ``.port``), reached at ``host:port`` by the workers. The host listens on ``host`` only: torch's own store
    listens on every interface, where any process on the network could write its address into the group's
    rendezvous (and feed the servers weights, or read them)."""
    listen_fd = None
    if host_it:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        port, listen_fd = sock.getsockname()[1], sock.detach()  # the store owns the socket from here
    try:
        return dist.TCPStore(host, port, world_size, is_master=host_it, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False, master_listen_fd=listen_fd, use_libuv=True)
    except BaseException:
        if listen_fd is not None:
            os.close(listen_fd)
        raise


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype an update's JSON names (``str(dtype)`` less ``torch.``): only a real dtype, never another
    attribute of torch that the name happens to match."""
    dtype = getattr(torch, name, None) if name.isidentifier() and not name.startswith("_") else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"spade weight transfer: {name!r} is no torch dtype (the update names each tensor's dtype "
                         "as torch.<name>, e.g. 'bfloat16')")
    return dtype


def layout(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]) -> tuple[list[int], int]:
    """The byte offset of each tensor in a packed bucket, and the bucket's size."""
    offsets, size = [], 0
    for shape, dtype in zip(shapes, dtypes):
        offsets.append(size)
        numel = 1
        for dim in shape:
            numel *= int(dim)
        size = _aligned(size + numel * dtype.itemsize)
    return offsets, size


def pack(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One byte buffer on ``device`` holding ``tensors`` at :func:`layout`'s offsets."""
    offsets, size = layout([t.shape for t in tensors], [t.dtype for t in tensors])
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
    for offset, tensor in zip(offsets, tensors):
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset:offset + flat.numel()].copy_(flat)
    return buffer


def unpack(buffer: torch.Tensor, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """Views of the tensors :func:`pack` put in ``buffer``."""
    offsets, _ = layout(shapes, dtypes)
    views = []
    for offset, shape, dtype in zip(offsets, shapes, dtypes):
        numel = 1
        for dim in shape:
            numel *= int(dim)
        views.append(buffer[offset:offset + numel * dtype.itemsize].view(dtype).view(tuple(shape)))
    return views
