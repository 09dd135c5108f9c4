"""The training side on Megatron-Core: Qwen3-MoE providers, parallel setup, the GRPO train step, distributed
checkpoints, and the CPU compatibility shims (installed on import, before any megatron-core module is used).

Layering: ``compat`` knows only megatron-core; ``providers`` and ``parallel`` build on the config schema; ``batch``
and ``objective`` are plain data and maths; ``train`` composes them; ``checkpoint`` saves and loads a ``Trainer``.
See docs/megatron.md.
"""

from spade_mega.megatron import compat

compat.install()

from spade_mega.megatron.batch import BatchError, MicroBatch, TrainSample, pack, samples_from  # noqa: E402
from spade_mega.megatron.checkpoint import CheckpointError, find_latest, load_checkpoint, save_checkpoint  # noqa: E402
from spade_mega.megatron.parallel import ParallelLayout, resolve_layout  # noqa: E402
from spade_mega.megatron.providers import (  # noqa: E402
    BackendError,
    ParamCount,
    model_config_from_hf,
    parameter_count,
    resolve_model_config,
)
from spade_mega.megatron.train import StepResult, Trainer  # noqa: E402

__all__ = [
    "BatchError", "BackendError", "CheckpointError", "MicroBatch", "ParallelLayout", "ParamCount", "StepResult",
    "TrainSample", "Trainer", "find_latest", "load_checkpoint", "model_config_from_hf", "pack", "parameter_count",
    "resolve_layout", "resolve_model_config", "samples_from", "save_checkpoint",
]
