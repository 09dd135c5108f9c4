"""The training side on Megatron-Core: Qwen3-MoE providers, parallel setup, the GRPO train step, distributed
checkpoints, and the CPU compatibility shims.

Layering: ``compat`` knows only megatron-core; ``providers`` and ``parallel`` build on the config schema; ``batch``
and ``objective`` are plain data and maths; ``train`` composes them; ``checkpoint`` saves and loads a ``Trainer``.
Importing this package does not import megatron-core: the functions that use it call :func:`compat.install` first
(nothing happens with CUDA), so records, layout checks and config parsing stay cheap. See docs/megatron.md.
"""

from spade_mega.megatron.batch import BatchError, MicroBatch, TrainSample, pack, samples_from
from spade_mega.megatron.checkpoint import CheckpointError, find_latest, load_checkpoint, save_checkpoint
from spade_mega.megatron.parallel import ParallelLayout, resolve_layout
from spade_mega.megatron.providers import (
    BackendError,
    ParamCount,
    model_config_from_hf,
    parameter_count,
    resolve_model_config,
)
from spade_mega.megatron.train import StepResult, Trainer

__all__ = [
    "BatchError", "BackendError", "CheckpointError", "MicroBatch", "ParallelLayout", "ParamCount", "StepResult",
    "TrainSample", "Trainer", "find_latest", "load_checkpoint", "model_config_from_hf", "pack", "parameter_count",
    "resolve_layout", "resolve_model_config", "samples_from", "save_checkpoint",
]
