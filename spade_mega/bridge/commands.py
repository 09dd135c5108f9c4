"""``spade-mega convert to-hf|from-hf``: Megatron checkpoints of a run <-> Hugging Face safetensors checkpoints.

Both build the run's trainer (``--config`` and overrides give the model and the parallel layout), so they run as one
process or, for a model that needs it, under ``torchrun`` with the layout's world size; every rank takes part.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from spade_mega.config.loader import load_config
from spade_mega.config.schema import SpadeConfig


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", metavar="FILE", help="the run's YAML config (model and parallel layout)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides: parallel.tensor=2")


def _config(args: argparse.Namespace, overrides: list[str]) -> SpadeConfig:
    return load_config(args.config, [*args.overrides, *overrides])


def _trainer(cfg: SpadeConfig):
    from spade_mega.megatron import Trainer

    return Trainer(cfg)


def _to_hf(args: argparse.Namespace) -> int:
    from spade_mega.bridge import save_hf, weight_table
    from spade_mega.monitor.progress import RunProgress

    from spade_mega.tokenizer import load_tokenizer

    from spade_mega.megatron.checkpoint import check_tokenizer, read_manifest, resolve_checkpoint

    cfg = _config(args, [])
    checkpoint = resolve_checkpoint(Path(args.checkpoint))
    check_tokenizer(read_manifest(checkpoint), cfg.model.tokenizer, checkpoint)  # before minutes of model building
    trainer = _trainer(cfg)
    # the weights alone: the optimizer state (Adam's moments, twice the model in float32) is not exported; the load
    # checks that model.tokenizer is the checkpoint's, whose files go beside the weights (servable as they are)
    step = trainer.load(str(checkpoint), weights_only=True)
    total = sum(len(rule.hf) for rule in weight_table(trainer.model_cfg, trainer.backend.te) if rule.export)
    with RunProgress(total, "tensors", fields=[]) as bar:
        folder = save_hf(trainer, args.out, bucket_mb=args.bucket_mb, progress=bar.advance,
                         tokenizer=load_tokenizer(trainer.cfg.model.tokenizer) if _rank() == 0 else None)
    if _rank() == 0:
        print(f"wrote {folder}: Hugging Face checkpoint of step {step} ({trainer.model_cfg.name}, {total} tensors, "
              "tokenizer)")
    return 0


def _from_hf(args: argparse.Namespace) -> int:
    from spade_mega.bridge import BridgeError, HFCheckpoint, load_hf
    from spade_mega.megatron.checkpoint import find_latest
    from spade_mega.monitor.progress import RunProgress
    from spade_mega.tokenizer import check_folder_tokenizer

    # step 0 under a root that holds checkpoints would replace one, or sit behind the newest (what loads of the root
    # take): refused, like to-hf's existing folder, before a model is built
    held = find_latest(args.out)
    if held is not None:
        raise BridgeError(f"{args.out} already holds a checkpoint ({held.name}); from-hf starts a new checkpoint root: "
                          f"choose an empty or new --out")
    HFCheckpoint(args.hf)  # a folder without a checkpoint fails here, before a model is built
    cfg = _config(args, [f"model.hf_config={Path(args.hf).expanduser().absolute()}"])
    # a folder without tokenizer files cannot be checked: its weights are taken to use model.tokenizer, and the
    # checkpoint's manifest records that pairing as assumed for the folder
    checked = check_folder_tokenizer(args.hf, cfg.model.tokenizer)
    trainer = _trainer(cfg)
    total = sum(1 for chunk in trainer.model for _ in chunk.parameters())
    with RunProgress(total, "parameters", fields=[]) as bar:
        load_hf(trainer, args.hf, progress=bar.advance)
    path = trainer.save(args.out, tokenizer_assumed_for=None if checked else cfg.model.hf_config)
    if _rank() == 0:
        print(f"wrote {path}: Megatron checkpoint (step 0, fresh optimizer) of {args.hf}, loadable in any parallel "
              f"layout")
    return 0


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    convert = subparsers.add_parser(
        "convert", help="convert checkpoints between Megatron (a run's) and Hugging Face (safetensors)",
        description="Convert checkpoints between a run's Megatron checkpoints and Hugging Face safetensors folders. "
                    "Runs as one process or under torchrun with the config's parallel layout.")
    actions = convert.add_subparsers(title="actions", metavar="ACTION", required=True)
    to_hf = actions.add_parser("to-hf", help="a Megatron checkpoint -> a Hugging Face folder",
                               description="Load a run's Megatron checkpoint (a step folder, or a root: its newest "
                                           "step) and write it as a Hugging Face checkpoint (config.json, "
                                           "safetensors shards, index).")
    _config_args(to_hf)
    to_hf.add_argument("--checkpoint", required=True, help="Megatron checkpoint: a step_<N> folder or its root")
    to_hf.add_argument("--out", required=True, help="new folder for the Hugging Face checkpoint")
    to_hf.add_argument("--bucket-mb", type=float, default=None,
                       help="largest safetensors shard in MiB (default: bridge.bucket_mb)")
    to_hf.set_defaults(func=_to_hf)
    from_hf = actions.add_parser("from-hf", help="a Hugging Face folder -> a Megatron checkpoint",
                                 description="Build the model from the Hugging Face folder's config.json (the config's "
                                             "parallel layout), load its weights and save a Megatron checkpoint "
                                             "(step 0, fresh optimizer) under --out.")
    _config_args(from_hf)
    from_hf.add_argument("--hf", required=True, help="Hugging Face checkpoint folder (config.json + *.safetensors)")
    from_hf.add_argument("--out", required=True,
                         help="a new checkpoint root (or one without checkpoints); written as <out>/step_0..")
    from_hf.set_defaults(func=_from_hf)
