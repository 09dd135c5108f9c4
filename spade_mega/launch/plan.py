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
from spade_mega.config.schema import SpadeConfig
from spade_mega.megatron.parallel import ParallelLayout, resolve_layout
from spade_mega.launch.node import PORT_TOKEN


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
    command: tuple[str, ...]  # one server's argv; PORT_TOKEN marks its port

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


def server_command(cfg: SpadeConfig, gpus: int, colocated: bool) -> tuple[str, ...]:
    """The argv of one engine server from its documented command line (SGLang ``sglang.launch_server``, vLLM's
    OpenAI server). A mixture-of-experts model spreads its experts over the server's GPUs (EP = its GPU count); a
    colocated server can hand its memory back while the trainer steps (SGLang memory saver, vLLM sleep mode)."""
    launch, engine = cfg.launch, cfg.rollout.engine
    model = launch.engine_model or cfg.model.tokenizer
    if not model:
        raise ConfigError("launch.engine_model", f"the {engine} servers need a model to load at start (a Hugging "
                                                 "Face folder or hub name); set it, or model.tokenizer")
    moe = cfg.model.num_experts > 0 and gpus > 1
    head = [launch.python, "-m"]
    if engine == "sglang":
        argv = head + ["sglang.launch_server", "--model-path", model, "--host", "0.0.0.0", "--port", PORT_TOKEN,
                       "--tp-size", str(gpus)]
        argv += ["--ep-size", str(gpus)] if moe else []
        argv += ["--enable-memory-saver"] if colocated else []
        fraction_flag = "--mem-fraction-static"
    else:
        argv = head + ["vllm.entrypoints.openai.api_server", "--model", model, "--host", "0.0.0.0", "--port",
                       PORT_TOKEN, "--tensor-parallel-size", str(gpus)]
        argv += ["--enable-expert-parallel"] if moe else []
        argv += ["--enable-sleep-mode"] if colocated else []
        fraction_flag = "--gpu-memory-utilization"
    if launch.engine_memory_fraction is not None:
        argv += [fraction_flag, f"{launch.engine_memory_fraction:g}"]
    return tuple(argv + list(launch.engine_args))


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
        gpus = launch.engine_gpus or launch.gpus_per_node
        colocated = placement == "colocated"
        engines = EnginePlan(engine=cfg.rollout.engine, placement=placement,
                             first_node=0 if colocated else launch.nodes,
                             nodes=launch.nodes if colocated else launch.engine_nodes,
                             servers_per_node=launch.gpus_per_node // gpus, gpus_per_server=gpus,
                             port=launch.engine_port, command=server_command(cfg, gpus, colocated))
    return LaunchPlan(job_name=launch.job_name or cfg.run.name, layout=layout, train_nodes=launch.nodes,
                      gpus_per_node=launch.gpus_per_node, engines=engines)
