"""Model providers (Hugging Face config.json -> ModelConfig -> TransformerConfig, parameter counts) and the parallel
layout validation. The exact Qwen3-30B-A3B model is built on the meta device in a worker process (no weights)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from megatron_launch import worker_command, worker_env

from spade_mega.config import ConfigError
from spade_mega.config.schema import ModelConfig, ParallelConfig
from spade_mega.megatron import compat, model_config_from_hf, parameter_count, resolve_layout, resolve_model_config
from spade_mega.megatron.providers import BackendError, hf_config_dict, select_backend

QWEN3_30B = Path(__file__).resolve().parents[2] / "examples/hf/qwen3_30b_a3b/config.json"


def write_config(tmp_path: Path, **changes: object) -> Path:
    data = json.loads(QWEN3_30B.read_text())
    data.update(changes)
    path = tmp_path / "model" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def test_qwen3_30b_a3b_config_json_gives_the_public_architecture() -> None:
    m = model_config_from_hf(QWEN3_30B)
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels) == \
        (48, 2048, 32, 4, 128)
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.vocab_size) == (128, 8, 768, 151936)
    assert (m.rotary_base, m.norm_epsilon, m.moe_aux_loss_coeff) == (1e6, 1e-6, 1e-3)
    assert m.qk_layernorm and not m.tie_embeddings and m.params_dtype == "bfloat16"
    assert m.name == "qwen3_30b_a3b" and m.hf_config == str(QWEN3_30B)


def test_hf_values_win_over_the_model_section_and_the_folder_works_too(tmp_path: Path) -> None:
    path = write_config(tmp_path, num_hidden_layers=4, num_experts=16)
    mine = ModelConfig(name="mine", hf_config=str(path.parent), num_layers=2, hidden_size=64)
    m = resolve_model_config(mine)
    assert (m.name, m.num_layers, m.num_experts, m.hidden_size) == ("mine", 4, 16, 2048)
    assert resolve_model_config(ModelConfig()) == ModelConfig()  # no hf_config: the section as it is


def test_dense_qwen3_config_is_a_model_without_experts(tmp_path: Path) -> None:
    path = write_config(tmp_path, model_type="qwen3")
    assert model_config_from_hf(path).num_experts == 0


@pytest.mark.parametrize("changes, key", [
    ({"model_type": "llama"}, "model_type"),
    ({"shared_expert_intermediate_size": 1024}, "shared_expert_intermediate_size"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["full_attention"] * 40 + ["sliding_attention"] * 8}, "layer_types"),
    ({"num_experts_per_tok": "eight"}, "num_experts_per_tok"),
    ({"torch_dtype": "float16"}, "torch_dtype"),
    ({"num_key_value_heads": 5}, "num_query_groups"),
])
def test_unsupported_or_wrong_hf_config_names_the_key(tmp_path: Path, changes: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        model_config_from_hf(write_config(tmp_path, **changes))
    assert err.value.path == "model.hf_config" and key in str(err.value)


def test_config_json_written_by_the_installed_transformers_gives_the_same_model(tmp_path: Path) -> None:
    """transformers 5 writes the experts as num_local_experts and RoPE as rope_parameters (no num_experts, rope_theta,
    rope_scaling keys): the same Qwen3-30B-A3B, not the model section's expert count and RoPE base."""
    transformers = pytest.importorskip("transformers")
    data = json.loads(QWEN3_30B.read_text())
    transformers.Qwen3MoeConfig(**{k: v for k, v in data.items() if k not in ("architectures", "model_type")}) \
        .save_pretrained(tmp_path)
    base = ModelConfig(name="policy", num_experts=16, rotary_base=10_000.0)
    want = model_config_from_hf(QWEN3_30B, base)
    assert model_config_from_hf(tmp_path, base) == dataclasses.replace(want, hf_config=str(tmp_path / "config.json"))


def test_rope_parameters_and_expert_aliases(tmp_path: Path) -> None:
    data = {k: v for k, v in json.loads(QWEN3_30B.read_text()).items() if k not in ("rope_theta", "num_experts")}

    def load(**changes: object) -> ModelConfig:
        path = tmp_path / "config.json"
        path.write_text(json.dumps({**data, **changes}))
        return model_config_from_hf(path)

    m = load(rope_parameters={"rope_type": "default", "rope_theta": 5e5}, num_local_experts=64)
    assert (m.rotary_base, m.num_experts) == (5e5, 64)
    for changes, key in [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_parameters"),
        ({"rope_parameters": {"rope_type": "default"}}, "rope_parameters"),
        ({"rope_parameters": {"rope_theta": 1e6}, "rope_theta": 1e4}, "rope_theta"),
        ({"num_local_experts": 64, "num_experts": 32}, "num_local_experts"),
    ]:
        with pytest.raises(ConfigError) as err:
            load(**changes)
        assert err.value.path == "model.hf_config" and key in str(err.value), changes


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_head_dim_left_out_means_what_transformers_builds(tmp_path: Path, model_type: str) -> None:
    """Without head_dim, transformers builds Qwen3 (dense) with its default of 128 and Qwen3-MoE with hidden / heads:
    the import must give the attention width of the model the checkpoint's weights belong to."""
    transformers = pytest.importorskip("transformers")
    data = {"model_type": model_type, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 1, "intermediate_size": 512, "vocab_size": 128, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True}
    (tmp_path / "config.json").write_text(json.dumps(data))
    config = transformers.AutoConfig.for_model(**data)
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(config)
    assert model_config_from_hf(tmp_path).kv_channels == hf_model.model.layers[0].self_attn.head_dim


def test_missing_or_broken_config_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config.json"):
        model_config_from_hf(tmp_path / "nothing.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        model_config_from_hf(bad)
    bad.write_bytes(b"\x80\x81 model weights, not a config")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        model_config_from_hf(bad)


def test_parameter_counts_of_qwen3_30b_a3b() -> None:
    count = parameter_count(model_config_from_hf(QWEN3_30B))
    assert count.total == pytest.approx(30.5e9, rel=0.01)  # "30.5B total"
    assert count.active == pytest.approx(3.3e9, rel=0.02)  # "3.3B activated"


def test_analytic_count_equals_transformers_model() -> None:
    """An independent count: the Hugging Face Qwen3-MoE implementation on the meta device (2-layer slice)."""
    transformers = pytest.importorskip("transformers")
    data = json.loads(QWEN3_30B.read_text())
    data["num_hidden_layers"] = 2
    hf_config = transformers.Qwen3MoeConfig(**{k: v for k, v in data.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        hf_model = transformers.Qwen3MoeForCausalLM(hf_config)
    ours = parameter_count(dataclasses.replace(model_config_from_hf(QWEN3_30B), num_layers=2))
    assert ours.total == sum(p.numel() for p in hf_model.parameters())


@pytest.mark.parametrize("num_experts", [0, 4])
def test_hf_config_dict_round_trips_and_builds_the_counted_transformers_model(tmp_path: Path, num_experts: int) -> None:
    """The config.json an engine builds from (and an export writes) describes the trainer's architecture."""
    transformers = pytest.importorskip("transformers")
    model = ModelConfig(num_experts=num_experts, tie_embeddings=num_experts == 0, rotary_base=10_000.0)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(model)))
    assert dataclasses.replace(model_config_from_hf(tmp_path, model), name=model.name, hf_config=None) == model
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert type(hf_model).__name__ == ("Qwen3MoeForCausalLM" if num_experts else "Qwen3ForCausalLM")
    assert parameter_count(model).total == sum(p.numel() for p in hf_model.parameters())


def test_hf_config_dict_refuses_what_qwen3_cannot_express() -> None:
    with pytest.raises(ConfigError, match="model.qk_layernorm"):
        hf_config_dict(ModelConfig(qk_layernorm=False))


@pytest.fixture(scope="module")
def megatron_qwen3_30b() -> dict:
    proc = subprocess.run(worker_command(1, "qwen3_30b", Path("."), "--hf-config", str(QWEN3_30B)),
                          env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_exact_megatron_transformer_config_of_qwen3_30b_a3b(megatron_qwen3_30b: dict) -> None:
    assert megatron_qwen3_30b["config"] == {
        "num_layers": 48, "hidden_size": 2048, "num_attention_heads": 32, "num_query_groups": 4, "kv_channels": 128,
        "num_moe_experts": 128, "moe_router_topk": 8, "moe_ffn_hidden_size": 768, "layernorm_epsilon": 1e-6,
        "qk_layernorm": True, "normalization": "RMSNorm", "gated_linear_unit": True, "add_bias_linear": False,
        "add_qkv_bias": False, "moe_shared_expert_intermediate_size": None,
        "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 1e-3, "bf16": True,
        "moe_router_pre_softmax": False}  # softmax over the top-k logits = Qwen3's norm_topk_prob
    assert megatron_qwen3_30b["activation"] == "silu"


def test_megatron_model_has_the_counted_parameters(megatron_qwen3_30b: dict) -> None:
    sliced = dataclasses.replace(model_config_from_hf(QWEN3_30B), num_layers=megatron_qwen3_30b["slice_layers"])
    count = parameter_count(sliced)
    assert megatron_qwen3_30b["devices"] == ["meta"]  # no weights were allocated
    assert megatron_qwen3_30b["slice_total"] == count.total
    expert = sliced.num_layers * sliced.num_experts * 3 * sliced.hidden_size * sliced.moe_ffn_hidden_size
    assert megatron_qwen3_30b["slice_expert"] == expert
    assert count.total - count.active == expert * (1 - sliced.moe_router_topk / sliced.num_experts)


# --- parallel layout ------------------------------------------------------------------------------------------------

def layout(world: int, model: ModelConfig | None = None, **parallel: object):
    return resolve_layout(ParallelConfig(**parallel), model or ModelConfig(), world)


def test_layouts_of_the_tests_and_the_reference_recipe() -> None:
    tp_ep = layout(4, tensor=2, sequence_parallel=True, expert=2)
    assert (tp_ep.data, tp_ep.expert_data, tp_ep.expert_tensor) == (2, 1, 2)
    assert layout(2, expert=2).data == 2 and layout(2, pipeline=2).data == 1
    recipe = layout(8, model_config_from_hf(QWEN3_30B), tensor=4, sequence_parallel=True, expert=8, expert_tensor=1)
    assert (recipe.data, recipe.expert_data) == (2, 1)
    assert recipe.describe() == "TP4+SP PP1 EP8 ETP1 DP2"
    assert layout(4, ModelConfig(num_layers=4), pipeline=2, virtual_pipeline=2).virtual_pipeline == 2


@pytest.mark.parametrize("world, model, parallel, key, words", [
    (3, None, dict(tensor=2, sequence_parallel=True), "parallel.tensor", "divide the world size (3"),
    (4, None, dict(expert=8), "parallel.expert", "divide the world size"),
    (8, None, dict(tensor=8, sequence_parallel=True), "parallel.tensor", "model.num_attention_heads (4)"),
    (2, None, dict(tensor=2), "parallel.sequence_parallel", "mixture-of-experts"),
    (4, None, dict(pipeline=4), "parallel.pipeline", "model.num_layers (2)"),
    (4, ModelConfig(num_layers=4), dict(pipeline=2, virtual_pipeline=4), "parallel.virtual_pipeline",
     "model.num_layers (4)"),
    (2, ModelConfig(num_experts=3, moe_router_topk=2), dict(expert=2), "parallel.expert", "model.num_experts (3)"),
    (2, ModelConfig(num_experts=0), dict(expert=2), "parallel.expert", "mixture-of-experts"),
    (2, ModelConfig(vocab_size=511), dict(tensor=2, sequence_parallel=True), "parallel.tensor", "model.vocab_size"),
    (4, None, dict(expert=2, expert_tensor=2, tensor=2, sequence_parallel=True, pipeline=2), "parallel.expert",
     "divide the world size"),
])
def test_bad_layouts_name_the_keys(world: int, model: ModelConfig | None, parallel: dict, key: str,
                                   words: str) -> None:
    with pytest.raises(ConfigError) as err:
        layout(world, model, **parallel)
    assert err.value.path == key and words in str(err.value)


def test_srun_tasks_without_a_rendezvous_are_refused() -> None:
    """Under `srun -n 2 python train.py` no RANK / WORLD_SIZE is set: each task would start a world of its own and
    train alone (all writing the same checkpoints). Refused, naming what to do; one srun task is a plain process."""
    code = "from spade_mega.megatron.parallel import init_distributed; print('WORLD', init_distributed())"
    env = {k: v for k, v in worker_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    refused = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**env, "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"})
    assert refused.returncode != 0 and "WORLD" not in refused.stdout
    last = refused.stderr.strip().splitlines()[-1]
    assert "LaunchError" in last and "SLURM_STEP_NUM_TASKS = 2" in last and "torchrun" in last, last
    alone = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**env, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"})
    assert alone.stdout.split()[-2:] == ["WORLD", "1"], alone.stderr[-2000:]


def test_a_world_of_one_leaves_nothing_its_child_processes_inherit() -> None:
    """A plain process (a test, a notebook, `spade-mega train` on a laptop) makes a world of one in memory: it
    exported RANK / WORLD_SIZE / MASTER_PORT and held that port in a TCP store, so every process it started later
    (a second run, a convert) inherited the port and died with EADDRINUSE: make test lost five tests to it after
    an in-process run."""
    code = textwrap.dedent("""
        import os, subprocess, sys
        from spade_mega.megatron.parallel import init_distributed
        print("WORLD", init_distributed(), "RANK" in os.environ, "MASTER_PORT" in os.environ)
        child = subprocess.run([sys.executable, "-c", "from spade_mega.megatron.parallel import init_distributed; "
                                "print('CHILD', init_distributed())"], capture_output=True, text=True)
        print(child.stdout.strip(), child.returncode, child.stderr[-2000:])
    """)
    env = {k: v for k, v in worker_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[:6] == ["WORLD", "1", "False", "False", "CHILD", "1"], out.stdout


def test_nothing_is_patched_when_cuda_is_present() -> None:
    """GPU runs use megatron-core's device code untouched: with CUDA available install() applies no shim (only the
    fixes of upstream bugs that are not about the device, compat.FIXES), and the torch.cuda runtime, Tensor.type and
    megatron-core's modules are exactly what they were. (Here, not in test_megatron_compat.py, whose tests run only
    without CUDA.)"""
    code = textwrap.dedent("""
        import json, sys, torch
        torch.cuda.is_available = lambda: True
        from spade_mega.megatron import compat
        from megatron.core.optimizer import clip_grads
        from megatron.core.tensor_parallel import mappings, random
        watched = [(torch.cuda, "current_stream"), (torch.cuda, "Stream"), (torch.cuda, "synchronize"),
                   (torch.Tensor, "type"), (clip_grads, "clip_grad_by_total_norm_fp32"),
                   (mappings, "_gather_along_first_dim"), (random, "_get_cuda_rng_state")]
        before = [getattr(owner, name) for owner, name in watched]
        applied = compat.install()
        changed = [name for (owner, name), was in zip(watched, before) if getattr(owner, name) is not was]
        print(json.dumps({"applied": applied, "installed": compat.installed(), "changed": changed}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=worker_env())
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(got["applied"]) == set(got["installed"]) == {fix.name for fix in compat.FIXES}, got["applied"]
    assert got["changed"] == []


def test_gpu_without_transformer_engine_names_the_gpu_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: pretend CUDA is present to reach the check (Transformer Engine cannot import without CUDA)."""
    if torch.cuda.is_available():
        pytest.skip("a real GPU is present")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(BackendError, match=r"pip install 'spade-mega\[gpu\]'"):
        select_backend()


def test_cpu_uses_the_local_spec() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert select_backend().name == "local"
    assert select_backend("local") == select_backend("auto") == select_backend()
    with pytest.raises(BackendError, match="model.transformer_impl is transformer_engine, but there is no CUDA GPU"):
        select_backend("transformer_engine")


def test_gpu_without_transformer_engine_can_train_on_the_local_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    """model.transformer_impl: local on a GPU: Megatron's torch layers on the CUDA device, no Transformer Engine
    import; the error for auto names that way out."""
    if torch.cuda.is_available():
        pytest.skip("a real GPU is present")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    backend = select_backend("local")
    assert (backend.name, backend.device.type, backend.te, backend.cuda) == ("local", "cuda", False, True)
    with pytest.raises(BackendError, match="model.transformer_impl: local"):
        select_backend("auto")
