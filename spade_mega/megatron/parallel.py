"""Parallel setup from the ``parallel`` config section: validate the layout against the world size and the model's
shape (one clear :class:`ConfigError` naming the keys), start torch.distributed, build Megatron's process groups and
seed every random number generator deterministically.

Sizes: ``tensor`` (TP), ``pipeline`` (PP, with ``virtual_pipeline`` stages per rank), ``context`` (CP) and data
parallel (DP, whatever the world size leaves) for the dense part; ``expert`` (EP) x ``expert_tensor`` (ETP, default
TP) x expert-data for the experts. Both grids must tile the same world: world = TP*CP*DP*PP = ETP*EP*EDP*PP.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist

from spade_mega.config.errors import ConfigError
from spade_mega.config.schema import ModelConfig, ParallelConfig
from spade_mega.errors import SpadeError
from spade_mega.megatron import compat


class LaunchError(SpadeError):
    """The processes were started in a way that cannot form one torch.distributed world."""


@dataclass(frozen=True)
class ParallelLayout:
    """A validated layout: every size, including the derived data-parallel ones."""

    world_size: int
    tensor: int
    sequence_parallel: bool
    pipeline: int
    virtual_pipeline: Optional[int]
    context: int
    expert: int
    expert_tensor: int
    data: int
    expert_data: int

    def describe(self) -> str:
        parts = [f"TP{self.tensor}" + ("+SP" if self.sequence_parallel else ""), f"PP{self.pipeline}"]
        if self.virtual_pipeline:
            parts.append(f"VPP{self.virtual_pipeline}")
        if self.context > 1:
            parts.append(f"CP{self.context}")
        parts += [f"EP{self.expert}", f"ETP{self.expert_tensor}", f"DP{self.data}"]
        return " ".join(parts)


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def resolve_layout(parallel: ParallelConfig, model: ModelConfig, world_size: int) -> ParallelLayout:
    """Check ``parallel`` against ``world_size`` processes and the model's shape; return the full layout."""
    parallel.check()
    _require(world_size >= 1, "parallel", f"world size must be >= 1, got {world_size}")
    tp, pp, cp, ep = parallel.tensor, parallel.pipeline, parallel.context, parallel.expert
    etp = parallel.expert_tensor or tp
    vpp = parallel.virtual_pipeline
    dense = tp * pp * cp
    # named by the context size when TP x PP alone would tile the world: the key the user has to change
    culprit = "parallel.context" if cp > 1 and world_size % (tp * pp) == 0 else "parallel.tensor"
    _require(world_size % dense == 0, culprit,
             f"parallel.tensor x parallel.pipeline x parallel.context = {tp} x {pp} x {cp} = {dense} must divide "
             f"the world size ({world_size} processes)")
    sparse = etp * ep * pp
    _require(world_size % sparse == 0, "parallel.expert",
             f"parallel.expert_tensor x parallel.expert x parallel.pipeline = {etp} x {ep} x {pp} = {sparse} must "
             f"divide the world size ({world_size} processes)")

    _require(model.num_attention_heads % tp == 0, "parallel.tensor",
             f"must divide model.num_attention_heads ({model.num_attention_heads}), got {tp}")
    _require(model.num_query_groups % tp == 0, "parallel.tensor",
             f"must divide model.num_query_groups ({model.num_query_groups}), got {tp}")
    _require(model.vocab_size % tp == 0, "parallel.tensor",
             f"must divide model.vocab_size ({model.vocab_size}), got {tp}")
    stages = pp * (vpp or 1)
    _require(model.num_layers % stages == 0, "parallel.virtual_pipeline" if vpp else "parallel.pipeline",
             f"parallel.pipeline x parallel.virtual_pipeline = {stages} model chunks must divide model.num_layers "
             f"({model.num_layers})")
    _require(not parallel.sequence_parallel or tp > 1, "parallel.sequence_parallel", "needs parallel.tensor > 1")
    if model.num_experts:
        _require(model.num_experts % ep == 0, "parallel.expert",
                 f"must divide model.num_experts ({model.num_experts}), got {ep}")
        _require(model.moe_ffn_hidden_size % etp == 0, "parallel.expert_tensor",
                 f"must divide model.moe_ffn_hidden_size ({model.moe_ffn_hidden_size}), got {etp}")
        _require(tp == 1 or parallel.sequence_parallel, "parallel.sequence_parallel",
                 "must be true when a mixture-of-experts model uses parallel.tensor > 1 (Megatron-Core requires it)")
    else:
        _require(ep == 1, "parallel.expert", "needs a mixture-of-experts model (model.num_experts > 0)")
        _require(model.ffn_hidden_size % tp == 0, "parallel.tensor",
                 f"must divide model.ffn_hidden_size ({model.ffn_hidden_size}), got {tp}")
    return ParallelLayout(world_size=world_size, tensor=tp, sequence_parallel=parallel.sequence_parallel,
                          pipeline=pp, virtual_pipeline=vpp, context=cp, expert=ep, expert_tensor=etp,
                          data=world_size // dense, expert_data=world_size // sparse)


def backend_for(cuda: bool) -> str:
    """The default group's backend, as torch's device-to-backend map: on a CUDA machine NCCL for device tensors and
    gloo for host ones. Plain ``"nccl"`` serves CUDA tensors only, and the trainer reduces host tensors too (each
    step's metric sums, the checkpoints' and the loop's object collectives): "No backend type associated with device
    type cpu" at the first of them. Every group built without a backend of its own (Megatron's, ``new_group``'s
    default) inherits the map. On CPU plain gloo: the same backend for host tensors (a "cpu:gloo" map would leave
    torch's default backend type unset, and every collective then warned "No backend of type 0 found")."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def cuda_device(environ: Mapping[str, str], visible: int) -> int:
    """The GPU this process uses among the ``visible`` ones, before the process group starts (NCCL binds each rank
    to the current device): its LOCAL_RANK (torchrun; ``spade-mega launch`` exports it under srun too), else SLURM's
    SLURM_LOCALID, else 0. With one GPU visible, that one (srun --gpus-per-task, or CUDA_VISIBLE_DEVICES set per
    rank). A local rank past the visible GPUs is a :class:`LaunchError`: the rank would crash in CUDA, or share a GPU
    whose NCCL communicator then fails."""
    name = "LOCAL_RANK" if "LOCAL_RANK" in environ else "SLURM_LOCALID" if "SLURM_LOCALID" in environ else None
    value = environ[name] if name else "0"
    if not value.isdigit():
        raise LaunchError(f"{name}={value!r} is not a local rank (a number from 0)")
    local = int(value)
    if visible == 1:
        return 0
    if local >= visible:
        raise LaunchError(f"{name}={local} but this process sees {visible} GPUs (CUDA_VISIBLE_DEVICES="
                          f"{environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start at most {visible} ranks per node "
                          "(torchrun --nproc-per-node, srun --ntasks-per-node), one GPU each")
    return local


def init_distributed(parallel: Optional[ParallelConfig] = None) -> int:
    """Join (or, for a plain single process, create) the default process group: gloo on CPU, NCCL for device tensors
    and gloo for host ones on GPU (:func:`backend_for`), on this rank's GPU (:func:`cuda_device`), its collectives
    waiting up to ``parallel.collective_timeout_min`` (torch's default, NCCL's 10 minutes, is shorter than the
    rollouts and evaluations during which the other ranks wait for rank 0).

    Under torchrun (or any launcher that exports them) the usual RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    variables are used. Several srun tasks without them are refused: each would otherwise start a world of its own.
    A plain process makes a world of one over an in-memory store: no port, and nothing exported that the processes it
    starts would inherit. A default group already started (by a user's own script) must serve host tensors too: plain
    ``"nccl"`` is a :class:`LaunchError` naming the map to use. Returns the world size.
    """
    if not dist.is_initialized():
        tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "1")
        if "RANK" not in os.environ and tasks.isdigit() and int(tasks) > 1:
            raise LaunchError(
                f"started as one of {tasks} srun tasks (SLURM_STEP_NUM_TASKS = {tasks}) without RANK, WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT: each task would train alone. Launch one torchrun per node under srun, "
                "or export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID and a common "
                "MASTER_ADDR / MASTER_PORT")
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(cuda_device(os.environ, torch.cuda.device_count()))
        backend = backend_for(cuda)
        timeout = timedelta(minutes=(parallel or ParallelConfig()).collective_timeout_min)
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:  # a world of one: an in-memory store, no port to race for and nothing exported to child processes
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif "cpu:" not in dist.get_backend_config():
        raise LaunchError(
            f"the default process group was started with backends {dist.get_backend_config()!r} before spade-mega's, "
            "which have none for host tensors: the trainer's metric sums and the loop's and the checkpoints' object "
            "collectives need one. Start it as dist.init_process_group(spade_mega.megatron.parallel.backend_for("
            "torch.cuda.is_available())), i.e. 'cpu:gloo,cuda:nccl' on GPUs, or leave it to spade-mega")
    return dist.get_world_size()


# the process groups the last initialize() built (Megatron's): what release() destroys by default
_built: tuple[Any, ...] = ()


def _registered_groups() -> list[Any]:
    """Every process group torch.distributed holds: its registry (torch has no public listing of it)."""
    return list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []


def initialize(layout: ParallelLayout, seed: int, timeout_min: float = 30.0) -> tuple[Any, ...]:
    """Build Megatron's process groups for ``layout`` (releasing any previous ones; their collectives time out after
    ``timeout_min``, in whole minutes as Megatron takes it) and seed all generators. Returns the groups built, for
    :func:`release`."""
    global _built
    compat.install()
    from megatron.core import parallel_state as ps

    if dist.get_world_size() != layout.world_size:
        raise ConfigError("parallel", f"layout was resolved for {layout.world_size} processes, "
                                      f"but {dist.get_world_size()} are running")
    release()
    known = set(_registered_groups())
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline,
        context_parallel_size=layout.context,
        expert_model_parallel_size=layout.expert,
        expert_tensor_parallel_size=layout.expert_tensor,
        distributed_timeout_minutes=max(1, round(timeout_min)),
    )
    _built = tuple(group for group in _registered_groups() if group not in known)
    seed_everything(seed)
    return _built


def release(groups: Optional[tuple[Any, ...]] = None) -> None:
    """Destroy Megatron's process groups: ``groups`` (what an :func:`initialize` returned), by default the current
    ones. Megatron's destroy_model_parallel only drops its own references, and torch keeps every group registered
    until it is destroyed, with its transport (over gloo a socket, an epoll and two pipes each; ~21 groups per
    layout): a process that trains several times (a sweep, a notebook, the tests) ran out of descriptors. Megatron's
    references are dropped only when ``groups`` are its current ones; groups already destroyed are skipped."""
    global _built
    if groups is None or groups is _built:
        groups, _built = _built, ()
        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is not None and ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    registered = set(_registered_groups())
    for group in groups:
        if group in registered:
            dist.destroy_process_group(group)


def seed_everything(seed: int) -> None:
    """Same seed on every rank for the host generators (so CPU-initialised weights agree across tensor-parallel
    ranks), and Megatron's model-parallel tracker (distinct streams per TP / EP rank where Megatron wants them)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    """Tear down Megatron's groups (when any were built) and the default process group: tests and tools that run
    several layouts, and every command on its way out (see spade_mega.cli)."""
    release()
    if dist.is_initialized():
        dist.destroy_process_group()
