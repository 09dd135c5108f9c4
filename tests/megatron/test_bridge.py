"""The weight bridge on real Megatron models (gloo, CPU) and real transformers models: an exported checkpoint gives
transformers the trainer's logits; Hugging Face -> Megatron -> Hugging Face is exact; exports under TP2+SP, EP2,
expert-TP2, PP2, PP2 with virtual stages and dense TP2 equal the checkpoint bit for bit; sync_weights fills a real
HFEngine on rank 0, and an engine that refuses an update fails every rank without leaving one behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bridge_worker import BUCKET_MB, LAYOUTS, MODELS
from megatron_launch import run_worker

from spade_mega.bridge.checkpoint import INDEX, iter_checkpoint
from spade_mega.config.loader import apply_overrides, build, to_dict
from spade_mega.config.schema import SpadeConfig
from spade_mega.megatron.providers import hf_config_dict

pytestmark = pytest.mark.multiproc

WORKER = Path(__file__).with_name("bridge_worker.py")
ATOL = 1e-5  # float32 logits of the same weights through two implementations


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bridge_reference")
    run_worker(1, "reference", out, worker=WORKER)
    return out


@pytest.fixture(scope="module")
def layouts(reference: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bridge_layouts")
    run_worker(2, "layouts", out, "--ref", str(reference), "--layouts", *LAYOUTS, worker=WORKER)
    return out


def checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    return dict(iter_checkpoint(folder))


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, what
    err = float((got - want).abs().max())
    assert err < ATOL, f"{what}: logits differ by up to {err:.2e}"


@pytest.mark.parametrize("model", list(MODELS))
def test_export_of_a_trained_model_gives_transformers_the_same_logits(reference: Path, model: str) -> None:
    assert json.loads((reference / "reference.json").read_text())[model]["updated"]
    trained = torch.load(reference / f"trained_{model}_logits.pt")
    before = torch.load(reference / f"reference_{model}_logits.pt")
    assert float((trained - before).abs().max()) > 100 * ATOL, "the training step must change the logits"
    assert_logits_close(torch.load(reference / f"trained_{model}_hf_logits.pt"), trained, f"{model} export")
    # the step started from the loaded weights (load_hf refreshed the optimizer's copies) and moved them by about lr
    loaded, exported = checkpoint(reference / f"hf_{model}"), checkpoint(reference / f"trained_{model}")
    moved = max(float((exported[n] - t).abs().max()) for n, t in loaded.items())
    assert 0 < moved < 1e-4


@pytest.mark.parametrize("model", list(MODELS))
def test_hf_to_megatron_to_hf_is_exact(reference: Path, model: str) -> None:
    original = checkpoint(reference / f"hf_{model}")
    exported = torch.load(reference / f"reference_{model}_export.pt")
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    # and the Megatron model computes what transformers computes with those weights (the import is right, not only
    # its inverse)
    assert_logits_close(torch.load(reference / f"reference_{model}_logits.pt"),
                        torch.load(reference / f"hf_{model}_logits.pt"), f"{model} after load_hf")


def test_saved_checkpoint_is_a_complete_hugging_face_folder(reference: Path) -> None:
    for model, overrides in MODELS.items():
        folder = reference / f"trained_{model}"
        index = json.loads((folder / INDEX).read_text())
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
        assert all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
        tensors = checkpoint(folder)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
        cfg = build(SpadeConfig, apply_overrides(to_dict(SpadeConfig()), overrides))
        assert json.loads((folder / "config.json").read_text()) == hf_config_dict(cfg.model)
        assert ("lm_head.weight" in tensors) == (not cfg.model.tie_embeddings)
        refused = json.loads((reference / "reference.json").read_text())[model]["save_again"]
        assert refused == f"{folder} already exists and is not an empty folder; choose a new one for the checkpoint"
        assert json.loads((reference / "reference.json").read_text())[model]["bad_bucket"] == \
            "bucket_mb must be > 0, got 0"
        assert not (reference / f"bad_bucket_{model}").exists()
    assert not list(reference.glob(".*partial*")), "no staging folder is left behind"


def test_a_saved_checkpoint_is_on_disk_before_it_has_its_name(reference: Path) -> None:
    """A crash of the machine right after save_hf must not leave a folder that looks complete with shards the disk
    never got: every file and the staging folder are flushed before the rename, the parent folder after it."""
    for model in MODELS:
        folder = reference / f"trained_{model}"
        synced = json.loads((reference / f"trained_{model}_fsynced.json").read_text())
        staging = [Path(p) for p in synced if Path(p).name.startswith(f".{folder.name}.partial-")]
        assert len(staging) == 1, synced
        files = {Path(p).name for p in synced if Path(p).parent == staging[0]}
        assert files == {p.name for p in folder.iterdir()}
        assert synced.index(str(staging[0])) > max(synced.index(str(staging[0] / f)) for f in files)
        assert synced[-1] == str(reference)


def test_convert_cli_round_trip(reference: Path) -> None:
    assert json.loads((reference / "reference.json").read_text())["cli"] == [0, 0]
    original, converted = checkpoint(reference / "hf_moe"), checkpoint(reference / "cli_hf")
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[name], tensor) for name, tensor in original.items())
    assert len(list((reference / "cli_hf").glob("*.safetensors"))) == 3  # --bucket-mb 0.2 of 0.53 MiB


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_export_equals_the_checkpoint_bit_for_bit(reference: Path, layouts: Path, layout: str) -> None:
    model = LAYOUTS[layout][0]
    result = torch.load(layouts / f"{layout}.pt")
    original = checkpoint(reference / f"hf_{model}")
    assert result["export"].keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(result["export"][name], tensor), f"{layout}: {name}"
    assert_logits_close(result["logits"], torch.load(reference / f"hf_{model}_logits.pt"), f"{layout} after load_hf")
    # streamed: no bucket beyond the limit unless it is a single larger tensor, and every tensor exactly once
    assert len(result["buckets"]) > 1
    assert all(nbytes <= BUCKET_MB * 2**20 or count == 1 for count, nbytes in result["buckets"])
    assert sum(count for count, _ in result["buckets"]) == len(original)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sync_weights_fills_the_engine_on_rank_0(reference: Path, layouts: Path, layout: str) -> None:
    result = torch.load(layouts / f"{layout}.pt")
    model = LAYOUTS[layout][0]
    original = checkpoint(reference / f"hf_{model}")
    assert result["engine_version"] == 7
    assert result["sync"]["tensors"] == len(original)
    assert result["sync"]["bytes"] == sum(t.numel() * t.element_size() for t in original.values())
    assert result["sync"]["buckets"] > 1
    assert_logits_close(result["engine_logits"], result["logits"], f"{layout}: engine after sync_weights")


def test_a_refused_update_fails_every_rank_and_the_next_sync_works(layouts: Path) -> None:
    first = list(LAYOUTS)[0]
    result = torch.load(layouts / f"{first}.pt")
    assert result["refused"].startswith("EngineError: weight update: the model has no tensor")
    other = json.loads((layouts / f"{first}_refused_rank1.json").read_text())
    assert other["refused"].startswith("BridgeError: the rollout engine on rank 0 refused weight version 1: "
                                       "EngineError")
    assert result["grad_enabled_after_refusal"], "the export must not leave autograd switched off"
    assert result["engine_version"] == 7  # the same ranks synced again afterwards


def test_an_export_that_cannot_start_fails_every_rank_before_the_engine_sees_it(layouts: Path) -> None:
    """An error every rank finds before the transfer (here a bucket limit of 0) is raised on every rank; rank 0 used
    to catch it as the engine's failure and wait in a broadcast the others never joined."""
    first = list(LAYOUTS)[0]
    result = torch.load(layouts / f"{first}.pt")
    other = json.loads((layouts / f"{first}_refused_rank1.json").read_text())
    for message in (result["export_refused"], other["export_refused"]):
        assert message == "BridgeError: bucket_mb must be > 0, got 0"
    assert result["engine_version_after_export_refused"] == 0  # untouched: the engine never saw the update
    assert result["engine_version"] == 7  # and the same ranks synced afterwards


@pytest.mark.parametrize("case, folder_name, cause", [
    ("write_failed", "vanishing", "No such file or directory"),  # safetensors' own error type for a failed write
    ("tokenizer_failed", "untokenized", "not JSON serializable"),  # transformers' TypeError, written after the shards
])
def test_a_checkpoint_that_cannot_be_written_fails_every_rank_by_name(layouts: Path, case: str, folder_name: str,
                                                                      cause: str) -> None:
    """A shard safetensors cannot write, or a tokenizer transformers cannot save (rank 0 alone writes it, after the
    shards): rank 0 must still drain the transfer (the other ranks are sending) and every rank raise the checkpoint's
    error (rank 0 raised it alone and the others waited for its verdict: a hang over NCCL), with nothing left under
    the name."""
    first = list(LAYOUTS)[0]
    folder = layouts / folder_name
    on_rank0 = torch.load(layouts / f"{first}.pt")[case]
    on_rank1 = json.loads((layouts / f"{first}_refused_rank1.json").read_text())[case]
    assert on_rank0.startswith(f"BridgeError: cannot write the checkpoint {folder}: "), on_rank0
    assert cause in on_rank0
    assert on_rank1 == on_rank0.replace("BridgeError: ", "BridgeError: rank 0: ", 1)
    assert not folder.exists() and not list(layouts.glob(f".{folder_name}.partial-*"))


def test_a_checkpoint_of_another_architecture_is_refused_on_every_rank(layouts: Path) -> None:
    first = list(LAYOUTS)[0]
    for message in (torch.load(layouts / f"{first}.pt")["load_refused"],
                    json.loads((layouts / f"{first}_refused_rank1.json").read_text())["load_refused"]):
        assert "hf_dense: config.json has model_type = 'qwen3', the model has 'qwen3_moe'" in message
    # and the right checkpoint loaded afterwards gives the right model (test_parallel_export_... on the same run)
