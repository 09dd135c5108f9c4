"""GRPO train-step throughput of the Megatron trainer: tokens/s and peak memory per parallel layout.

    python -m tools.bench train_step [--layouts tp1 tp2_sp ep2 pp2 tp2_ep2] [--steps 5] [--samples 32]
    python tools/bench/train_step.py ...

Each layout runs in its own torchrun job (gloo on CPU; on GPU NCCL, gloo for host tensors) on the tiny Qwen3-MoE of
the default ``model`` section: a fixed global batch of variable-length multi-turn samples (behaviour and old
log-probs given, so a step is forward + backward + optimizer, no extra log-prob forward), one warm-up step, then the
mean of ``--steps`` steps.
Printed against the baseline measured in the same run: the one-process layout (tp1). On CPU the processes share the
machine's cores, so the ratios show the cost of the parallel machinery (collectives, pipeline bubbles), not a speed-up.

The optimizer's passes over the gradients: a model of more parameters than tokens (4 layers, hidden 512, 8 experts;
4 samples of 16-32 tokens), so that the per-parameter work after the backward (grad-norm check, main-gradient copy,
norm, Adam) weighs; one process, its steps alternating between the overflow check of megatron-core 0.16 (and of
this tree before: prepare_grads and get_grad_norm asked once more before Megatron's step, the baseline) and the one
Megatron's step makes on its own norm (``grad_norm_skip_threshold``).

With a CUDA GPU it also measures the model FLOPs utilisation (MFU) of a one-layer slice of Qwen3-30B-A3B (the config
in examples/hf/qwen3_30b_a3b; 128 experts, top-8) on one GPU, against the GPU's dense bf16 peak (``--peak-tflops``,
known for A100/H100/H200). Without one it says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import _jobs as jobs  # noqa: E402  (after the path set-up of a script run)

ROOT = Path(__file__).resolve().parents[2]
QWEN3_30B = ROOT / "examples/hf/qwen3_30b_a3b/config.json"
LAYOUTS = jobs.LAYOUTS
DENSE_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # per GPU, without sparsity


def synthetic_batch(samples: int, vocab: int, max_len: int, seed: int = 0) -> list:
    """Multi-turn samples of both roles, 25% to 100% of ``max_len`` tokens, half of them the model's own."""
    import torch

    from spade_mega.megatron import TrainSample

    g = torch.Generator().manual_seed(seed)
    batch = []
    for i in range(samples):
        n = int(torch.randint(max_len // 4, max_len + 1, (1,), generator=g))
        mask = (torch.arange(n) // 8) % 2 == 1  # alternating 8-token observation / model turns
        mask[0] = False
        old = -math.log(vocab) + 0.1 * torch.randn(n, generator=g)
        batch.append(TrainSample(torch.randint(0, vocab, (n,), generator=g), mask, torch.where(mask, 1.0, -0.5),
                                 role="designer" if i % 4 == 0 else "agent", old_logprobs=old,
                                 rollout_logprobs=old + 0.05 * torch.randn(n, generator=g)))
    return batch


def measure(trainer: Any, batch: list, steps: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    trainer.train_step(batch)  # warm-up
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step(batch)
        dist.barrier()
        times.append(time.perf_counter() - start)
    step_s = sum(times) / len(times)
    if torch.cuda.is_available():
        peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**20], dtype=torch.float64)
    else:
        peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tokens = sum(len(s) for s in batch)
    return {"step_s": step_s, "tokens": tokens, "tokens_per_s": tokens / step_s, "peak_mib": float(peak)}


def qwen3_layer_flops_per_token(model: Any, seq: int) -> float:
    """Model FLOPs of one training token (forward + backward = 3 x forward) through the model: each matmul weight
    a token uses costs 2 FLOPs per weight forward; causal attention adds 2 x 2 x (seq / 2) x q_dim per layer."""
    h, q = model.hidden_size, model.num_attention_heads * model.kv_channels
    kv = model.num_query_groups * model.kv_channels
    attention = h * q + 2 * h * kv + q * h
    experts = model.moe_router_topk * 3 * h * model.moe_ffn_hidden_size + h * model.num_experts
    per_layer = 2 * (attention + experts) + 2 * 2 * (seq / 2) * q
    return 3 * (model.num_layers * per_layer + 2 * h * model.vocab_size)


# a model whose parameters outweigh its tokens (the optimizer's passes bench): ~30M parameters
WIDE = ["model.num_layers=4", "model.hidden_size=512", "model.ffn_hidden_size=1024", "model.num_attention_heads=8",
        "model.num_query_groups=4", "model.kv_channels=64", "model.num_experts=8", "model.moe_ffn_hidden_size=512"]


def optimizer_passes(trainer: Any, batch: list, rounds: int) -> dict[str, float]:
    """Mean CPU seconds of a step with the norm asked before the step (two passes) and left to Megatron's step
    (one), the two alternating step by step after a warm-up of each; and the pass removed alone (prepare_grads and
    get_grad_norm over the last step's gradients, median of 11): the gain to expect, which noise can hide."""
    import torch.distributed as dist

    times: dict[bool, list[float]] = {True: [], False: []}
    for k in range(2 * (rounds + 1)):
        one_pass = k % 2 == 1
        trainer._optimizer_skips_overflow = one_pass
        dist.barrier()
        start = time.process_time()  # CPU seconds of the process: the machine may be shared
        trainer.train_step(batch)
        if k >= 2:
            times[one_pass].append(time.process_time() - start)
    removed = []
    for _ in range(11):
        start = time.process_time()
        trainer.optimizer.prepare_grads()
        trainer.optimizer.get_grad_norm()
        removed.append(time.process_time() - start)
    return {"two_pass_s": sum(times[False]) / rounds, "one_pass_s": sum(times[True]) / rounds,
            "removed_pass_s": sorted(removed)[5]}


def kl_swaps(trainer: Any, batch: list, rounds: int, per_step: int) -> dict[str, float]:
    """Seconds a rollout of ``len(batch) / per_step`` optimizer steps spends on the KL reference (rl.kl_coef > 0):
    swapped in for each step's own forward (the baseline, what each train_step did before the loop's pre-pass) and
    once for the rollout's (Trainer.reference_logprobs_of_steps); the swaps' copies alone (ReferencePolicy.exchange)
    and with the forwards. The two alternate, the mean of ``rounds`` each after a warm-up of each."""
    from spade_mega.megatron.reference import ReferencePolicy

    copying = [0.0]
    exchange = ReferencePolicy.exchange

    def timed(self: ReferencePolicy) -> None:
        start = time.perf_counter()
        exchange(self)
        copying[0] += time.perf_counter() - start

    ReferencePolicy.exchange = timed  # type: ignore[method-assign]
    steps = [batch[i:i + per_step] for i in range(0, len(batch), per_step)]
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for k in range(2 * (rounds + 1)):
        once = k % 2 == 1
        copying[0] = 0.0
        start = time.perf_counter()
        if once:
            trainer.reference_logprobs_of_steps(steps)
        else:
            for step in steps:
                trainer.reference_logprobs(step)
        if k >= 2:
            times[once].append((copying[0], time.perf_counter() - start))
    ReferencePolicy.exchange = exchange  # type: ignore[method-assign]
    mean = {once: [sum(t[i] for t in times[once]) / rounds for i in (0, 1)] for once in (False, True)}
    return {"steps": len(steps), "per_step_swap_s": mean[False][0], "per_step_s": mean[False][1],
            "per_rollout_swap_s": mean[True][0], "per_rollout_s": mean[True][1]}


def worker(args: argparse.Namespace) -> None:
    import torch

    from spade_mega.config.loader import apply_overrides, build, to_dict
    from spade_mega.config.schema import SpadeConfig
    from spade_mega.megatron import Trainer

    torch.set_num_threads(1 if not torch.cuda.is_available() else torch.get_num_threads())
    data = to_dict(SpadeConfig())
    data["optimizer"]["lr"] = 1e-5
    data["parallel"]["max_tokens_per_gpu"] = args.token_budget
    cfg = build(SpadeConfig, apply_overrides(data, args.overrides))
    if args.mfu:  # one layer of Qwen3-30B-A3B, with its full vocabulary
        from spade_mega.megatron.providers import model_config_from_hf

        cfg.model = dataclasses.replace(model_config_from_hf(QWEN3_30B, base=cfg.model), num_layers=1,
                                        hf_config=None)
    cfg.check()
    trainer = Trainer(cfg)
    batch = synthetic_batch(args.samples, trainer.model_cfg.vocab_size, args.max_len)
    if args.passes:
        if not trainer._optimizer_skips_overflow:
            raise SystemExit("this megatron-core has no grad_norm_skip_threshold: its step is always two passes")
        print("RESULT " + json.dumps(optimizer_passes(trainer, batch, args.steps)), flush=True)
        return
    if args.kl_swaps:
        print("RESULT " + json.dumps(kl_swaps(trainer, batch, args.steps, per_step=4)), flush=True)
        return
    result = measure(trainer, batch, args.steps)
    if args.mfu:
        mean_len = result["tokens"] / len(batch)
        flops = qwen3_layer_flops_per_token(trainer.model_cfg, int(mean_len)) * result["tokens_per_s"]
        result.update(model_tflops=flops / 1e12, peak_tflops=args.peak_tflops, mfu=flops / (args.peak_tflops * 1e12))
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def launch(nproc: int, argv: list[str]) -> dict[str, Any]:
    return jobs.launch(str(Path(__file__).resolve()), nproc, argv)


def gpu_layer_impl() -> list[str]:
    """Transformer Engine where it imports; otherwise Megatron's local torch layers on the GPU (said in the output)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return ["model.transformer_impl=local"]
    return []


def gpu_peak_tflops(requested: float | None) -> float | None:
    import torch

    if requested:
        return requested
    name = torch.cuda.get_device_name()
    return next((v for k, v in DENSE_BF16_TFLOPS.items() if k in name), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench train_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (default: known for A100/H100/H200)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mfu", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--passes", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kl-swaps", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_intermixed_args(argv)
    if args.worker:
        worker(args)
        return 0

    import torch

    common = ["--steps", str(args.steps), "--samples", str(args.samples), "--max-len", str(args.max_len),
              "--token-budget", str(args.token_budget)]
    gpus = torch.cuda.device_count()
    impl = gpu_layer_impl() if gpus else []
    device = (f"{gpus} x {torch.cuda.get_device_name()}, NCCL, "
              f"{'Megatron local layers (no Transformer Engine)' if impl else 'Transformer Engine layers'}"
              if gpus else "CPU (gloo, one thread per process)")
    from spade_mega.config.schema import ModelConfig

    m = ModelConfig()
    print(f"GRPO train step, {m.name} ({m.num_layers} layers, hidden {m.hidden_size}, {m.num_experts} experts "
          f"top-{m.moe_router_topk}, vocab {m.vocab_size}), {args.samples} samples of {args.max_len // 4}-{args.max_len}"
          f" tokens, token budget {args.token_budget}, {device}")
    print("| layout | processes | step (s) | tokens/s | vs tp1 | peak memory per process (MiB) |")
    print("|---|---|---|---|---|---|")
    baseline = None
    for name in ["tp1"] + [n for n in args.layouts if n != "tp1"]:
        nproc, overrides = LAYOUTS[name]
        if gpus and nproc > gpus:
            print(f"| {name} | {nproc} | not run: needs {nproc} GPUs, this machine has {gpus} | | | |", flush=True)
            continue
        r = launch(nproc, common + overrides + impl)
        baseline = baseline or r["tokens_per_s"]
        print(f"| {name} | {nproc} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
              f"x{r['tokens_per_s'] / baseline:.2f} | {r['peak_mib']:,.0f} |", flush=True)
    r = launch(1, ["--passes", "--steps", str(2 * args.steps), "--samples", "4", "--max-len", "32", *WIDE, *impl])
    print(f"Optimizer passes over the gradients, one process, 4 layers hidden 512 8 experts (~30M parameters), 4 "
          f"samples of 8-32 tokens, CPU seconds per step, mean of {2 * args.steps} steps each: norm asked before the step (baseline, "
          f"megatron-core 0.16's path) {r['two_pass_s']:.3f} s, judged by Megatron's step on its own norm "
          f"{r['one_pass_s']:.3f} s: x{r['two_pass_s'] / r['one_pass_s']:.2f} faster; the pass removed alone "
          f"{1e3 * r['removed_pass_s']:.1f} ms ({100 * r['removed_pass_s'] / r['two_pass_s']:.1f}% of a step)", flush=True)
    r = launch(1, ["--kl-swaps", "--steps", str(args.steps), "--samples", "16", "--max-len", "32", *WIDE,
                   "rl.kl_coef=0.1", *impl])
    print(f"KL reference (rl.kl_coef > 0), one process, ~30M parameters, a rollout of {r['steps']} optimizer steps of "
          f"4 samples of 8-32 tokens, mean of {args.steps}: swapped in for each step (baseline) "
          f"{r['per_step_swap_s']:.3f} s of copies ({r['per_step_s']:.3f} s with the forwards), once per rollout "
          f"{r['per_rollout_swap_s']:.3f} s ({r['per_rollout_s']:.3f} s): "
          f"x{r['per_step_swap_s'] / r['per_rollout_swap_s']:.2f} less time swapping, "
          f"x{r['per_step_s'] / r['per_rollout_s']:.2f} for the reference's whole pass", flush=True)
    if not torch.cuda.is_available():
        print("MFU of a one-layer Qwen3-30B-A3B slice: not measured, no CUDA GPU on this machine.")
        return 0
    peak = gpu_peak_tflops(args.peak_tflops)
    if peak is None:
        print(f"MFU: unknown peak for {torch.cuda.get_device_name()}; pass --peak-tflops")
        return 0
    r = launch(1, ["--mfu", "--peak-tflops", str(peak), "--steps", str(args.steps), "--samples", "16",
                   "--max-len", "4096", "--token-budget", "8192", *impl])
    print(f"MFU, one-layer Qwen3-30B-A3B slice (128 experts, top-8; 16 samples of 1024-4096 tokens; 1 GPU): "
          f"{r['model_tflops']:.1f} model TFLOP/s of {peak:.0f} peak = {100 * r['mfu']:.1f}% "
          f"({r['tokens_per_s']:,.0f} tokens/s, peak memory {r['peak_mib']:,.0f} MiB"
          f"{', Megatron local layers: no Transformer Engine here' if impl else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
