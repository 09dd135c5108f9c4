"""The local layers' core attention per packed segment (spade_mega/megatron/attention.py): it recognises exactly the
trainer's block-diagonal causal masks and gives Megatron's DotProductAttention's values and gradients."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import torch
from megatron_launch import worker_env

from spade_mega.megatron.attention import segment_bounds
from spade_mega.megatron.batch import TrainSample, pack, samples_from


def packed_row(lengths: list[int], budget: int):
    samples = samples_from([TrainSample(torch.arange(n) % 7, torch.arange(n) > 0, torch.ones(n)) for n in lengths])
    return pack(samples, token_budget=budget, length_multiple=8).micro_batches[0][0]


def test_segments_are_read_from_the_trainers_packed_mask_and_nothing_else() -> None:
    row = packed_row([5, 3, 4], 16)  # three samples and 4 padding positions in one row
    mask = row.attention_mask()
    assert segment_bounds(mask) == row.cu_seqlens.tolist() == [0, 5, 8, 12, 16]
    causal = ~torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    assert segment_bounds(causal) == [0, 6]
    leaky = mask.clone()
    leaky[0, 0, 10, 1] = False  # a position seeing another sample: not block-diagonal
    assert segment_bounds(leaky) is None
    holed = causal.clone()
    holed[0, 0, 4, 2] = True  # a hole inside a segment
    assert segment_bounds(holed) is None
    assert segment_bounds(causal.float()) is None  # additive masks are not this kind
    assert segment_bounds(causal.expand(2, 1, 6, 6)) is None  # batch > 1


CHECK = textwrap.dedent("""
    import json, os, torch, torch.distributed as dist
    from spade_mega.megatron import compat
    compat.install()
    from megatron.core import parallel_state as ps, tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from spade_mega.config.schema import ModelConfig, ParallelConfig
    from spade_mega.megatron.attention import PackedSegmentAttention
    from spade_mega.megatron.batch import TrainSample, pack, samples_from
    from spade_mega.megatron.providers import select_backend, transformer_config

    dist.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = transformer_config(ModelConfig(num_attention_heads=4, num_query_groups=2, kv_channels=8),
                                ParallelConfig(), select_backend("local"))
    ours, theirs = (cls(config, 1, AttnMaskType.causal, "self")
                    for cls in (PackedSegmentAttention, DotProductAttention))
    samples = samples_from([TrainSample(torch.arange(n) % 5, torch.arange(n) > 0, torch.ones(n)) for n in (37, 9, 50)])
    row = pack(samples, token_budget=100, length_multiple=25).micro_batches[0][0]  # 96 + padding
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, mask in (("packed", row.attention_mask()), ("other", torch.rand(1, 1, 100, 100, generator=g) < 0.3)):
        q, k, v = (torch.randn(100, 1, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
        results = []
        for module in (ours, theirs):
            y = module(q, k, v, mask)
            grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum(), (q, k, v))
            results.append((y, grads))
        (y1, g1), (y2, g2) = results
        out[name] = dict(shape=list(y1.shape), value=float((y1 - y2).abs().max()),
                         grad=max(float((a - b).abs().max()) for a, b in zip(g1, g2)),
                         scale=float(y2.abs().max()))
    # the packed THD layout of context parallelism, here on one rank: [t, heads, dim] inputs, cu_seqlens
    q, k, v = (torch.randn(100, 1, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    results = []
    for y in (ours(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=row.packed_seq_params(torch.device("cpu"))),
              theirs(q, k, v, row.attention_mask())[:, 0]):
        grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum(), (q, k, v))
        results.append((y, grads))
    (y1, g1), (y2, g2) = results
    out["thd"] = dict(shape=list(y1.shape), value=float((y1 - y2).abs().max()),
                      grad=max(float((a - b).abs().max()) for a, b in zip(g1, g2)))
    print(json.dumps(out))
    dist.destroy_process_group()
""")


def test_packed_attention_matches_megatrons_values_and_gradients() -> None:
    """Three samples and padding in a 100-token row, grouped-query heads: the same output and q/k/v gradients as
    Megatron's DotProductAttention up to float rounding, from the mask and from the THD layout (context parallelism's,
    on one rank); a mask of another kind takes Megatron's own path (equal)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(worker_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["packed"]["shape"] == [100, 1, 32]
    assert out["packed"]["scale"] > 0.1
    assert out["packed"]["value"] < 1e-5 and out["packed"]["grad"] < 1e-5, out
    assert out["other"]["value"] == 0.0 and out["other"]["grad"] == 0.0, out
    assert out["thd"]["shape"] == [100, 32] and out["thd"]["value"] < 1e-5 and out["thd"]["grad"] < 1e-5, out


def test_the_cpu_layer_spec_uses_it() -> None:
    from spade_mega.config.schema import ModelConfig
    from spade_mega.megatron.attention import PackedSegmentAttention
    from spade_mega.megatron.providers import layer_spec, select_backend

    spec = layer_spec(ModelConfig(), select_backend("local"))
    assert spec.submodules.self_attention.submodules.core_attention is PackedSegmentAttention
