"""Weights between Megatron and Hugging Face: the trainer's TP / EP / PP shards gathered into full Hugging Face
tensors and streamed in buckets into the rollout engine (:func:`sync_weights`) or a safetensors checkpoint
(:func:`save_hf`); a Hugging Face checkpoint split into each rank's shards (:func:`load_hf`).

Layering: ``mapping`` (names and layouts, plain torch) < ``export`` (the gather, torch.distributed) < ``checkpoint``
and ``sync``. Exports are collectives whose buckets come out on global rank 0, where the rollout engine lives.
"""

from spade_mega.bridge.checkpoint import HFCheckpoint, load_hf, save_hf
from spade_mega.bridge.export import export_hf
from spade_mega.bridge.mapping import BridgeError, Rule, weight_table
from spade_mega.bridge.sync import SyncStats, sync_weights

__all__ = ["BridgeError", "HFCheckpoint", "Rule", "SyncStats", "export_hf", "load_hf", "save_hf", "sync_weights",
           "weight_table"]
