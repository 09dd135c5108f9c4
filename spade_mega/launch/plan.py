"""Role placement: which nodes train, which serve rollouts, with how many GPUs each, checked before anything starts.

The trainer's world is ``launch.nodes x launch.gpus_per_node`` processes; the parallel layout is checked against it by
:func:`spade_mega.megatron.parallel.resolve_layout` (the same rule the trainer applies at start), so a job that cannot
form its process groups is refused at render time instead of after minutes in the queue. Global rank 0 (on the first
node) owns the rollout; engine servers, when the engine is one, run beside the trainer (``colocated``, the SPADE
recipe) or on nodes of their own after the trainer's (``separate``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from spade_mega.config.errors import ConfigError
from spade_mega.config.schema import LaunchConfig, SpadeConfig
from spade_mega.launch.node import DEFAULT_MASTER_PORTS
from spade_mega.megatron.parallel import ParallelLayout, resolve_layout


@dataclass(frozen=True)
class EnginePlan:
    """The rollout servers: ``servers_per_node`` on each of ``nodes`` nodes from job node ``first_node``."""

    engine: str
    placement: str  # colocated | separate
    first_node: int
    nodes: int
    servers_per_node: int
    gpus_per_server: int
    port: int
    command: tuple[str, ...]  # the node's first server; the others count its --port up

    @property
    def count(self) -> int:
        return self.nodes * self.servers_per_node


@dataclass(frozen=True)
class LaunchPlan:
    """A checked placement of every role of the job."""

    job_name: str
    layout: ParallelLayout
    train_nodes: int
    gpus_per_node: int
    engines: Optional[EnginePlan]  # None: rollout.engine hf, in-process on global rank 0

    @property
    def total_nodes(self) -> int:
        extra = self.engines.nodes if self.engines and self.engines.placement == "separate" else 0
        return self.train_nodes + extra


def minimal_world_size(cfg: SpadeConfig) -> int:
    """The fewest processes the parallel layout fits (data parallel 1 for the dense or the expert grid)."""
    p = cfg.parallel
    return math.lcm(p.tensor * p.pipeline * p.context, (p.expert_tensor or p.tensor) * p.expert * p.pipeline)


# What a server needs to spread a mixture of experts over its GPUs (EP = its GPU count), beyond the engine's own
# command (spade_mega/inference).
_EXPERT_FLAGS = {"sglang": lambda gpus: ["--ep-size", str(gpus)], "vllm": lambda gpus: ["--enable-expert-parallel"]}


def server_command(cfg: SpadeConfig, gpus: int, colocated: bool) -> tuple[str, ...]:
    """The argv of a node's first engine server: the engine's own command line (the one a run starting its own
    server uses, so log-probs and weight reloads behave the same), on ``launch.engine_port``, with its environment
    as ``env`` arguments in front."""
    engine, inf = cfg.rollout.engine, cfg.inference
    if not inf.hf_weights:
        raise ConfigError("inference.hf_weights", f"must name the Hugging Face folder the {engine} servers load at "
                                                  "start (on a file system every engine node sees)")
    for arg in inf.server_args:
        if arg.split("=")[0] in ("--port", "--host"):
            raise ConfigError("inference.server_args", f"must not set {arg.split('=')[0]}: the launcher gives each "
                                                       "server of a node its own port from launch.engine_port and "
                                                       "tells the trainer where they are")
    if engine == "sglang":
        from spade_mega.inference.sglang import SGLangEngine as cls
    else:
        from spade_mega.inference.vllm import VLLMEngine as cls
    release = inf.release_memory  # auto: a colocated server hands its GPU memory back while the trainer steps
    extra = [cls.memory_release_flag] if release is True or (release == "auto" and colocated) else []
    extra += _EXPERT_FLAGS[engine](gpus) if cfg.model.num_experts and gpus > 1 else []
    server_env = cls.server_env()
    if inf.weight_transfer == "collective":  # its workers load spade-mega's weight-transfer engine
        cls._check_transfer(inf.weight_transfer)  # sglang has none: a ConfigError
        extra += cls.collective_server_args()
        server_env.update(cls.collective_server_env())
    dtype = inf.dtype if inf.dtype != "auto" else cfg.model.params_dtype
    argv = cls.server_command(inf.server_python or cfg.launch.python, inf.hf_weights, host="0.0.0.0",
                              port=cfg.launch.engine_port, tensor_parallel=gpus, dtype=dtype,
                              max_model_len=cfg.rollout.max_context_tokens, extra_args=extra + list(inf.server_args))
    env = [f"{key}={value}" for key, value in sorted(server_env.items())]
    return tuple((["env", *env] if env else []) + argv)


def _check_engine_ports(launch: LaunchConfig, servers_per_node: int, colocated: bool) -> None:
    """A node's servers take ``engine_port`` and the next ones; colocated, they share node 0 with the rendezvous
    port torchrun binds there, so the two must not meet (on the default range, only some job ids would fail)."""
    ports = range(launch.engine_port, launch.engine_port + servers_per_node)
    if ports[-1] > 65535:
        raise ConfigError("launch.engine_port", f"{servers_per_node} servers a node from {launch.engine_port} would "
                                                f"need ports up to {ports[-1]}, past 65535")
    if not colocated:
        return
    if launch.master_port is not None and launch.master_port in ports:
        raise ConfigError("launch.master_port", f"{launch.master_port} is an engine server's port on the first node "
                                                f"(launch.engine_port {ports[0]}..{ports[-1]}): pick another")
    if launch.master_port is None and ports[0] < DEFAULT_MASTER_PORTS.stop and ports[-1] >= DEFAULT_MASTER_PORTS.start:
        default = f"{DEFAULT_MASTER_PORTS.start}-{DEFAULT_MASTER_PORTS.stop - 1}"
        raise ConfigError("launch.engine_port", f"servers on ports {ports[0]}..{ports[-1]} meet the rendezvous ports "
                                                f"{default} taken when launch.master_port is unset: use ports "
                                                "outside them, or set launch.master_port")


def plan_launch(cfg: SpadeConfig) -> LaunchPlan:
    """Place the trainer and the engines of ``cfg`` on the job's nodes; ConfigError naming the key if they don't fit."""
    launch = cfg.launch
    world = launch.nodes * launch.gpus_per_node
    try:
        layout = resolve_layout(cfg.parallel, cfg.model, world)
    except ConfigError as exc:
        raise ConfigError(exc.path, f"{exc.message} (the trainer's world is launch.nodes x launch.gpus_per_node = "
                                    f"{launch.nodes} x {launch.gpus_per_node}; the layout needs a multiple of "
                                    f"{minimal_world_size(cfg)} processes)") from None
    placement = launch.engine_placement
    if placement == "auto":
        placement = "in_process" if cfg.rollout.engine == "hf" else "colocated"
    engines = None
    if placement != "in_process":
        spans_nodes = placement == "separate" or launch.nodes > 1
        if spans_nodes and cfg.inference.weight_transfer == "folder" and not cfg.inference.weight_sync_dir:
            raise ConfigError("inference.weight_sync_dir", "must be a folder on a file system every node sees: engine "
                                                           "servers on other nodes than global rank 0's load each "
                                                           "weight update from it (the default, /dev/shm, is per node)")
        gpus = launch.engine_gpus or launch.gpus_per_node
        colocated = placement == "colocated"
        if colocated and cfg.inference.weight_transfer == "collective":
            raise ConfigError("inference.weight_transfer", "collective needs the engine servers on GPUs of their own "
                                                           "(launch.engine_placement separate): colocated, a server's "
                                                           "worker shares the GPU of the trainer's global rank 0, and "
                                                           "NCCL refuses two ranks of one group on one GPU; use folder")
        _check_engine_ports(launch, launch.gpus_per_node // gpus, colocated)
        engines = EnginePlan(engine=cfg.rollout.engine, placement=placement,
                             first_node=0 if colocated else launch.nodes,
                             nodes=launch.nodes if colocated else launch.engine_nodes,
                             servers_per_node=launch.gpus_per_node // gpus, gpus_per_server=gpus,
                             port=launch.engine_port, command=server_command(cfg, gpus, colocated))
    return LaunchPlan(job_name=launch.job_name or cfg.run.name, layout=layout, train_nodes=launch.nodes,
                      gpus_per_node=launch.gpus_per_node, engines=engines)
