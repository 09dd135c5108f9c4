"""Wall time per rollout with selfplay.async_rollouts (rollout r+1 played while the trainer steps on r) against the
same run played synchronously, one after the other in the same invocation.

    python -m tools.bench async_rollouts [--rollouts 12] [--plays 32] [--response-tokens 16] [--threads 1] [--out DIR]

Both are the real ``spade-mega train`` of examples/configs/tiny_learn.yaml (the tiny Megatron model on gloo, the
in-process hf engine, examples/envs/first_char.py in sandbox workers, one GRPO step per rollout), saving only at the
end. Printed per mode: the wall time of the loop per rollout (``time/iteration_s``, the first rollout left out: it is
never overlapped), how long training waited for its rollout (``time/rollout_wait_s``), the rollout's and the
training's own durations, and the ratio of the per-rollout wall times. With one torch thread per process the engine and
the trainer each take a core when they overlap; on a GPU cluster they run on different devices (servers on their own
GPUs), and the gain is bounded by the shorter of the two phases.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples/configs/tiny_learn.yaml"
SCRIPT = Path(sys.executable).with_name("spade-mega")
KEYS = ("time/iteration_s", "time/rollout_wait_s", "time/rollout_s", "time/train_s", "time/sync_s")


def run(out: Path, name: str, extra: Sequence[str], threads: int) -> list[dict]:
    """The metrics records of one ``spade-mega train`` run."""
    proc = subprocess.run([str(SCRIPT), "train", str(CONFIG), f"run.output_dir={out}", f"run.name={name}",
                           "logging.progress=false", "logging.tensorboard=false", *extra],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    if proc.returncode != 0:
        raise SystemExit(f"run {name} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench async_rollouts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=12, help="rollouts of each run (one optimizer step each)")
    parser.add_argument("--plays", type=int, default=32, help="rollout.agent_trajectories_per_env (= the batch)")
    parser.add_argument("--response-tokens", type=int, default=16, help="rollout.max_response_tokens")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    parser.add_argument("--out", help="where the runs are kept (default: a temporary folder, removed); a folder "
                        "without an earlier invocation's runs")
    args = parser.parse_args(list(argv))
    if args.rollouts < 2:
        raise SystemExit("--rollouts must be >= 2 (the first rollout is never overlapped and is left out)")
    common = [f"selfplay.num_rollouts={args.rollouts}", f"selfplay.regen_interval={args.rollouts}",
              f"selfplay.save_interval={args.rollouts}", f"rollout.agent_trajectories_per_env={args.plays}",
              f"selfplay.global_batch_size={args.plays}", f"rollout.max_response_tokens={args.response_tokens}"]
    modes = {"sync": [*common, "selfplay.async_rollouts=false"], "async": [*common, "selfplay.async_rollouts=true"]}
    taken = [name for name in modes if args.out and (Path(args.out) / name).exists()]
    if taken:  # the runs there would resume (finished: nothing to train) and be reported as this invocation's
        raise SystemExit(f"--out {args.out} already holds {' and '.join(taken)}: give another folder")
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(args.out or scratch)
        records = {name: run(out, name, extra, args.threads) for name, extra in modes.items()}
    print(f"tiny_learn.yaml, {args.rollouts} rollouts of {args.plays} plays ({args.response_tokens} response tokens), "
          f"one optimizer step each, OMP_NUM_THREADS={args.threads}; means over rollouts 2..{args.rollouts} (s)")
    print(f"{'mode':<6}" + "".join(f"{key.split('/')[1]:>15}" for key in KEYS) + f"{'policy_lag':>12}")
    per_rollout = {}
    for name, rows in records.items():
        later = [r for r in rows[1:] if "time/iteration_s" in r]
        means = {key: sum(r.get(key, 0.0) for r in later) / len(later) for key in KEYS}
        lag = sum(r["rollout/policy_lag"] for r in later) / len(later)
        per_rollout[name] = means["time/iteration_s"]
        print(f"{name:<6}" + "".join(f"{means[key]:>15.3f}" for key in KEYS) + f"{lag:>12.2f}")
    print(f"wall time per rollout: async / sync = {per_rollout['async'] / per_rollout['sync']:.2f} "
          f"(x{per_rollout['sync'] / per_rollout['async']:.2f} rollouts per second)")
    return 0
