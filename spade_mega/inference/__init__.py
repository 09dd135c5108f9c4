"""Inference engines behind one interface (:mod:`spade_mega.inference.base`): ``hf`` in-process, ``vllm`` and
``sglang`` servers. :func:`build_engine` picks the run's; the server engines' modules (and their GPU-only packages)
are imported only when asked for."""

from __future__ import annotations

import importlib
from typing import Any

from spade_mega.config.schema import SpadeConfig
from spade_mega.inference.base import Engine, EngineError, Generation, GenerationRequest, SamplingParams

__all__ = ["Engine", "EngineError", "Generation", "GenerationRequest", "SamplingParams", "build_engine"]


def build_engine(cfg: SpadeConfig, tokenizer: Any) -> Engine:
    """The engine of ``cfg.rollout.engine``: its module's ``from_config(cfg, tokenizer)``."""
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
