"""Agent-episode throughput of the lockstep rollout, against one episode at a time, measured in the same run.

    python -m tools.bench rollout [--config examples/configs/tiny_cpu.yaml] [--plays 16] [--turns 4] [--new 16]
    python tools/bench/rollout.py ...

Both variants play the same plays (library environments, the caller's reset and sampling seeds) with the same
in-process hf engine (random weights, byte tokenizer) and the same sandbox pool:
- lockstep: ``Rollout.play`` with every play open at once (one engine call per turn for all live episodes, one
  batched ``step_many``);
- baseline: the same call with ``rollout.max_open_envs=1``, so episodes run one after another (what a per-episode
  loop pays: one engine call per turn per episode).
It prints episodes/s, generated tokens/s, the ratio, and where the wall time went (engine, sandbox, the rest: prompt
rendering, tokenising the between-turn text, bookkeeping).
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
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    cfg = load_config(args.config, [f"rollout.max_turns={args.turns}", f"rollout.max_response_tokens={args.new}",
                                    f"sandbox.isolation={args.isolation}"])
    tokenizer = byte_tokenizer()
    engine = HFEngine(cfg.model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      device="cpu", max_batch_size=max(args.plays, 1), seed=0)
    programs = [library.render(name) for name in ENVIRONMENTS]
    plays = [AgentPlay(i % len(programs), programs[i % len(programs)], seed=i // len(programs), sampling_seed=i)
             for i in range(args.plays)]
    print(f"model {cfg.model.name}: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}; {args.plays} "
          f"episodes over {len(programs)} library environments, <= {args.turns} turns of <= {args.new} tokens; "
          f"{torch.get_num_threads()} CPU threads")
    rows = []
    with SandboxPool(replace(cfg.sandbox, warm_workers=min(args.plays, 8))) as pool:
        variants = (("lockstep", args.plays), ("baseline: one at a time", 1))
        Rollout.from_config(cfg, engine, pool, tokenizer).play(plays[:1])  # warm-up
        for name, open_envs in variants:
            run_cfg = replace(cfg, rollout=replace(cfg.rollout, max_open_envs=open_envs))
            rollout = Rollout.from_config(run_cfg, engine, pool, tokenizer)
            start = time.perf_counter()
            batch = rollout.play(plays)
            wall = time.perf_counter() - start
            s = batch.stats
            turns = sum(ep.turns for ep in batch.episodes)
            rows.append((name, wall, s.generated_tokens, turns))
            print(f"{name:24s} {args.plays / wall:7.2f} episodes/s {s.generated_tokens / wall:8.1f} tokens/s "
                  f"({turns} turns, {s.engine_calls} engine calls) | wall {wall:6.2f} s = engine "
                  f"{s.generation_s:6.2f} + sandbox {s.sandbox_s:5.2f} + rest {wall - s.generation_s - s.sandbox_s:5.2f}")
    (_, fast, fast_tokens, _), (_, slow, slow_tokens, _) = rows
    print(f"ratio lockstep / one-at-a-time: episodes/s x{slow / fast:.2f}, tokens/s "
          f"x{(fast_tokens / fast) / (slow_tokens / slow):.2f}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
