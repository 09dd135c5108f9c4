"""Agent-episode throughput of the lockstep rollout, against a baseline measured in the same run.

    python -m tools.bench rollout [--config examples/configs/tiny_cpu.yaml] [--plays 16] [--turns 4] [--new 16]
                                  [--baseline serial|no-prefix-cache]
    python tools/bench/rollout.py ...

Both variants play the same plays (library environments, the caller's reset and sampling seeds) with in-process hf
engines of the same random weights (byte tokenizer) and the same sandbox pool:
- lockstep: ``Rollout.play`` with every play open at once (one engine call per turn for all live episodes, one
  batched ``step_many``), the engine's prefix cache on (``inference.prefix_cache_mb``);
- baseline ``serial``: the same call with ``rollout.max_open_envs=1``, so episodes run one after another (what a
  per-episode loop pays: one engine call per turn per episode);
- baseline ``no-prefix-cache``: lockstep with an engine whose prefix cache is off, so every turn prefills the whole
  conversation again (the two must play the same episodes: the bench says whether they did).
It prints episodes/s, generated tokens/s, the ratio, where the wall time went (engine, sandbox, the rest: prompt
rendering, tokenising the between-turn text, bookkeeping) and the prompt tokens the prefix cache served.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spade_mega.config.loader import load_config  # noqa: E402
from spade_mega.envs import library  # noqa: E402
from spade_mega.envs.sandbox import SandboxPool  # noqa: E402
from spade_mega.inference.hf import HFEngine  # noqa: E402
from spade_mega.rollout import AgentPlay, Rollout  # noqa: E402
from spade_mega.tokenizer import byte_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENVIRONMENTS = ("grid_maze", "running_total", "mastermind", "stack_machine")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench rollout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "configs" / "tiny_cpu.yaml"))
    parser.add_argument("--plays", type=int, default=16, help="episodes per variant (spread over 4 environments)")
    parser.add_argument("--turns", type=int, default=4, help="rollout.max_turns")
    parser.add_argument("--new", type=int, default=16, help="rollout.max_response_tokens")
    parser.add_argument("--isolation", default="best-effort", choices=["strict", "best-effort"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--baseline", default="serial", choices=["serial", "no-prefix-cache"])
    parser.add_argument("--repeats", type=int, default=1, help="runs of each variant, alternating: the best counts")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    cfg = load_config(args.config, [f"rollout.max_turns={args.turns}", f"rollout.max_response_tokens={args.new}",
                                    f"sandbox.isolation={args.isolation}"])
    tokenizer = byte_tokenizer()

    def make_engine(prefix_cache_mb: float) -> HFEngine:
        torch.manual_seed(0)  # the same random weights for every variant
        return HFEngine(cfg.model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                        device="cpu", max_batch_size=max(args.plays, 1), seed=0,
                        prefix_cache_mb=cfg.inference.prefix_cache_mb if prefix_cache_mb else 0)

    engine = make_engine(cfg.inference.prefix_cache_mb)
    baseline_engine = make_engine(0) if args.baseline == "no-prefix-cache" else engine
    programs = [library.render(name) for name in ENVIRONMENTS]
    plays = [AgentPlay(i % len(programs), programs[i % len(programs)], seed=i // len(programs), sampling_seed=i)
             for i in range(args.plays)]
    print(f"model {cfg.model.name}: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}; {args.plays} "
          f"episodes over {len(programs)} library environments, <= {args.turns} turns of <= {args.new} tokens; "
          f"{torch.get_num_threads()} CPU threads")
    best: dict[str, tuple[float, int, float]] = {}  # wall, generated tokens, engine seconds
    sequences: dict[str, list] = {}
    with SandboxPool(replace(cfg.sandbox, warm_workers=min(args.plays, 8))) as pool:
        variants = (("lockstep", engine, args.plays),
                    ("baseline: one at a time", engine, 1) if args.baseline == "serial" else
                    ("baseline: no prefix cache", baseline_engine, args.plays))
        for warm in {id(e): e for _, e, _ in variants}.values():
            Rollout.from_config(cfg, warm, pool, tokenizer).play(plays[:1])  # warm-up
        for _ in range(args.repeats):  # alternating, so a change in the machine's load hits both
            for name, variant_engine, open_envs in variants:
                run_cfg = replace(cfg, rollout=replace(cfg.rollout, max_open_envs=open_envs))
                rollout = Rollout.from_config(run_cfg, variant_engine, pool, tokenizer)
                cache = variant_engine.prefix_cache
                if cache is not None:  # a rollout starts after a weight update, which empties the cache
                    cache.clear()
                # prompt tokens not forwarded: taken from the cache, less the shared starts forwarded into it
                reused = cache.stats.reused_tokens - cache.stats.shared_tokens if cache is not None else 0
                start = time.perf_counter()
                batch = rollout.play(plays)
                wall = time.perf_counter() - start
                s = batch.stats
                reused = (cache.stats.reused_tokens - cache.stats.shared_tokens if cache is not None else 0) - reused
                turns = sum(ep.turns for ep in batch.episodes)
                sequences[name] = [ep.sequence.token_ids for ep in batch.episodes]
                if name not in best or wall < best[name][0]:
                    best[name] = (wall, s.generated_tokens, s.generation_s)
                print(f"{name:26s} {args.plays / wall:7.2f} episodes/s {s.generated_tokens / wall:8.1f} tokens/s "
                      f"({turns} turns, {s.engine_calls} engine calls) | wall {wall:6.2f} s = engine "
                      f"{s.generation_s:6.2f} + sandbox {s.sandbox_s:5.2f} + rest "
                      f"{wall - s.generation_s - s.sandbox_s:5.2f} | prompt tokens {s.prompt_tokens}, "
                      f"{reused} not forwarded (prefix cache)")
    (fast, fast_tokens, fast_engine), (slow, slow_tokens, slow_engine) = (best[name] for name, _, _ in variants)
    print(f"ratio lockstep / {variants[1][0].removeprefix('baseline: ')} (best of {args.repeats}): episodes/s "
          f"x{slow / fast:.2f}, tokens/s x{(fast_tokens / fast) / (slow_tokens / slow):.2f}, engine time "
          f"x{fast_engine / slow_engine:.2f}")
    if args.baseline == "no-prefix-cache":
        same = sum(a == b for a, b in zip(*sequences.values()))
        print(f"identical episodes (token ids) with and without the prefix cache: {same}/{len(plays)}")
    for each in {id(e): e for _, e, _ in variants}.values():
        each.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
