"""Scenarios of the weight-bridge tests under torchrun (gloo, CPU, one thread per process). Results go to --out as JSON
and .pt files that tests/megatron/test_bridge.py compares; nothing is asserted here.

  reference  one process: random Hugging Face checkpoints (transformers models, every weight perturbed, norms
             included) for each model; the transformers logits of a probe sequence; load_hf into the Megatron model;
             its logits; its export; one training step, save_hf, and the logits of that export in transformers;
             then ``spade-mega convert from-hf`` and ``to-hf`` of the MoE checkpoint (in this process)
  layouts    any number of processes: for each --layouts entry (one launch, the trainer rebuilt per layout), load_hf
             of the reference checkpoint, the logits, the export, and sync_weights into an HFEngine on rank 0 (rank 0
             writes the results)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

MODELS = {
    "moe": [],
    "dense": ["model.num_experts=0", "model.ffn_hidden_size=96"],
    "moe_tied": ["model.tie_embeddings=true"],
    "moe4": ["model.num_layers=4"],
}
TP2_SP = ["parallel.tensor=2", "parallel.sequence_parallel=true"]
LAYOUTS = {  # name: (model, overrides)
    "tp2_sp": ("moe", TP2_SP),
    "ep2": ("moe", ["parallel.expert=2"]),
    "etp2": ("moe", ["parallel.expert_tensor=2"]),
    "pp2": ("moe", ["parallel.pipeline=2"]),
    "pp2_vpp2": ("moe4", ["parallel.pipeline=2", "parallel.virtual_pipeline=2"]),
    "dense_tp2": ("dense", ["parallel.tensor=2"]),
}
PROBE_LEN = 14


def config(model: str, overrides: list[str]):
    from spade_mega.config.loader import apply_overrides, build, to_dict
    from spade_mega.config.schema import SpadeConfig

    cfg = build(SpadeConfig, apply_overrides(to_dict(SpadeConfig()), [*MODELS[model], *overrides]))
    cfg.check()
    return cfg


def probe():
    import torch

    from spade_mega.megatron import TrainSample

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 512, (PROBE_LEN,), generator=g)
    return TrainSample(tokens, torch.arange(PROBE_LEN) > 2, torch.where(torch.arange(PROBE_LEN) > 2, 1.0, 0.0))


def hf_logits(folder: Path):
    """transformers' logits of the probe, aligned with Trainer.logits (row t: the distribution of token t)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=probe().tokens[None]).logits[0]
    return torch.cat([torch.zeros_like(logits[:1]), logits[:-1]])


def random_checkpoint(cfg, folder: Path, seed: int) -> None:
    """A transformers model of ``cfg.model`` with every weight random (norms around 1), saved as a checkpoint."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from spade_mega.megatron.providers import hf_config_dict

    hf = hf_config_dict(cfg.model)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.05 * noise)
    model.save_pretrained(folder)


def trainer_for(cfg):
    """A Trainer of ``cfg``; Megatron's MoE metrics tracker is process-global and sized by the first model's layer
    count, so it is reset for each model this process builds."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from spade_mega.megatron import Trainer

    destroy_moe_metrics_tracker()
    return Trainer(cfg)


BUCKET_MB = 0.1  # several buckets even for the tiny model


def export_of(trainer) -> tuple[dict, list[tuple[int, int]]]:
    """The exported tensors, and (tensors, bytes) of each bucket."""
    from spade_mega.bridge import export_hf

    tensors: dict = {}
    buckets = []
    stream = export_hf(trainer, bucket_mb=BUCKET_MB)
    for bucket in stream:
        tensors.update(bucket)
        buckets.append((len(bucket), sum(t.numel() * t.element_size() for t in bucket.values())))
    if rank0():  # the manifest, known before the first bucket, names what came, in order (the collective transfer
        # checks an update against the served model from it before sending anything)
        assert list(stream.manifest) == [(name, tuple(t.shape)) for name, t in tensors.items()], "manifest"
    return tensors, buckets


def rank0() -> bool:
    import torch.distributed as dist

    return dist.get_rank() == 0


@contextlib.contextmanager
def fsynced_paths():
    """The paths os.fsync is called on meanwhile (the real fsync runs): what a save made durable before returning."""
    import os

    real, synced = os.fsync, []

    def fsync(fd) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}"))
        real(fd)

    os.fsync = fsync
    try:
        yield synced
    finally:
        os.fsync = real


def scenario_reference(args) -> None:
    import torch

    from spade_mega.bridge import BridgeError, load_hf, save_hf
    result = {}
    for i, model in enumerate(MODELS):
        folder = args.out / f"hf_{model}"
        random_checkpoint(config(model, []), folder, seed=i)
        torch.save(hf_logits(folder), args.out / f"hf_{model}_logits.pt")
        cfg = config(model, [f"model.hf_config={folder}"])
        trainer = trainer_for(cfg)
        load_hf(trainer, folder)
        torch.save(torch.cat(trainer.logits([probe()])), args.out / f"reference_{model}_logits.pt")
        torch.save(export_of(trainer)[0], args.out / f"reference_{model}_export.pt")
        step = trainer.train_step([probe()])
        with fsynced_paths() as synced:
            save_hf(trainer, args.out / f"trained_{model}", bucket_mb=BUCKET_MB)
        (args.out / f"trained_{model}_fsynced.json").write_text(json.dumps(synced))
        again = None
        try:  # never over an existing checkpoint
            save_hf(trainer, args.out / f"trained_{model}")
        except BridgeError as exc:
            again = str(exc)
        bad_bucket = None
        try:  # an export that cannot start leaves no staging folder behind
            save_hf(trainer, args.out / f"bad_bucket_{model}", bucket_mb=0)
        except BridgeError as exc:
            bad_bucket = str(exc)
        torch.save(torch.cat(trainer.logits([probe()])), args.out / f"trained_{model}_logits.pt")
        torch.save(hf_logits(args.out / f"trained_{model}"), args.out / f"trained_{model}_hf_logits.pt")
        result[model] = {"save_again": again, "bad_bucket": bad_bucket, "updated": step.updated,
                         "grad_norm": step.metrics["grad_norm"]}
    # the CLI, in this process: Hugging Face -> Megatron checkpoint -> Hugging Face
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from spade_mega.cli import main as cli

    hf_config = f"model.hf_config={args.out / 'hf_moe'}"
    destroy_moe_metrics_tracker()
    result["cli"] = [cli(["convert", "from-hf", "--hf", str(args.out / "hf_moe"), "--out", str(args.out / "ckpt")]),
                     cli(["convert", "to-hf", hf_config, "--checkpoint", str(args.out / "ckpt"),
                          "--out", str(args.out / "cli_hf"), "--bucket-mb", "0.2"])]
    (args.out / "reference.json").write_text(json.dumps(result))


def engine_logits(engine):
    import torch

    with torch.no_grad():
        logits = engine.model(input_ids=probe().tokens[None]).logits[0].float()
    return torch.cat([torch.zeros_like(logits[:1]), logits[:-1]])


def save_with_vanishing_folder(folder: Path, trainer) -> str:
    """save_hf whose staging folder is deleted on rank 0 after the first shard (a real write failure, which
    safetensors reports as its own error type, not OSError); returns what this rank raised."""
    import shutil

    from spade_mega.bridge import save_hf

    def vanish(_: int) -> None:
        for staging in folder.parent.glob(f".{folder.name}.partial-*"):
            shutil.rmtree(staging)

    try:
        save_hf(trainer, folder, bucket_mb=BUCKET_MB, progress=vanish if rank0() else None)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def save_with_unsavable_tokenizer(folder: Path, trainer) -> str:
    """save_hf given, on rank 0, a tokenizer that transformers cannot save (an init argument JSON cannot write, as
    some remote-code tokenizers hold: TypeError, not OSError); returns what this rank raised."""
    from spade_mega.bridge import save_hf
    from spade_mega.tokenizer import byte_tokenizer

    tokenizer = None
    if rank0():
        tokenizer = byte_tokenizer()
        tokenizer.init_kwargs["processor_class"] = object()
    try:
        save_hf(trainer, folder, bucket_mb=BUCKET_MB, tokenizer=tokenizer)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def scenario_layouts(args) -> None:
    """Per layout: load_hf, logits, export; then sync_weights into a real in-process HFEngine on rank 0. The first
    layout first loads a checkpoint of another architecture and syncs into an engine of another architecture (dense),
    both refused: every rank must raise, and what follows must still work (no rank left behind in a collective)."""
    import torch

    from spade_mega.bridge import BridgeError, load_hf, sync_weights
    from spade_mega.inference.hf import HFEngine

    for i, name in enumerate(args.layouts):
        model, overrides = LAYOUTS[name]
        folder = args.ref / f"hf_{model}"
        trainer = trainer_for(config(model, [f"model.hf_config={folder}", *overrides]))
        refusals = {}
        if i == 0:  # a checkpoint of another architecture: refused on every rank, nothing loaded
            try:
                load_hf(trainer, args.ref / "hf_dense")
            except BridgeError as exc:
                refusals["load_refused"] = str(exc)
        load_hf(trainer, folder)
        exported, buckets = export_of(trainer)
        result = {**refusals, "logits": torch.cat(trainer.logits([probe()])), "export": exported, "buckets": buckets,
                  "layout": trainer.layout.describe()}
        engine = HFEngine(trainer.model_cfg, eos_token_id=0, device="cpu") if rank0() else None
        if i == 0:
            wrong = HFEngine(config("dense", []).model, eos_token_id=0, device="cpu") if rank0() else None
            try:
                sync_weights(trainer, wrong, version=1, bucket_mb=0.1)
            except Exception as exc:
                result["refused"] = f"{type(exc).__name__}: {exc}"
            result["grad_enabled_after_refusal"] = torch.is_grad_enabled()
            try:  # an export that fails before any transfer (every rank finds it): every rank raises
                sync_weights(trainer, engine, version=2, bucket_mb=0)
            except Exception as exc:
                result["export_refused"] = f"{type(exc).__name__}: {exc}"
            if rank0():
                result["engine_version_after_export_refused"] = engine.weight_version
            result["write_failed"] = save_with_vanishing_folder(args.out / "vanishing", trainer)
            result["tokenizer_failed"] = save_with_unsavable_tokenizer(args.out / "untokenized", trainer)
        stats = sync_weights(trainer, engine, version=7, bucket_mb=0.1)
        result["sync"] = {"tensors": stats.tensors, "bytes": stats.bytes, "buckets": stats.buckets}
        if rank0():
            result.update(engine_version=engine.weight_version, engine_logits=engine_logits(engine))
            torch.save(result, args.out / f"{name}.pt")
        elif i == 0:
            (args.out / f"{name}_refused_rank{torch.distributed.get_rank()}.json").write_text(
                json.dumps({k: result[k] for k in ("refused", "load_refused", "export_refused", "write_failed",
                                                  "tokenizer_failed")}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["reference", "layouts"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ref", type=Path, help="layouts: the reference scenario's --out")
    parser.add_argument("--layouts", nargs="*", default=[], choices=list(LAYOUTS))
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    globals()[f"scenario_{args.scenario}"](args)
    from spade_mega.megatron.parallel import shutdown

    shutdown()


if __name__ == "__main__":
    sys.exit(main())
