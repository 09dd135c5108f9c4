"""Hugging Face checkpoints of the trainer's model: write one (``save_hf``) and start from one (``load_hf``).

``save_hf`` is a collective (see :mod:`spade_mega.bridge.export`): rank 0 writes each bucket as one safetensors
shard, then ``model.safetensors.index.json`` and ``config.json`` (:func:`spade_mega.megatron.providers.hf_config_dict`),
into a hidden folder renamed into place at the end, so an interrupted save leaves no half checkpoint under the name.
``load_hf`` reads on each rank only the tensors its own shards come from (whole tensors, cut in memory), after checking
on every rank, from the file headers alone, that the checkpoint has exactly the architecture's tensors with the right
shapes and a ``config.json`` (when there is one) of the same architecture.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from spade_mega.bridge.export import SOURCE, agree, export_hf, local_shards, rules_of
from spade_mega.bridge.mapping import BridgeError, Rule
from spade_mega.errors import SpadeError
from spade_mega.hf_weights import INDEX, WeightFolderError, weight_files

if TYPE_CHECKING:
    from spade_mega.megatron.train import Trainer

# config.json keys that must agree between a checkpoint and the model it is loaded into (shapes catch the rest)
ARCHITECTURE_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "vocab_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings")


def save_hf(trainer: "Trainer", folder: str | Path, *, bucket_mb: Optional[float] = None,
            progress: Optional[Callable[[int], None]] = None, tokenizer: Any = None) -> Path:
    """Write the trainer's weights as a Hugging Face checkpoint in ``folder`` (which must not exist, or be empty).
    Collective; rank 0 writes. Shards are the export buckets (``bucket_mb``, default ``bridge.bucket_mb``);
    ``progress(n)`` is called on rank 0 with the number of tensors of each shard written. ``tokenizer`` (a
    transformers tokenizer, on rank 0): its files are written into the folder too, so a server can load it as is."""
    from safetensors.torch import save_file

    folder = Path(folder).expanduser().absolute()
    error = None
    staging = folder.parent / f".{folder.name}.partial-{uuid.uuid4().hex[:8]}"
    if dist.get_rank() == SOURCE:
        if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            error = f"{folder} already exists and is not an empty folder; choose a new one for the checkpoint"
        else:
            try:
                staging.mkdir(parents=True)
            except OSError as exc:
                error = f"cannot create the checkpoint folder next to {folder}: {exc.strerror or exc}"
    agree(error)
    files: list[tuple[str, list[str]]] = []
    total = 0
    try:  # whatever ends the save (an export that cannot start, an interrupt), no staging folder stays behind
        # rank 0 goes on draining the export after a write error: the other ranks are sending until its end
        for i, bucket in enumerate(export_hf(trainer, bucket_mb)):
            if error is not None:
                continue
            name = f"model-{i + 1:05d}.safetensors"
            try:
                save_file({k: v.cpu() for k, v in bucket.items()}, str(staging / name), metadata={"format": "pt"})
            except Exception as exc:  # safetensors reports I/O errors as its own type, not OSError
                error = f"cannot write the checkpoint {folder}: {getattr(exc, 'strerror', None) or exc}"
            files.append((name, list(bucket)))
            total += sum(v.numel() * v.element_size() for v in bucket.values())
            if progress is not None:
                progress(len(bucket))
        if dist.get_rank() == SOURCE and error is None:
            try:
                _finish(trainer, staging, folder, files, total, tokenizer)
            except Exception as exc:  # also a tokenizer transformers cannot save (TypeError): every rank hears it
                error = f"cannot write the checkpoint {folder}: {getattr(exc, 'strerror', None) or exc}"
    finally:
        if dist.get_rank() == SOURCE and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    agree(error)
    return folder


def _finish(trainer: "Trainer", staging: Path, folder: Path, files: list[tuple[str, list[str]]], total: int,
            tokenizer: Any) -> None:
    """Name the shards ``-of-N``, write the index, the tokenizer's files and config.json, and move the folder into
    place once its files are on disk (a machine crash must not leave a folder under the name whose shards were still
    in the page cache)."""
    from spade_mega.files import fsync_path
    from spade_mega.megatron.checkpoint import _fsync_tree
    from spade_mega.megatron.providers import hf_config_dict

    weight_map = {}
    for i, (name, names) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        (staging / name).rename(staging / final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (staging / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config = hf_config_dict(trainer.model_cfg)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(staging))
        # where generate() and the servers stop: the run's end of turn (without it generate ran to max_new_tokens)
        config.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      bos_token_id=tokenizer.bos_token_id)
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _fsync_tree(staging)
    if folder.exists():
        folder.rmdir()
    os.replace(staging, folder)
    fsync_path(folder.parent)


class HFCheckpoint:
    """The tensors of a Hugging Face safetensors checkpoint folder by name, read lazily."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        self.folder = Path(folder).expanduser()
        if not self.folder.is_dir():
            raise BridgeError(f"{self.folder}: no such Hugging Face checkpoint folder")
        try:
            listing = weight_files(self.folder)
        except WeightFolderError as exc:
            raise BridgeError(str(exc)) from None
        self._handles: dict[str, Any] = {}
        self.files: dict[str, str] = {}
        for file, listed in listing.items():
            path = self.folder / file
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for unreadable files
                raise BridgeError(f"{path}: cannot be read as safetensors ({exc})") from None
            self._handles[file] = handle
            for name in handle.keys():
                if listed is not None and name not in listed:
                    continue
                if name in self.files:
                    raise BridgeError(f"{self.folder}: tensor {name} is in both {self.files[name]} and {file}")
                self.files[name] = file
        lost = sorted((name, file) for file, listed in listing.items() for name in listed or ()
                      if self.files.get(name) != file)
        if lost:
            raise BridgeError(f"{self.folder / INDEX} lists {lost[0][0]} in {lost[0][1]}, which does not hold it "
                              f"({len(lost)} such tensor(s))")

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.files[name]].get_slice(name).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        return self._handles[self.files[name]].get_tensor(name)


def check_checkpoint(checkpoint: HFCheckpoint, rules: list[Rule], expected_config: dict[str, Any]) -> None:
    """Names, shapes and architecture of ``checkpoint`` against the model's table; the error names the tensor."""
    if (checkpoint.folder / "config.json").is_file():
        from spade_mega.megatron.providers import hf_config_dict, model_config_from_hf

        config = hf_config_dict(model_config_from_hf(checkpoint.folder / "config.json"))
        for key in ARCHITECTURE_KEYS:
            if config.get(key) != expected_config.get(key):
                raise BridgeError(f"{checkpoint.folder}: config.json has {key} = {config.get(key)!r}, the model has "
                                  f"{expected_config.get(key)!r}")
    expected: dict[str, tuple[int, ...]] = {}
    for rule in rules:
        expected.update(zip(rule.hf, rule.shapes))
    present = set(checkpoint.files)
    if expected_config.get("tie_word_embeddings"):
        present.discard("lm_head.weight")  # tied: some checkpoints store the copy; the embedding is what is loaded
    missing, extra = sorted(set(expected) - present), sorted(present - set(expected))
    if missing:
        raise BridgeError(f"{checkpoint.folder}: tensor {missing[0]} is missing ({len(missing)} missing); the "
                          f"checkpoint does not match the model architecture")
    if extra:
        raise BridgeError(f"{checkpoint.folder}: tensor {extra[0]} is not part of the model ({len(extra)} "
                          f"unexpected); the checkpoint does not match the model architecture")
    for name, shape in expected.items():
        got = checkpoint.shape(name)
        if got != shape:
            raise BridgeError(f"{checkpoint.folder}: tensor {name} has shape {list(got)}, the model needs "
                              f"{list(shape)}")


def load_hf(trainer: "Trainer", folder: str | Path, *, progress: Optional[Callable[[int], None]] = None) -> None:
    """Set the trainer's weights from the Hugging Face checkpoint in ``folder``: each rank takes its own shards.
    Every rank calls it; a mismatch raises :class:`BridgeError` on every rank before any weight changes. The
    optimizer's main copies are refreshed; its moments are untouched (start a run from it, not a resume).
    ``progress(1)`` is called after each parameter of this rank is set."""
    from spade_mega.megatron.providers import hf_config_dict

    trainer.offloader.check_loaded("a weight load")
    rules = rules_of(trainer)
    message = None
    try:
        checkpoint = HFCheckpoint(folder)
        check_checkpoint(checkpoint, list(rules.values()), hf_config_dict(trainer.model_cfg))
        shards = local_shards(trainer, rules)
    except SpadeError as exc:  # a BridgeError, or a ConfigError from its config.json
        message = str(exc)
    agree(message)  # every rank checks the same headers, but a read can fail on one rank alone
    with torch.no_grad():
        for name, shard in shards.items():
            rule = rules[name]
            hf = [checkpoint.tensor(n) for n in rule.hf]
            value = rule.transform.to_megatron(hf, shard.index, shard.count, tuple(shard.tensor.shape))
            shard.tensor.copy_(value)
            if progress is not None:
                progress(1)
    trainer.optimizer.reload_model_params()


def iter_checkpoint(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a Hugging Face checkpoint folder, by name (for comparisons and tools)."""
    checkpoint = HFCheckpoint(folder)
    for name in sorted(checkpoint.files):
        yield name, checkpoint.tensor(name)
