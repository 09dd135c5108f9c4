"""Speed and peak memory of the in-process hf engine, against the engine of an earlier revision, in the same run.

    python -m tools.bench engine [--workload designer agent] [--baseline REV] [--threads 1] [--repeats 2]
    python tools/bench/engine.py --workload decode --batch 8 --prompt 256 --new 256

Workloads (the demo's shapes on examples/configs/tiny_cpu.yaml, random weights, float32):
- designer: 16 prompts of 3,400-3,800 tokens (the designer prompt is ~3.6k byte tokens), 256 new tokens each,
  temperature 1 with a seed per request;
- agent: 16 episodes of 4 turns; prompts start at 300-600 tokens and grow by the completion (32 new tokens) and a
  40-token observation per turn, one engine call per turn for all episodes (the lockstep rollout's calls);
- decode: ``--batch`` greedy requests of ``--prompt``/2 to ``--prompt`` tokens, ``--new`` new tokens each.
Baseline: ``spade_mega/inference/hf.py`` as of ``--baseline`` (default: the last revision with transformers'
DynamicCache and a left-padded batched prefill under a [batch, 1, length, length] mask), loaded from git into the
same package. Each engine runs a workload in a fresh process, so its peak RSS is its own; the bench prints generated
tokens/s (best of ``--repeats`` runs, alternating), the peak RSS and its growth during generation (above the process
after building the engine and a warm-up; the worst run), the ratios against the baseline, and whether both returned
the same completions (per-request seeds in float32).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spade_mega.config.loader import load_config  # noqa: E402
from spade_mega.inference.base import Generation, GenerationRequest, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BASELINE = "aed794d"  # hf.py before the preallocated cache and the right-padded, mask-free prefill


def engine_class(revision: str | None) -> type:
    """The HFEngine of this checkout (``None``) or of ``spade_mega/inference/hf.py`` at git ``revision``."""
    if revision is None:
        from spade_mega.inference.hf import HFEngine

        return HFEngine
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:spade_mega/inference/hf.py"],
                            capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as folder:
        path = Path(folder) / "baseline_hf.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("spade_mega.inference._baseline_hf", path)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.HFEngine


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_workload(engine, args: argparse.Namespace) -> list[Generation]:
    """Every generation of ``args.workload`` in order (the agent's turns one after another)."""
    vocab = engine.vocab_size
    gen = torch.Generator().manual_seed(1)

    def tokens(n: int) -> tuple[int, ...]:  # never the last id: the engine's eos
        return tuple(torch.randint(1, vocab - 1, (n,), generator=gen).tolist())

    if args.workload == "designer":
        return engine.generate([GenerationRequest(tokens(3400 + 25 * i), SamplingParams(
            max_new_tokens=256, temperature=1.0, seed=i)) for i in range(16)])
    if args.workload == "decode":
        return engine.generate([GenerationRequest(tokens(args.prompt // 2 + i * args.prompt // (2 * args.batch)),
                                                  SamplingParams(max_new_tokens=args.new, temperature=0.0))
                                for i in range(args.batch)])
    prompts = [tokens(300 + 20 * i) for i in range(16)]
    generations: list[Generation] = []
    for turn in range(4):
        done = engine.generate([GenerationRequest(p, SamplingParams(max_new_tokens=32, temperature=1.0,
                                                                    seed=100 * turn + i))
                                for i, p in enumerate(prompts)])
        generations += done
        prompts = [p + g.output_ids + tokens(40) for p, g in zip(prompts, done)]
    return generations


def worker(args: argparse.Namespace) -> None:
    """Build the engine, warm it up, run the workload once; print one JSON line."""
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    torch.manual_seed(0)
    vocab = cfg.model.vocab_size
    engine = engine_class(args.revision)(cfg.model, eos_token_id=vocab - 1, pad_token_id=0, device=args.device)
    engine.generate([GenerationRequest((1, 2, 3), SamplingParams(max_new_tokens=2))])
    before = rss_mib()
    start = time.perf_counter()
    generations = run_workload(engine, args)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "tokens": sum(len(g.output_ids) for g in generations),
                      "peak_mib": peak, "growth_mib": max(peak - before, 0.0),
                      "outputs": [g.output_ids for g in generations], "logprobs": [g.logprobs for g in generations]}))


def measure(args: argparse.Namespace, workload: str, revision: str | None) -> dict:
    command = [sys.executable, __file__, "--worker", "--workload", workload, "--config", args.config,
               "--threads", str(args.threads), "--device", args.device, "--batch", str(args.batch),
               "--prompt", str(args.prompt), "--new", str(args.new)] + (["--revision", revision] if revision else [])
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"the {revision or 'current'} engine failed on {workload}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "configs" / "tiny_cpu.yaml"))
    parser.add_argument("--workload", nargs="+", default=["designer", "agent"], choices=["designer", "agent", "decode"])
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the baseline engine (hf.py)")
    parser.add_argument("--batch", type=int, default=8, help="decode workload: requests")
    parser.add_argument("--prompt", type=int, default=64, help="decode workload: prompt tokens (from half to all)")
    parser.add_argument("--new", type=int, default=64, help="decode workload: new tokens per request")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each engine: the best time, the worst peak")
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--revision", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.workload = args.workload[0]
        worker(args)
        return 0

    cfg = load_config(args.config)
    print(f"model {cfg.model.name}: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, "
          f"{cfg.model.num_experts} experts, {cfg.model.params_dtype}; on {args.device}, {args.threads} torch "
          f"thread(s); baseline: hf.py at {args.baseline}")
    agree_all = True
    for workload in args.workload:
        runs: dict[str, list[dict]] = {"baseline": [], "engine": []}
        for _ in range(args.repeats):  # alternating, so a change in the machine's load hits both
            runs["baseline"].append(measure(args, workload, args.baseline))
            runs["engine"].append(measure(args, workload, None))
        base, new = ({**min(r, key=lambda m: m["seconds"]), "peak_mib": max(m["peak_mib"] for m in r),
                      "growth_mib": max(m["growth_mib"] for m in r)} for r in runs.values())
        same = sum(a == b for a, b in zip(base["outputs"], new["outputs"]))
        drift = max((abs(x - y) for a, b, sa, sb in zip(base["logprobs"], new["logprobs"], base["outputs"],
                                                         new["outputs"]) if sa == sb for x, y in zip(a, b)),
                    default=0.0)
        agree_all &= same == len(base["outputs"])
        print(f"\n{workload}: {len(base['outputs'])} completions, {new['tokens']} tokens")
        for name, m in (("baseline", base), ("engine", new)):
            print(f"  {name:8} {m['tokens'] / m['seconds']:9.1f} tokens/s ({m['seconds']:7.2f} s)   peak RSS "
                  f"{m['peak_mib']:7.0f} MiB, +{m['growth_mib']:6.0f} MiB while generating")
        speed = (new["tokens"] / new["seconds"]) / (base["tokens"] / base["seconds"])
        print(f"  ratio engine / baseline: speed x{speed:.2f}, peak RSS x{new['peak_mib'] / base['peak_mib']:.2f}, "
              f"growth x{new['growth_mib'] / max(base['growth_mib'], 1e-9):.3f}   identical completions {same}/"
              f"{len(base['outputs'])}, max |log-prob difference| {drift:.1e}")
    return 0 if agree_all else 1


if __name__ == "__main__":
    sys.exit(main())
