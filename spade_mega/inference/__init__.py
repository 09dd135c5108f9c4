"""Inference engines behind one interface (:mod:`spade_mega.inference.base`): ``hf`` in-process, ``vllm`` and
``sglang`` servers. :func:`build_engine` picks the run's; the server engines' modules (and their GPU-only packages)
are imported only when asked for."""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Any, Optional

import torch

from spade_mega.config.schema import SpadeConfig
from spade_mega.inference.base import (
    Engine,
    EngineError,
    Generation,
    GenerationRequest,
    MemoryReleasing,
    PrefixCaching,
    SamplingParams,
)

__all__ = ["Engine", "EngineError", "Generation", "GenerationRequest", "MemoryReleasing", "PrefixCaching",
           "SamplingParams", "build_engine", "releases_memory"]


def releases_memory(cfg: SpadeConfig) -> bool:
    """``inference.release_memory`` resolved. auto: on when the servers share the trainer's GPUs, which is a server
    engine placed ``colocated`` (what placement auto gives it) on a machine with a GPU; the same on every rank."""
    setting = cfg.inference.release_memory
    if setting != "auto":
        return bool(setting)
    return (cfg.rollout.engine != "hf" and cfg.launch.engine_placement in ("auto", "colocated")
            and torch.cuda.is_available())


def build_engine(cfg: SpadeConfig, tokenizer: Any, *, release_memory: Optional[bool] = None) -> Engine:
    """The engine of ``cfg.rollout.engine``: its module's ``from_config(cfg, tokenizer)``. ``release_memory``: None
    is the run's ``inference.release_memory``; an engine that never shares its GPUs with a training step (``spade-mega
    eval``'s) passes False, so that it neither releases memory nor asks its servers whether they could."""
    if release_memory is not None:
        cfg = replace(cfg, inference=replace(cfg.inference, release_memory=release_memory))
    name = cfg.rollout.engine
    module_name = f"spade_mega.inference.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise EngineError(f"rollout.engine {name!r} is unavailable: this build of spade-mega has no {module_name} "
                          "(use rollout.engine: hf)") from None
    return module.from_config(cfg, tokenizer)
