"""Weights between Megatron and Hugging Face: the trainer's TP / EP / PP shards gathered into full Hugging Face
tensors and streamed in buckets into the rollout engine (:func:`sync_weights`) or a safetensors checkpoint
(:func:`save_hf`); a Hugging Face checkpoint split into each rank's shards (:func:`load_hf`).

Layering: ``mapping`` (names and layouts, plain torch) < ``export`` (the gather, torch.distributed) < ``checkpoint``
and ``sync``. Exports are collectives whose buckets come out on global rank 0, where the rollout engine lives.

Its names are imported on first use (PEP 562): the ``spade-mega`` command imports ``bridge.commands`` to register
``convert`` for every subcommand, and these modules pull in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spade_mega.bridge.checkpoint import HFCheckpoint, load_hf, save_hf
    from spade_mega.bridge.export import export_hf
    from spade_mega.bridge.mapping import BridgeError, Rule, weight_table
    from spade_mega.bridge.sync import SyncStats, sync_weights

_HOMES = {"HFCheckpoint": "checkpoint", "load_hf": "checkpoint", "save_hf": "checkpoint", "export_hf": "export",
          "BridgeError": "mapping", "Rule": "mapping", "weight_table": "mapping", "SyncStats": "sync",
          "sync_weights": "sync"}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
