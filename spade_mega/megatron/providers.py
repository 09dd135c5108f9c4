"""Qwen3 / Qwen3-MoE model providers: Hugging Face ``config.json`` -> ``ModelConfig`` -> Megatron ``TransformerConfig``
-> ``GPTModel`` chunks, with the Transformer Engine layer spec on GPUs and the local spec on CPU.

The ``model`` config section is the single description of the architecture; ``model.hf_config`` (a config.json path)
fills it from a Hugging Face checkpoint, its values winning. Features of the Qwen3 family that this provider does not
build (shared experts, dense layers between MoE layers, RoPE scaling, sliding window, attention bias) are rejected by
name instead of being silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F

from spade_mega.config.errors import ConfigError
from spade_mega.config.schema import ModelConfig, ParallelConfig
from spade_mega.errors import SpadeError
from spade_mega.megatron import compat

QWEN3_MODEL_TYPES = ("qwen3_moe", "qwen3")

# config.json key -> ModelConfig field (Qwen3 / Qwen3-MoE naming)
_HF_FIELDS = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_query_groups",
    "head_dim": "kv_channels",
    "intermediate_size": "ffn_hidden_size",
    "num_experts": "num_experts",
    "num_experts_per_tok": "moe_router_topk",
    "moe_intermediate_size": "moe_ffn_hidden_size",
    "router_aux_loss_coef": "moe_aux_loss_coeff",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "rope_theta": "rotary_base",
    "rms_norm_eps": "norm_epsilon",
    "tie_word_embeddings": "tie_embeddings",
}
_HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}
# the same value under the name transformers >= 5 writes (Qwen3MoeConfig.attribute_map): alias -> _HF_FIELDS key
_HF_ALIASES = {"num_local_experts": "num_experts"}


class BackendError(SpadeError):
    """The machine cannot build the requested model backend (e.g. a GPU without Transformer Engine)."""


@dataclass(frozen=True)
class Backend:
    """Where and with which layer implementations the model runs."""

    name: Literal["transformer_engine", "local"]
    device: torch.device

    @property
    def te(self) -> bool:
        return self.name == "transformer_engine"

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def select_backend(transformer_impl: str = "auto") -> Backend:
    """Layer modules and device from ``model.transformer_impl``: on a CUDA machine Transformer Engine (``auto``,
    ``transformer_engine``) or Megatron's local torch modules (``local``); on CPU the local ones, the only kind
    that runs there."""
    if not torch.cuda.is_available():
        if transformer_impl == "transformer_engine":
            raise BackendError("model.transformer_impl is transformer_engine, but there is no CUDA GPU (Transformer "
                               "Engine runs only on one); use auto or local on this machine")
        return Backend("local", torch.device("cpu"))
    cuda = torch.device("cuda")  # the current device, set per rank at start-up
    if transformer_impl == "local":
        return Backend("local", cuda)
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as exc:
        raise BackendError(
            f"a CUDA GPU is present but Transformer Engine cannot be imported ({exc}); install the GPU extra: "
            "pip install 'spade-mega[gpu]', or set model.transformer_impl: local to train with Megatron's torch "
            "layers (slower)") from None
    return Backend("transformer_engine", cuda)


def _hf_error(path: Path, key: str, message: str) -> ConfigError:
    return ConfigError("model.hf_config", f"{path}: '{key}' {message}")


def _canonical_keys(path: Path, hf: dict[str, Any]) -> dict[str, Any]:
    """``hf`` with the keys of the transformers 4 format: transformers >= 5 writes ``num_local_experts`` and RoPE as
    ``rope_parameters`` (``rope_type``, ``rope_theta``) instead of ``num_experts``, ``rope_theta``, ``rope_scaling``.
    Left unread, the model section's expert count and RoPE base would silently stand in for the checkpoint's."""
    hf = dict(hf)
    for alias, key in _HF_ALIASES.items():
        if hf.get(alias) is None:
            continue
        if hf.get(key) is not None and hf[key] != hf[alias]:
            raise _hf_error(path, alias, f"= {hf[alias]!r} disagrees with '{key}' = {hf[key]!r}")
        hf[key] = hf.pop(alias)
    rope = hf.get("rope_parameters")
    if rope is None:
        return hf
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default":
        raise _hf_error(path, "rope_parameters", f"= {rope!r} is not supported by the Qwen3-MoE provider "
                                                 "(only rope_type 'default': no RoPE scaling)")
    if rope.get("rope_theta") is None:
        raise _hf_error(path, "rope_parameters", f"= {rope!r} gives no rope_theta")
    if hf.get("rope_theta") is not None and hf["rope_theta"] != rope["rope_theta"]:
        raise _hf_error(path, "rope_theta", f"= {hf['rope_theta']!r} disagrees with rope_parameters.rope_theta = "
                                            f"{rope['rope_theta']!r}")
    hf["rope_theta"] = rope["rope_theta"]
    return hf


def model_config_from_hf(path: str | Path, base: Optional[ModelConfig] = None) -> ModelConfig:
    """Read a Qwen3 / Qwen3-MoE ``config.json`` into a ModelConfig (fields it does not set keep ``base``'s values)."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError("model.hf_config", f"{path}: no such config.json")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError("model.hf_config", f"{path}: invalid JSON (line {exc.lineno}): {exc.msg}") from None
    except UnicodeDecodeError:
        raise ConfigError("model.hf_config", f"{path}: not UTF-8 text (is it a weights file?)") from None
    except OSError as exc:
        raise ConfigError("model.hf_config", f"{path}: cannot be read ({exc.strerror or exc})") from None
    if not isinstance(hf, dict):
        raise ConfigError("model.hf_config", f"{path}: must hold a JSON object")
    hf = _canonical_keys(path, hf)
    model_type = hf.get("model_type")
    if model_type not in QWEN3_MODEL_TYPES:
        raise _hf_error(path, "model_type", f"must be one of {QWEN3_MODEL_TYPES}, got {model_type!r}")
    unsupported = {
        "shared_expert_intermediate_size": lambda v: v not in (None, 0),
        "mlp_only_layers": lambda v: bool(v),
        "decoder_sparse_step": lambda v: v not in (None, 1),
        "rope_scaling": lambda v: v is not None,
        "use_sliding_window": lambda v: bool(v),
        "layer_types": lambda v: v is not None and any(t != "full_attention" for t in v),  # transformers >= 5
        "attention_bias": lambda v: bool(v),
        "norm_topk_prob": lambda v: v is False and model_type == "qwen3_moe",
        "hidden_act": lambda v: v not in (None, "silu"),
    }
    for key, bad in unsupported.items():
        if key in hf and bad(hf[key]):
            raise _hf_error(path, key, f"= {hf[key]!r} is not supported by the Qwen3-MoE provider")

    values: dict[str, Any] = {}
    for key, name in _HF_FIELDS.items():
        value = hf.get(key)
        if value is None:
            continue
        expected = type(getattr(ModelConfig, name))
        if expected is float and type(value) is int:
            value = float(value)
        if type(value) is not expected:
            raise _hf_error(path, key, f"must be {expected.__name__}, got {value!r}")
        values[name] = value
    if hf.get("head_dim") is None:  # what transformers builds: Qwen3Config's default, Qwen3-MoE's hidden / heads
        if model_type == "qwen3":
            values["kv_channels"] = 128
        elif isinstance(hf.get("hidden_size"), int) and isinstance(hf.get("num_attention_heads"), int):
            values["kv_channels"] = hf["hidden_size"] // hf["num_attention_heads"]
    if model_type == "qwen3":
        values["num_experts"] = 0
    dtype = hf.get("torch_dtype") or hf.get("dtype")
    if dtype is not None:
        if dtype not in _HF_DTYPES:
            raise _hf_error(path, "torch_dtype", f"must be one of {sorted(_HF_DTYPES)}, got {dtype!r}")
        values["params_dtype"] = _HF_DTYPES[dtype]
    base = base or ModelConfig()
    name = base.name if base.name != ModelConfig.name else path.parent.name  # the checkpoint folder names the model
    result = dataclasses.replace(base, **values, name=name, hf_config=str(path))
    try:
        result.check()
    except ConfigError as exc:
        raise ConfigError("model.hf_config", f"{path}: {exc}") from None
    return result


def hf_config_dict(model: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of ``model`` (the inverse of :func:`model_config_from_hf`): what an inference
    engine builds the same architecture from and what an exported checkpoint carries."""
    model = resolve_model_config(model)
    if not model.qk_layernorm:
        raise ConfigError("model.qk_layernorm", "must be true for a Hugging Face Qwen3 model (its attention always "
                                                "normalises queries and keys)")
    moe = model.num_experts > 0
    hf: dict[str, Any] = {key: getattr(model, name) for key, name in _HF_FIELDS.items()}
    hf.update(
        model_type="qwen3_moe" if moe else "qwen3",
        architectures=["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        hidden_act="silu",
        attention_bias=False,
        torch_dtype=model.params_dtype,
        use_sliding_window=False,
        rope_scaling=None,
    )
    if moe:
        hf.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False)
    else:
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "router_aux_loss_coef"):
            del hf[key]
    return hf


def resolve_model_config(model: ModelConfig) -> ModelConfig:
    """The effective architecture: ``model`` itself, or its ``hf_config`` values over it."""
    return model_config_from_hf(model.hf_config, model) if model.hf_config else model


@dataclass(frozen=True)
class ParamCount:
    """Parameters of the whole model (every expert) and those one token uses (its top-k experts)."""

    total: int
    active: int


def parameter_count(model: ModelConfig) -> ParamCount:
    """Analytic parameter count of the Qwen3(-MoE) architecture; no weights are built."""
    h, layers = model.hidden_size, model.num_layers
    q, kv = model.num_attention_heads * model.kv_channels, model.num_query_groups * model.kv_channels
    attention = h * q + 2 * h * kv + q * h + (2 * model.kv_channels if model.qk_layernorm else 0)
    norms = 2 * h
    if model.num_experts:
        expert = 3 * h * model.moe_ffn_hidden_size  # gate, up, down (gated SiLU)
        router = h * model.num_experts
        dense, experts_total, experts_active = attention + norms + router, model.num_experts * expert, \
            model.moe_router_topk * expert
    else:
        dense, experts_total, experts_active = attention + norms + 3 * h * model.ffn_hidden_size, 0, 0
    embeddings = model.vocab_size * h * (1 if model.tie_embeddings else 2) + h  # + final norm
    return ParamCount(total=embeddings + layers * (dense + experts_total),
                      active=embeddings + layers * (dense + experts_active))


def _params_dtype(model: ModelConfig) -> torch.dtype:
    return torch.bfloat16 if model.params_dtype == "bfloat16" else torch.float32


def transformer_config(model: ModelConfig, parallel: ParallelConfig, backend: Backend, *,
                       perform_initialization: bool = True) -> Any:
    """The Megatron ``TransformerConfig`` of a Qwen3(-MoE) model under a parallel layout."""
    compat.install()
    from megatron.core.transformer import TransformerConfig

    dtype = _params_dtype(model)
    moe: dict[str, Any] = {}
    if model.num_experts:
        moe = dict(
            num_moe_experts=model.num_experts,
            moe_router_topk=model.moe_router_topk,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=model.moe_aux_loss_coeff,
            moe_router_dtype="fp32",
            moe_grouped_gemm=backend.te,
            moe_permute_fusion=False,
        )
    recompute: dict[str, Any] = {}
    if parallel.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif parallel.recompute == "selective":
        recompute = dict(recompute_granularity="selective")
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        ffn_hidden_size=model.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        qk_layernorm=model.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=parallel.tensor,
        sequence_parallel=parallel.sequence_parallel,
        pipeline_model_parallel_size=parallel.pipeline,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
        context_parallel_size=parallel.context,
        expert_model_parallel_size=parallel.expert,
        expert_tensor_parallel_size=parallel.expert_tensor or parallel.tensor,
        # packed rows differ in length: stages exchange shapes (the interleaved schedule gets one length instead)
        variable_seq_lengths=parallel.pipeline > 1 and parallel.virtual_pipeline is None,
        # set for dense models too: TransformerConfig refuses variable_seq_lengths with its default (allgather)
        # dispatcher whether or not the model has experts
        moe_token_dispatcher_type="alltoall",
        # gloo's batched isend/irecv garbles the interleaved schedule's overlapping exchanges (wrong losses with
        # virtual stages, measured); separate sends and receives are exact. NCCL batches them.
        batch_p2p_comm=backend.cuda,
        use_cpu_initialization=not backend.cuda,
        perform_initialization=perform_initialization,
        # fusions need CUDA kernels (and Transformer Engine for RoPE)
        bias_dropout_fusion=backend.cuda,
        apply_rope_fusion=backend.te,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **moe,
        **recompute,
    )


def layer_spec(model: ModelConfig, backend: Backend) -> Any:
    """One transformer layer: Transformer Engine modules (grouped-GEMM experts) on GPU, torch modules on CPU."""
    compat.install()
    from megatron.core.models.gpt import gpt_layer_specs

    num_experts = model.num_experts or None
    if backend.te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=num_experts is not None, qk_layernorm=model.qk_layernorm)
    from spade_mega.megatron.attention import PackedSegmentAttention

    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=model.qk_layernorm, normalization="RMSNorm")
    # the packed rows' attention per segment with torch's fused kernel, not over the whole [L, L] score matrix
    spec.submodules.self_attention.submodules.core_attention = PackedSegmentAttention
    return spec


def build_model_chunks(model: ModelConfig, config: Any, backend: Backend) -> list[Any]:
    """This rank's GPTModel chunks (one per virtual pipeline stage), on ``backend.device``, not yet wrapped."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    spec = layer_spec(model, backend)
    virtual = ps.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for stage in range(virtual or 1):
        vp_stage = stage if virtual else None
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True,
            share_embeddings_and_output_weights=model.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=int(model.rotary_base),
            vp_stage=vp_stage,
        )
        chunk.to(backend.device)
        if config.bf16:
            chunk = Float16Module(config, chunk)
        chunks.append(chunk)
    return chunks
