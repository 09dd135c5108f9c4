"""Decode throughput of the in-process hf engine, against a naive no-cache loop measured in the same run.

    python -m tools.bench engine [--config examples/configs/tiny_cpu.yaml] [--batch 8] [--prompt 64] [--new 64]
    python tools/bench/engine.py ...

Both decode the same greedy completions of the same left-padded batch with the same model:
- engine: ``HFEngine.generate`` (KV cache, finished rows leave the batch, our sampling and log-probs);
- baseline: a loop that re-runs the full forward over prompt + everything generated so far at every step (what a
  sampler without a cache pays: quadratic in the completion length).
Greedy decoding makes the two token streams comparable: the bench checks they agree and prints tokens/s and the ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spade_mega.config.loader import load_config  # noqa: E402
from spade_mega.inference.base import GenerationRequest, SamplingParams  # noqa: E402
from spade_mega.inference.hf import HFEngine  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@torch.inference_mode()
def naive_greedy(model: torch.nn.Module, prompts: list[tuple[int, ...]], new_tokens: int, pad: int,
                 device: torch.device) -> list[list[int]]:
    """Greedy decoding without a cache: every step forwards the whole (left-padded) sequence again."""
    width = max(map(len, prompts))
    ids = torch.tensor([(pad,) * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    out = []
    for _ in range(new_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1).logits[:, -1]
        token = logits.float().argmax(-1)
        out.append(token)
        ids = torch.cat([ids, token[:, None]], dim=1)
        mask = torch.cat([mask, mask.new_ones((len(prompts), 1))], dim=1)
    return torch.stack(out, dim=1).tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "configs" / "tiny_cpu.yaml"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens (requests vary from half to all)")
    parser.add_argument("--new", type=int, default=64, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = load_config(args.config)
    torch.manual_seed(0)
    vocab = cfg.model.vocab_size
    # prompts avoid the last id; should greedy decoding hit it, the engine stops early and only shared tokens compare
    engine = HFEngine(cfg.model, eos_token_id=vocab - 1, pad_token_id=0, device=args.device,
                      max_batch_size=args.batch)
    gen = torch.Generator().manual_seed(1)
    prompts = [tuple(torch.randint(1, vocab - 1, (args.prompt // 2 + i * args.prompt // (2 * args.batch),),
                                   generator=gen).tolist()) for i in range(args.batch)]
    requests = [GenerationRequest(p, SamplingParams(max_new_tokens=args.new, temperature=0.0)) for p in prompts]
    print(f"model {cfg.model.name}: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, "
          f"{cfg.model.num_experts} experts; batch {args.batch}, prompts {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, {args.new} new tokens, on {engine.device} "
          f"({torch.get_num_threads()} CPU threads)")

    engine.generate(requests[:1])  # warm-up
    best_engine = best_naive = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        generations = engine.generate(requests)
        best_engine = min(best_engine, time.perf_counter() - start)
        start = time.perf_counter()
        naive = naive_greedy(engine.model, prompts, args.new, pad=0, device=engine.device)
        best_naive = min(best_naive, time.perf_counter() - start)
    produced = sum(len(g.output_ids) for g in generations)
    # an early eos shortens the engine's completion; compare the tokens both produced
    agree = all(list(g.output_ids) == n[:len(g.output_ids)] for g, n in zip(generations, naive))
    print(f"engine   KV cache  {produced / best_engine:9.1f} tokens/s ({best_engine * 1e3:7.1f} ms)")
    print(f"baseline no cache {args.batch * args.new / best_naive:9.1f} tokens/s ({best_naive * 1e3:7.1f} ms)")
    print(f"ratio engine / no-cache baseline: {(produced / best_engine) / (args.batch * args.new / best_naive):.2f}x"
          f"   greedy tokens agree: {agree}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
