"""Triton kernels: time, achieved bandwidth against a device-to-device copy measured in the same run, and speed-up
over torch eager, torch.compile and Liger-Kernel's ``triton_grpo_loss`` (when installed) on the same computation.

    python -m tools.bench kernels [--tokens 4096 16384 65536] [--vocab 151936] [--samples 1000000]
    python tools/bench/kernels.py ...

Rows (bf16 logits, temperature 0.6, SPADE's clip 0.2/0.28 and TIS clip 2.0):
- ``tis_logprob fwd+bwd``: per-token TIS-weighted PPO-clip loss, token mean, gradient on the logits. Compulsory
  traffic: the logits read twice and their gradient written once (3 x tokens x vocab x 2 bytes).
- ``logprob+entropy fwd``: the no-grad forward that recomputes old log-probs (and the entropy metric): one read.
- ``grpo_advantage``: per-role advantages of a mixed batch (agents in groups of 16, 10% designers over 6 skills) and
  of agents alone, end to end (host segment sort included) and the kernel alone (CUDA graph replays, per tile size).
  Compulsory traffic: end to end, the rewards, three id arrays and the output (32 bytes a sample); the kernel alone,
  the sorted permutation and segment ids (int32), the rewards and the output (16 bytes a sample).
The baselines compute the same thing: the eager functions below (log-softmax over the full vocabulary), the same
compiled with ``torch.compile``, and for the loss Liger's fused GRPO loss without TIS (its newer ``vllm_is_ratio``
is not in every release) against our op without TIS, one sequence so that both reduce to the token mean.

Targets (issue 6): tis_logprob fwd+bwd >= 70% of copy bandwidth at 16k tokens x 151,936 and >= 5x torch eager;
grpo_advantage >= 50% of copy bandwidth at one million samples.

Without a CUDA GPU this checks correctness only: small shapes, the kernels under the Triton interpreter, and the
eager baselines above against them; it prints no timings and exits 0 (1 if a check fails).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TEMPERATURE = 0.6
EPS_LOW, EPS_HIGH, TIS_LOW, TIS_CLIP, LOG_RATIO_LIMIT = 0.2, 0.28, 0.0, 2.0, 20.0
GROUP, SKILLS, DESIGNER_FRACTION = 16, 6, 0.1


# ----------------------------------------------------------------------------------------------- eager baselines
def eager_tis_loss(logits, tokens, old, adv, rollout, mask):
    """The unfused loss: full fp32 log-softmax, gather, ratio, clip, TIS; token mean over the mask."""
    import torch

    lp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    ratio = torch.exp((lp - old).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH))
    if rollout is not None:
        pg = pg * torch.exp((old - rollout).clamp(max=math.log(TIS_CLIP))).clamp(TIS_LOW, TIS_CLIP)
    return torch.where(mask, pg, 0.0).sum() / mask.sum()


def eager_logprob_entropy(logits, tokens):
    import torch

    logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
    return logp.gather(-1, tokens[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def fused_tis_loss(logits, tokens, old, adv, rollout, mask):
    from spade_mega.kernels.tis_logprob import tis_logprob

    out = tis_logprob(logits, tokens, old, adv, rollout_logprobs=rollout, loss_mask=mask, temperature=TEMPERATURE,
                      eps_clip_low=EPS_LOW, eps_clip_high=EPS_HIGH, tis_clip_low=TIS_LOW, tis_clip=TIS_CLIP)
    return out.loss.sum() / mask.sum()


def fused_logprob_entropy(logits, tokens):
    from spade_mega.kernels.tis_logprob import tis_logprob

    out = tis_logprob(logits, tokens, temperature=TEMPERATURE, with_entropy=True)
    return out.logprobs, out.entropy


def liger_loss_fn() -> Optional[Callable]:
    """Liger's fused GRPO loss on our single-sequence layout, or None when liger-kernel is not installed.

    ``logits_plus_one`` is ``[tokens + 1, vocab]``: Liger reads ``[batch, L + 1, vocab]`` and drops the last
    position. Its ``bnpo`` reduction is the token mean over the mask, the same as :func:`fused_tis_loss`."""
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except ImportError:
        return None

    def run(logits_plus_one, tokens, old, adv, mask):
        loss, _ = triton_grpo_loss(logits_plus_one[None], old[None], None, tokens[None], adv[:1], mask[None].int(),
                                   temperature=TEMPERATURE, beta=0.0, eps_low=EPS_LOW, eps_high=EPS_HIGH,
                                   inplace=False, loss_type="bnpo", reduce=True)
        return loss

    return run


# ----------------------------------------------------------------------------------------------- inputs
def tis_inputs(n_tokens: int, vocab: int, dtype, device: str, seed: int = 0, extra_row: bool = False) -> dict:
    """Random logits (one spare row for Liger's [B, L+1, V] layout), old log-probs near the policy's, rollout ones
    further off, one advantage for the whole sequence, 10% of the tokens masked."""
    import torch

    from spade_mega.kernels.tis_logprob import tis_logprob

    g = torch.Generator(device=device).manual_seed(seed)
    full = torch.randn(n_tokens + int(extra_row), vocab, generator=g, device=device, dtype=dtype).mul_(2)
    logits = full[:n_tokens]
    tokens = torch.randint(0, vocab, (n_tokens,), generator=g, device=device)
    with torch.no_grad():
        lp = tis_logprob(logits, tokens, temperature=TEMPERATURE).logprobs
    old = lp + 0.2 * torch.randn(n_tokens, generator=g, device=device)
    rollout = old + 0.5 * torch.randn(n_tokens, generator=g, device=device)
    adv = torch.full((n_tokens,), 0.7, device=device)
    mask = torch.rand(n_tokens, generator=g, device=device) > 0.1
    return dict(full=full, logits=logits, tokens=tokens, old=old, adv=adv, rollout=rollout, mask=mask)


def advantage_inputs(n: int, device: str, seed: int = 0, designer_fraction: float = DESIGNER_FRACTION) -> dict:
    """Agents in groups of 16 in sample order; ``designer_fraction`` of the samples are designers over 6 skills (so
    at 1e6 samples and 10%, six segments of ~16,700: the large-segment case)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    designer = torch.rand(n, generator=g, device=device) < designer_fraction
    return dict(rewards=torch.rand(n, generator=g, device=device),
                group_ids=torch.arange(n, device=device) // GROUP,
                roles=designer.long(),
                skill_ids=torch.randint(0, SKILLS, (n,), generator=g, device=device))


# ----------------------------------------------------------------------------------------------- CPU: correctness
def check_correctness() -> int:
    import torch

    from spade_mega.kernels import grpo_advantage, tis_logprob
    from spade_mega.kernels.dispatch import LAUNCHES, interpreted
    from spade_mega.rl.advantages import grpo_advantages

    if not interpreted(tis_logprob._shard_stats_kernel):
        print("the kernels were imported before TRITON_INTERPRET=1 was set: run this as its own process")
        return 1
    failures = 0

    def report(name: str, err: float, tol: float) -> None:
        nonlocal failures
        ok = err <= tol
        failures += not ok
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: max error {err:.2e} (tolerance {tol:.0e})")

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = tis_inputs(48, 1000, dtype, "cpu", seed=1)
        grads = []
        for fn in (fused_tis_loss, eager_tis_loss):
            leaf = x["logits"].detach().clone().requires_grad_(True)
            loss = fn(leaf, x["tokens"], x["old"], x["adv"], x["rollout"], x["mask"])
            grads.append((loss.detach(), torch.autograd.grad(loss, leaf)[0].float()))
        report(f"tis_logprob loss vs eager ({dtype})", float((grads[0][0] - grads[1][0]).abs()), 1e-5)
        scale = float(grads[1][1].abs().max())
        report(f"tis_logprob logits gradient vs eager ({dtype}, relative)",
               float((grads[0][1] - grads[1][1]).abs().max()) / scale, tol)
        fused, eager = fused_logprob_entropy(x["logits"], x["tokens"]), eager_logprob_entropy(x["logits"], x["tokens"])
        report(f"log-prob and entropy vs eager ({dtype})",
               max(float((a - b).abs().max()) for a, b in zip(fused, eager)), 1e-4)
    liger = liger_loss_fn()
    if liger is None:
        print("  (liger-kernel not installed: the Liger baseline is not checked)")
    else:  # the GPU table's Liger column compares like with like: the same loss and gradient, without TIS
        x = tis_inputs(48, 1000, torch.float32, "cpu", seed=3, extra_row=True)
        ours = x["logits"].detach().clone().requires_grad_(True)
        theirs = x["full"].detach().clone().requires_grad_(True)
        a = fused_tis_loss(ours, x["tokens"], x["old"], x["adv"], None, x["mask"])
        b = liger(theirs, x["tokens"], x["old"], x["adv"], x["mask"])
        report("tis_logprob loss (no TIS) vs Liger's triton_grpo_loss", float((a - b).detach().abs()), 1e-5)
        g_ours, g_theirs = torch.autograd.grad(a, ours)[0], torch.autograd.grad(b, theirs)[0]
        report("logits gradient vs Liger's (relative)", float((g_ours - g_theirs[:-1]).abs().max())
               / float(g_theirs.abs().max()), 1e-5)
    a = advantage_inputs(2000, "cpu", seed=2)
    fused = grpo_advantage.grpo_advantage(a["rewards"], a["group_ids"], a["roles"], a["skill_ids"], 12.0).samples
    eager = grpo_advantages(a["rewards"], a["group_ids"], a["roles"], a["skill_ids"], 12.0)
    report("grpo_advantage vs rl.advantages (2000 samples)", float((fused - eager).abs().max()), 1e-6)
    ran = sorted(name for name, count in LAUNCHES.items() if count)
    print(f"  kernels that ran (interpreted): {', '.join(ran)}")
    print(f"{'all checks passed' if not failures else f'{failures} check(s) failed'}")
    return 1 if failures else 0


# ----------------------------------------------------------------------------------------------- GPU: timings
def agreement_with_eager(x: dict) -> str:
    """Our loss and logits gradient against the eager baseline on the benchmark's own inputs (a timing of a wrong
    result is worth nothing); the gradient over its first 1,024 rows, to bound the comparison's memory."""
    import torch

    results = []
    for fn in (fused_tis_loss, eager_tis_loss):
        leaf = x["logits"].detach().requires_grad_(True)
        try:
            loss = fn(leaf, x["tokens"], x["old"], x["adv"], x["rollout"], x["mask"])
            results.append((float(loss.detach()), torch.autograd.grad(loss, leaf)[0][:1024].float()))
        except torch.cuda.OutOfMemoryError:
            return f"{fn.__name__} ran out of memory: agreement not checked"
        finally:
            del leaf
            torch.cuda.empty_cache()
    (ours, g_ours), (eager, g_eager) = results
    rel = float((g_ours - g_eager).abs().max()) / max(float(g_eager.abs().max()), 1e-30)
    return (f"loss {ours:.6f} vs eager {eager:.6f} (|difference| {abs(ours - eager):.1e}), logits gradient relative "
            f"error {rel:.1e} (a bf16 gradient is off by up to ~1e-2 of its largest entry)")


def benchmark(args: argparse.Namespace) -> int:
    import torch
    import triton
    from triton.testing import do_bench, do_bench_cudagraph

    from spade_mega.kernels.grpo_advantage import GrpoAdvantageFunction, _segments, grpo_advantage
    from spade_mega.rl.advantages import grpo_advantages

    dry = args.cpu_dry_run  # the same code on CPU at toy shapes: wiring checked, nothing timed that means anything
    device = "cpu" if dry else "cuda"
    print(f"# {datetime.date.today()} `python -m tools.bench kernels {' '.join(args.argv)}`")
    print(f"# {'CPU dry run (interpreted kernels; times mean nothing)' if dry else torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, triton {triton.__version__}")

    def timed(fn: Optional[Callable[[], object]], graph: bool = False):
        """Median milliseconds, or None when the function does not fit in memory or does not compile; False when
        there is nothing to time (no torch.compile in a dry run). ``graph``: replay a CUDA graph of ``fn``, so a
        microsecond-scale kernel is timed without the Python launch overhead."""
        if fn is None:
            return False
        try:
            if dry:
                start = time.perf_counter()
                fn()
                return 1e3 * (time.perf_counter() - start)
            if graph:
                fn()  # compile outside the capture
                return do_bench_cudagraph(fn, rep=args.rep_ms, return_mode="median")
            return do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
        except torch.cuda.OutOfMemoryError:
            return None
        except Exception as exc:  # noqa: BLE001  (a torch.compile failure, say: report it, keep benchmarking)
            print(f"#   failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}")
            return None
        finally:
            torch.cuda.empty_cache()

    src = torch.empty(args.copy_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_ms = timed(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() * 2 / copy_ms / 1e6
    del src, dst
    print(f"# device-to-device copy of {args.copy_bytes / 2**30:.1f} GiB: {copy_gbs:,.0f} GB/s (read + write)")
    print("| op | shape | ms | GB/s | % of copy | x eager | x torch.compile | x Liger |")
    print("|---|---|---|---|---|---|---|---|")

    def row(op: str, shape: str, ms: Optional[float], nbytes: float, eager, compiled, liger) -> None:
        """Baseline times in ms; None: it ran out of memory or failed; False: not measured for this row."""
        if ms is None:
            print(f"| {op} | {shape} | OOM/failed | | | | | |", flush=True)
            return

        def ratio(base) -> str:
            return "n/a" if base is False else "OOM/failed" if base is None else f"{base / ms:.2f}"

        gbs = nbytes / ms / 1e6
        print(f"| {op} | {shape} | {ms:.3f} | {gbs:,.0f} | {100 * gbs / copy_gbs:.0f}% | {ratio(eager)} | "
              f"{ratio(compiled)} | {ratio(liger)} |", flush=True)

    def compiled(fn: Callable, **options) -> Optional[Callable]:
        return None if dry else torch.compile(fn, **options)

    compiled_loss, compiled_lpe = compiled(eager_tis_loss), compiled(eager_logprob_entropy)
    liger = liger_loss_fn()
    for n_tokens in args.tokens:
        x = tis_inputs(n_tokens, args.vocab, torch.bfloat16, device, extra_row=True)
        leaf = x["logits"].detach().requires_grad_(True)

        def fwd_bwd(fn, with_tis: bool = True):
            def run():
                loss = fn(leaf, x["tokens"], x["old"], x["adv"], x["rollout"] if with_tis else None, x["mask"])
                torch.autograd.grad(loss, leaf)
            return run

        shape = f"{n_tokens} x {args.vocab}"
        elements = n_tokens * args.vocab
        print(f"# {shape}: {agreement_with_eager(x)}", flush=True)
        ours = timed(fwd_bwd(fused_tis_loss))
        row("tis_logprob fwd+bwd (TIS)", shape, ours, 3 * elements * 2, timed(fwd_bwd(eager_tis_loss)),
            timed(compiled_loss and fwd_bwd(compiled_loss)), False)
        if liger is not None:
            full = x["full"].detach().requires_grad_(True)

            def liger_run():
                loss = liger(full, x["tokens"], x["old"], x["adv"], x["mask"])
                torch.autograd.grad(loss, full)

            no_tis = timed(fwd_bwd(fused_tis_loss, with_tis=False))
            with torch.no_grad():
                diff = abs(float(fused_tis_loss(leaf, x["tokens"], x["old"], x["adv"], None, x["mask"]))
                           - float(liger(full, x["tokens"], x["old"], x["adv"], x["mask"])))
            row(f"tis_logprob fwd+bwd (no TIS; loss differs from Liger's by {diff:.1e})", shape, no_tis,
                3 * elements * 2, False, False, timed(liger_run))
        with torch.no_grad():
            row("logprob+entropy fwd", shape, timed(lambda: fused_logprob_entropy(x["logits"], x["tokens"])),
                elements * 2, timed(lambda: eager_logprob_entropy(x["logits"], x["tokens"])),
                timed(compiled_lpe and (lambda: compiled_lpe(x["logits"], x["tokens"]))), False)
        del x, leaf
        torch.cuda.empty_cache()

    compiled_advantages = compiled(grpo_advantages, dynamic=True)
    # The SPADE mix, and agents alone (every segment a group of 16): the difference is the large designer segments'
    # cost. Kernel alone is timed as CUDA graph replays; end to end includes the checks, the sort and Python.
    for n in args.samples:
        for mix, fraction in (("10% designers", DESIGNER_FRACTION), ("agents only", 0.0)):
            a = advantage_inputs(n, device, designer_fraction=fraction)
            ids = (a["rewards"], a["group_ids"], a["roles"], a["skill_ids"], 12.0)
            end_to_end = timed(lambda: grpo_advantage(*ids))  # input checks, segment sort, launch
            params = torch.tensor([12.0, 1e-6], dtype=torch.float64, device=device)
            reference = timed(lambda: grpo_advantages(*ids))
            with_compile = timed(compiled_advantages and (lambda: compiled_advantages(*ids)))
            shape = f"{n} samples, {mix}"
            row("grpo_advantage (end to end)", shape, end_to_end, 32 * n, reference, with_compile, False)
            for tile in args.tiles:  # the tile size is the kernel's one tuning knob: a sweep in the same run
                segments = _segments(a["group_ids"], a["roles"], a["skill_ids"], None, tile)
                kernel_only = timed(lambda: GrpoAdvantageFunction.apply(a["rewards"], segments, params, None, True,
                                                                        torch.float32), graph=True)
                launches = "2 launches" if segments.crossing else "1 launch"
                row(f"grpo_advantage (kernel alone, graph replay, tile {tile}, {launches})",
                    f"{shape}, {segments.offsets.numel() - 1:,} segments", kernel_only, 16 * n, reference,
                    with_compile, False)
    print("# x eager / x torch.compile / x Liger: the baseline's time over ours (> 1: ours is faster)")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--samples", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--tiles", type=int, nargs="+", default=[512, 1024, 2048],
                        help="grpo_advantage tile sizes timed kernel-alone (the default is 1,024)")
    parser.add_argument("--copy-bytes", type=int, default=4 << 30)
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=200)
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run the GPU benchmark's code on CPU at toy shapes (kernels interpreted): checks its "
                             "wiring before GPU time is spent on it; the times mean nothing")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.argv = argv

    import torch

    if args.cpu_dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        return benchmark(args)
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before the first kernel module is imported
        print("no CUDA GPU: checking correctness only (small shapes, kernels under the Triton interpreter); "
              "no timings")
        return check_correctness()
    return benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
