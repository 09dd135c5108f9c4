"""Megatron <-> Hugging Face names and layouts of Qwen3 / Qwen3-MoE weights: one table, parametrised transforms.

A :class:`Rule` ties one Megatron parameter (its *global* name: global layer number, global expert index) to the
Hugging Face tensors it holds, with a :class:`Transform` that turns the parameter's tensor-parallel shards into those
full tensors and back. :func:`weight_table` lists the rules of an architecture in checkpoint order, for either layer
spec: Megatron's local modules (CPU) or Transformer Engine's (GPU), whose names differ in three places (layer norms
fused into ``linear_qkv`` / dense ``linear_fc1`` as ``layer_norm_weight``; grouped-GEMM experts as
``experts.linear_fc1.weight<e>``). Hugging Face names are those of the checkpoint format (per-expert
``mlp.experts.<e>.gate_proj.weight``), which transformers, vLLM and SGLang load.

Layouts (Megatron-Core's):
- ``linear_qkv`` [groups * (q_per_group + 2) * head_dim, hidden]: per query group, its query heads, then its key,
  then its value head; tensor parallelism splits whole groups, so the shards concatenate into that layout.
- gated ``linear_fc1`` [2 * ffn, hidden]: gate rows then up rows *within each shard* (a rank's shard is its gate
  slice followed by its up slice), so shards must be split before concatenating.
- column-parallel weights split dim 0, row-parallel ones (``linear_proj``, ``linear_fc2``) dim 1; the embedding and
  output layer split the (possibly padded) vocabulary, dim 0; norms and the router are replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from spade_mega.config.schema import ModelConfig
from spade_mega.errors import SpadeError


class BridgeError(SpadeError):
    """Weights that cannot be moved between Megatron and Hugging Face (a checkpoint that does not match the
    architecture, an engine that refused an update, a model this bridge does not know)."""


Shape = tuple[int, ...]


@dataclass(frozen=True)
class Transform:
    """A weight split along ``dim`` over ``size`` ranks (None: replicated), one Hugging Face tensor."""

    dim: Optional[int] = None

    def to_hf(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The full Hugging Face tensors from the ordered shards (one, when replicated)."""
        return [shards[0] if self.dim is None else torch.cat(list(shards), self.dim)]

    def to_megatron(self, hf: Sequence[torch.Tensor], rank: int, size: int, shape: Shape) -> torch.Tensor:
        """Rank ``rank``'s shard (of ``shape``) of the weight whose full Hugging Face tensors are ``hf``."""
        return hf[0] if self.dim is None else hf[0].chunk(size, self.dim)[rank]


@dataclass(frozen=True)
class Vocab(Transform):
    """Embedding / output layer: vocabulary rows split over ranks; Megatron's table may be padded past
    ``vocab_size`` rows (padding is dropped on export, zero on import)."""

    vocab_size: int = 0

    def to_hf(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.cat(list(shards), 0)[:self.vocab_size]]

    def to_megatron(self, hf: Sequence[torch.Tensor], rank: int, size: int, shape: Shape) -> torch.Tensor:
        full = hf[0]
        padded = shape[0] * size
        if padded > full.shape[0]:
            full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
        return full.chunk(size, 0)[rank]


@dataclass(frozen=True)
class GatedFc1(Transform):
    """Gated MLP input: each shard is [gate slice; up slice]; Hugging Face keeps ``gate_proj`` and ``up_proj``."""

    dim: Optional[int] = 0

    def to_hf(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        halves = [s.chunk(2, 0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]

    def to_megatron(self, hf: Sequence[torch.Tensor], rank: int, size: int, shape: Shape) -> torch.Tensor:
        gate, up = hf
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]])


@dataclass(frozen=True)
class FusedQkv(Transform):
    """Fused attention input, interleaved per query group; Hugging Face keeps ``q_proj``, ``k_proj``, ``v_proj``."""

    dim: Optional[int] = 0
    groups: int = 1
    heads: int = 1
    head_dim: int = 1

    def to_hf(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        full = torch.cat(list(shards), 0)
        per_group = self.heads // self.groups
        grouped = full.view(self.groups, per_group + 2, self.head_dim, full.shape[-1])
        q, k, v = grouped.split([per_group, 1, 1], dim=1)
        return [t.reshape(-1, full.shape[-1]) for t in (q, k, v)]

    def to_megatron(self, hf: Sequence[torch.Tensor], rank: int, size: int, shape: Shape) -> torch.Tensor:
        q, k, v = hf
        hidden = q.shape[-1]
        per_group = self.heads // self.groups
        grouped = torch.cat([q.view(self.groups, per_group, self.head_dim, hidden),
                             k.view(self.groups, 1, self.head_dim, hidden),
                             v.view(self.groups, 1, self.head_dim, hidden)], dim=1)
        return grouped.chunk(size, 0)[rank].reshape(-1, hidden)


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter (global name) and the Hugging Face tensors it holds, with their full shapes.

    ``expert``: split over the expert-tensor-parallel ranks (and placed by expert parallelism) instead of the
    tensor-parallel ones. ``export``: False for the output layer of a model with tied embeddings (Hugging Face keeps
    only ``embed_tokens``; the output layer is loaded from it)."""

    megatron: str
    hf: tuple[str, ...]
    shapes: tuple[Shape, ...]
    transform: Transform
    expert: bool = False
    export: bool = True


def _layer_rules(model: ModelConfig, te: bool, layer: int) -> list[Rule]:
    m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    hidden, d = model.hidden_size, model.kv_channels
    heads, groups = model.num_attention_heads, model.num_query_groups
    moe = model.num_experts > 0
    replicated, column, row = Transform(), Transform(0), Transform(1)
    qkv = FusedQkv(groups=groups, heads=heads, head_dim=d)
    rules = [
        Rule(m + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"),
             (h + "input_layernorm.weight",), ((hidden,),), replicated),
        Rule(m + "self_attention.linear_qkv.weight",
             tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"),
             ((heads * d, hidden), (groups * d, hidden), (groups * d, hidden)), qkv),
        Rule(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",), ((d,),), replicated),
        Rule(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",), ((d,),), replicated),
        Rule(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), ((hidden, heads * d),), row),
        Rule(m + ("mlp.linear_fc1.layer_norm_weight" if te and not moe else "pre_mlp_layernorm.weight"),
             (h + "post_attention_layernorm.weight",), ((hidden,),), replicated),
    ]
    if not moe:
        ffn = model.ffn_hidden_size
        return rules + [
            Rule(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                 ((ffn, hidden), (ffn, hidden)), GatedFc1()),
            Rule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), ((hidden, ffn),), row),
        ]
    rules.append(Rule(m + "mlp.router.weight", (h + "mlp.gate.weight",), ((model.num_experts, hidden),), replicated))
    ffn = model.moe_ffn_hidden_size
    for e in range(model.num_experts):
        fc1, fc2 = (f"mlp.experts.linear_fc{n}.weight{e}" if te else
                    f"mlp.experts.local_experts.{e}.linear_fc{n}.weight" for n in (1, 2))
        x = f"{h}mlp.experts.{e}."
        rules += [Rule(m + fc1, (x + "gate_proj.weight", x + "up_proj.weight"), ((ffn, hidden), (ffn, hidden)),
                       GatedFc1(), expert=True),
                  Rule(m + fc2, (x + "down_proj.weight",), ((hidden, ffn),), row, expert=True)]
    return rules


def weight_table(model: ModelConfig, te: bool) -> list[Rule]:
    """Every weight of ``model`` in checkpoint order, named for the Transformer Engine spec (``te``) or the local
    one."""
    vocab = Vocab(0, vocab_size=model.vocab_size)
    embedding = (model.vocab_size, model.hidden_size)
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), (embedding,), vocab)]
    for layer in range(model.num_layers):
        rules += _layer_rules(model, te, layer)
    rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), ((model.hidden_size,),), Transform()))
    # tied: only a last pipeline stage other than the first holds an output layer, a copy of the embedding
    output = ("model.embed_tokens.weight",) if model.tie_embeddings else ("lm_head.weight",)
    rules.append(Rule("output_layer.weight", output, (embedding,), vocab, export=not model.tie_embeddings))
    return rules


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..*)$|^(mlp\.experts\.linear_fc\d\.weight)(\d+)()$")


def global_name(chunk: Any, local: str) -> str:
    """The global name of parameter ``local`` of GPTModel ``chunk``: its layer numbered in the whole model (pipeline
    stages and virtual stages hold consecutive slices) and its experts by global index (expert parallelism)."""
    match = _LAYER.match(local)
    if match is None:
        return local
    layer = chunk.decoder.layers[int(match.group(1))]
    rest = match.group(2)
    expert = _EXPERT.match(rest)
    if expert is not None:
        head, index, tail = (g for g in expert.groups() if g is not None)
        rest = f"{head}{layer.mlp.local_expert_indices[int(index)]}{tail}"
    return f"decoder.layers.{layer.layer_number - 1}.{rest}"
