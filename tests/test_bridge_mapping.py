"""The bridge's name table and layout transforms against transformers' own checkpoints (no Megatron processes), and
the errors a checkpoint that does not fit the model gets."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from spade_mega.bridge import BridgeError, HFCheckpoint, weight_table
from spade_mega.bridge.checkpoint import check_checkpoint
from spade_mega.bridge.mapping import FusedQkv, GatedFc1, Transform, Vocab
from spade_mega.config.schema import ModelConfig
from spade_mega.megatron.providers import hf_config_dict

MODELS = {
    "moe": ModelConfig(),
    "dense": dataclasses.replace(ModelConfig(), num_experts=0, ffn_hidden_size=96),
    "moe_tied": dataclasses.replace(ModelConfig(), tie_embeddings=True),
}


def save_transformers(model: ModelConfig, folder: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    net = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_config_dict(model)), dtype=torch.float32)
    net.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bridge_hf")
    return {name: save_transformers(model, root / name) for name, model in MODELS.items()}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("te", [False, True])
def test_table_names_and_shapes_are_those_transformers_saves(saved: dict[str, Path], name: str, te: bool) -> None:
    checkpoint = HFCheckpoint(saved[name])
    table = weight_table(MODELS[name], te)
    exported = {hf: shape for rule in table if rule.export for hf, shape in zip(rule.hf, rule.shapes)}
    assert exported == {n: checkpoint.shape(n) for n in checkpoint.files}
    assert len({rule.megatron for rule in table}) == len(table)  # one rule per Megatron parameter


def test_transformer_engine_names_differ_only_where_the_spec_fuses() -> None:
    local = [r.megatron for r in weight_table(MODELS["moe"], te=False)]
    te = [r.megatron for r in weight_table(MODELS["moe"], te=True)]
    changed = {a: b for a, b in zip(local, te) if a != b}
    assert changed["decoder.layers.1.input_layernorm.weight"] == \
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"
    assert changed["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"] == \
        "decoder.layers.0.mlp.experts.linear_fc1.weight3"
    assert "decoder.layers.0.pre_mlp_layernorm.weight" not in changed  # MoE: not fused into the experts
    dense = {r.hf[0]: r.megatron for r in weight_table(MODELS["dense"], te=True)}
    assert dense["model.layers.0.post_attention_layernorm.weight"] == \
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"


@pytest.mark.parametrize("size", [1, 2, 4])
def test_transforms_split_and_join_exactly(size: int) -> None:
    g = torch.Generator().manual_seed(size)
    groups, heads, d, hidden = 4, 8, 3, 5
    cases = [
        (Transform(), [torch.randn(hidden, generator=g)]),
        (Transform(0), [torch.randn(8, hidden, generator=g)]),
        (Transform(1), [torch.randn(hidden, 8, generator=g)]),
        (GatedFc1(), [torch.randn(8, hidden, generator=g), torch.randn(8, hidden, generator=g)]),
        (FusedQkv(groups=groups, heads=heads, head_dim=d),
         [torch.randn(heads * d, hidden, generator=g), torch.randn(groups * d, hidden, generator=g),
          torch.randn(groups * d, hidden, generator=g)]),
    ]
    for transform, hf in cases:
        count = 1 if transform.dim is None else size
        shards = [transform.to_megatron(hf, r, count, ()) for r in range(count)]
        joined = transform.to_hf(shards)
        assert len(joined) == len(hf) and all(torch.equal(a, b) for a, b in zip(joined, hf)), transform


def test_megatron_layouts_of_fused_weights() -> None:
    """What Megatron-Core keeps in a shard: per query group its query heads, key, value; gate rows then up rows."""
    groups, heads, d = 2, 4, 1
    q = torch.arange(heads, dtype=torch.float32)[:, None]  # head h holds h
    k = 10 + torch.arange(groups, dtype=torch.float32)[:, None]
    v = 20 + torch.arange(groups, dtype=torch.float32)[:, None]
    qkv = FusedQkv(groups=groups, heads=heads, head_dim=d)
    assert qkv.to_megatron([q, k, v], 0, 1, ()).flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert qkv.to_megatron([q, k, v], 1, 2, ()).flatten().tolist() == [2, 3, 11, 21]
    gate, up = torch.arange(4.0)[:, None], 10 + torch.arange(4.0)[:, None]
    assert GatedFc1().to_megatron([gate, up], 1, 2, ()).flatten().tolist() == [2, 3, 12, 13]


def test_vocabulary_padding_is_zero_on_import_and_dropped_on_export() -> None:
    vocab = Vocab(0, vocab_size=5)
    table = torch.randn(5, 3)
    shards = [vocab.to_megatron([table], r, 2, (4, 3)) for r in range(2)]  # Megatron pads 5 rows to 8
    assert torch.equal(shards[1][1:], torch.zeros(3, 3))
    assert torch.equal(vocab.to_hf(shards)[0], table)


def rewrite(source: Path, target: Path, change) -> Path:
    """A copy of checkpoint folder ``source`` with its tensors passed through ``change(dict)``, one file."""
    target.mkdir()
    tensors = {}
    for file in source.glob("*.safetensors"):
        tensors.update(load_file(file))
    change(tensors)
    save_file(tensors, str(target / "model.safetensors"))
    (target / "config.json").write_text((source / "config.json").read_text())
    return target


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("model.layers.1.mlp.experts.2.up_proj.weight"),
     "tensor model.layers.1.mlp.experts.2.up_proj.weight is missing (1 missing)"),
    (lambda t: t.update({"model.layers.0.mlp.shared_expert.gate_proj.weight": torch.zeros(2, 2)}),
     "tensor model.layers.0.mlp.shared_expert.gate_proj.weight is not part of the model"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}),
     "tensor model.layers.0.self_attn.k_proj.weight has shape [16, 64], the model needs [32, 64]"),
])
def test_a_checkpoint_that_does_not_fit_names_the_tensor(saved: dict[str, Path], tmp_path: Path, change,
                                                         message: str) -> None:
    folder = rewrite(saved["moe"], tmp_path / "bad", change)
    with pytest.raises(BridgeError, match=re.escape(message)):
        check_checkpoint(HFCheckpoint(folder), weight_table(MODELS["moe"], False), hf_config_dict(MODELS["moe"]))


def test_a_checkpoint_of_another_architecture_names_the_config_key(saved: dict[str, Path]) -> None:
    other = dataclasses.replace(MODELS["moe"], moe_router_topk=1)
    with pytest.raises(BridgeError, match="config.json has num_experts_per_tok = 2, the model has 1"):
        check_checkpoint(HFCheckpoint(saved["moe"]), weight_table(other, False), hf_config_dict(other))


def test_a_tied_checkpoint_may_carry_the_head_copy(saved: dict[str, Path], tmp_path: Path) -> None:
    folder = rewrite(saved["moe_tied"], tmp_path / "with_head",
                     lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    check_checkpoint(HFCheckpoint(folder), weight_table(MODELS["moe_tied"], False), hf_config_dict(MODELS["moe_tied"]))


def test_unreadable_folders_are_named(tmp_path: Path) -> None:
    with pytest.raises(BridgeError, match="no such Hugging Face checkpoint folder"):
        HFCheckpoint(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BridgeError, match="no \\*.safetensors files"):
        HFCheckpoint(tmp_path / "empty")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(BridgeError, match="cannot be read as safetensors"):
        HFCheckpoint(broken)
    indexed = tmp_path / "indexed"
    indexed.mkdir()
    save_file({"a": torch.zeros(1)}, str(indexed / "one.safetensors"))
    (indexed / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "one.safetensors",
                                                                                    "b": "one.safetensors"}}))
    with pytest.raises(BridgeError, match="lists b in one.safetensors, which does not hold it"):
        HFCheckpoint(indexed)
    (indexed / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["one.safetensors"]}))
    with pytest.raises(BridgeError, match="weight_map must map tensor names to file names"):
        HFCheckpoint(indexed)


def test_an_indexed_folder_is_read_by_its_index_alone(saved: dict[str, Path], tmp_path: Path) -> None:
    """A sharded checkpoint (transformers' own index) with a stray shard beside it, a leftover of an earlier save
    holding other values of the same tensors and one more: every reader takes the index's shards alone, load_hf's
    HFCheckpoint as the engines' (inference.hf_weights into the hf engine, a server engine's weight table), which
    read every *.safetensors file (the stale values reached the engine). A listed shard that is missing is named."""
    from transformers import AutoModelForCausalLM

    from spade_mega.inference.base import EngineError
    from spade_mega.inference.hf import load_checkpoint_buckets
    from spade_mega.inference.server import checkpoint_weights

    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(saved["moe"]).save_pretrained(folder, max_shard_size="200KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(index.values()))
    assert len(shards) > 1
    stale = {name: torch.full_like(tensor, 7.0) for name, tensor in load_file(folder / shards[0]).items()}
    leftover = f"model-00001-of-{len(shards) + 1:05d}.safetensors"  # an earlier save's shard count
    save_file({**stale, "model.stale_extra": torch.zeros(2)}, str(folder / leftover))
    checkpoint = HFCheckpoint(folder)
    assert set(checkpoint.files) == set(index) and set(checkpoint.files.values()) == set(shards)
    check_checkpoint(checkpoint, weight_table(MODELS["moe"], False), hf_config_dict(MODELS["moe"]))
    original = load_file(saved["moe"] / "model.safetensors")
    assert all(torch.equal(checkpoint.tensor(name), original[name]) for name in stale)
    engine: dict[str, torch.Tensor] = {}
    for bucket in load_checkpoint_buckets(str(folder)):
        engine.update(bucket)
    assert engine.keys() == original.keys() and all(torch.equal(engine[n], t) for n, t in original.items())
    assert checkpoint_weights(folder).keys() == original.keys()
    (folder / shards[-1]).unlink()
    with pytest.raises(BridgeError, match=f"lists the shard {shards[-1]} .*which is not in the folder"):
        HFCheckpoint(folder)
    with pytest.raises(EngineError, match=f"inference.hf_weights: .*lists the shard {shards[-1]}"):
        next(load_checkpoint_buckets(str(folder)))


def test_qwen3_30b_a3b_table_has_every_tensor_of_its_checkpoint() -> None:
    """The published Qwen3-30B-A3B checkpoint holds 18,867 tensors; the table's shapes add up to the analytic
    parameter count (two independent computations)."""
    from spade_mega.megatron.providers import model_config_from_hf, parameter_count

    model = model_config_from_hf(Path(__file__).parents[1] / "examples/hf/qwen3_30b_a3b/config.json")
    for te in (False, True):
        exported = [(hf, shape) for rule in weight_table(model, te) if rule.export
                    for hf, shape in zip(rule.hf, rule.shapes)]
        assert len(exported) == len({hf for hf, _ in exported}) == 18867
        assert sum(torch.Size(shape).numel() for _, shape in exported) == parameter_count(model).total


def test_a_shard_cut_short_is_refused_when_opened(saved: dict[str, Path], tmp_path: Path) -> None:
    """safetensors checks that the header covers the file, so a copy cut short fails before any weight is read."""
    folder = rewrite(saved["moe"], tmp_path / "cut", lambda t: None)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-1000])
    with pytest.raises(BridgeError, match="model.safetensors: cannot be read as safetensors"):
        HFCheckpoint(folder)


def test_convert_from_hf_refuses_an_out_that_already_holds_checkpoints(saved: dict[str, Path], tmp_path: Path) -> None:
    """from-hf writes step 0 under --out: over a root that holds checkpoints it would replace a step 0 or sit behind
    the newest step (what a later load of the root takes), so it is refused before any model is built, and the
    checkpoint there is untouched."""
    import subprocess
    import sys

    from spade_mega.megatron.checkpoint import MANIFEST

    existing = tmp_path / "root" / "step_00000005"
    existing.mkdir(parents=True)
    (existing / MANIFEST).write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "spade_mega.cli", "convert", "from-hf", "--hf", str(saved["moe"]),
                           "--out", str(tmp_path / "root")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == (f"spade-mega: error: {tmp_path / 'root'} already holds a checkpoint (step_00000005);"
                                   " from-hf starts a new checkpoint root: choose an empty or new --out")
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == ["step_00000005"]
