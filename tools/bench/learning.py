"""Does RL through the stack learn? The win rate of examples/configs/tiny_learn.yaml per optimizer step, against the
same run with no learning (optimizer.lr 1e-12: the config refuses 0, and no such update survives float32 rounding).

    python -m tools.bench learning [--rollouts 20] [--lr 1e-2] [--seed 1234] [--out DIR]

Both are the real ``spade-mega train`` (the demo's tiny Megatron model on gloo, GRPO, the in-process engine, the
weight sync after every step, rewards from examples/envs/first_char.py in sandbox workers), one GRPO step per rollout,
run side by side with one torch thread each. Printed: each step's win rate in both runs, then the mean of the first
and last quarter of the steps and the gain of the trained run over the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples/configs/tiny_learn.yaml"
SCRIPT = Path(sys.executable).with_name("spade-mega")
BASELINE_LR = 1e-12


def win_rates(out: Path, runs: dict[str, list[str]]) -> dict[str, list[float]]:
    """``agent/win_rate`` per rollout of each named run (``spade-mega train`` with its overrides), side by side."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = {name: subprocess.Popen([str(SCRIPT), "train", str(CONFIG), f"run.output_dir={out}", f"run.name={name}",
                                     "logging.progress=false", "logging.tensorboard=false", *extra],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
             for name, extra in runs.items()}
    for name, proc in procs.items():
        _, stderr = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"run {name} failed:\n{stderr[-3000:]}")
    return {name: [json.loads(line)["agent/win_rate"]
                   for line in (out / name / "metrics.jsonl").read_text().splitlines()] for name in runs}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench learning", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=20, help="rollouts (= optimizer steps) of each run")
    parser.add_argument("--lr", type=float, default=1e-2, help="the trained run's optimizer.lr")
    parser.add_argument("--seed", type=int, default=1234, help="run.seed of both runs")
    parser.add_argument("--out", help="where the two runs are kept (default: a temporary folder, removed); a folder "
                        "without an earlier invocation's runs")
    args = parser.parse_args(list(argv))
    common = [f"selfplay.num_rollouts={args.rollouts}", f"selfplay.regen_interval={args.rollouts}",
              f"selfplay.save_interval={args.rollouts}", f"run.seed={args.seed}"]
    runs = {"trained": [*common, f"optimizer.lr={args.lr}"], "baseline": [*common, f"optimizer.lr={BASELINE_LR}"]}
    taken = [name for name in runs if args.out and (Path(args.out) / name).exists()]
    if taken:  # the runs there would resume (finished: nothing to train) and be reported as this invocation's
        raise SystemExit(f"--out {args.out} already holds {' and '.join(taken)} (an earlier invocation's runs): give "
                         "another folder")
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        rates = win_rates(Path(args.out or scratch), runs)
    print(f"win rate per optimizer step ({args.rollouts} steps of 32 plays, seed {args.seed}; "
          f"{time.perf_counter() - began:.0f} s wall for both runs)")
    print(f"{'step':>4}  {'lr ' + format(args.lr, 'g'):>9}  {'lr ' + format(BASELINE_LR, 'g'):>9}")
    for step, (trained, baseline) in enumerate(zip(rates["trained"], rates["baseline"]), start=1):
        print(f"{step:>4}  {trained:>9.3f}  {baseline:>9.3f}")
    k = max(1, args.rollouts // 4)
    first = {name: _mean(values[:k]) for name, values in rates.items()}
    last = {name: _mean(values[-k:]) for name, values in rates.items()}
    print(f"mean of the first {k} steps: trained {first['trained']:.3f}, baseline {first['baseline']:.3f}")
    print(f"mean of the last {k} steps:  trained {last['trained']:.3f}, baseline {last['baseline']:.3f}")
    print(f"gain over the run: trained {last['trained'] - first['trained']:+.3f}, baseline "
          f"{last['baseline'] - first['baseline']:+.3f}; last-{k} win rate {last['trained']:.3f} vs the baseline's "
          f"{last['baseline']:.3f} (x{last['trained'] / max(last['baseline'], 1e-9):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
