"""One rollout's training of `make demo` (examples/configs/tiny_cpu.yaml), this tree against a baseline commit.

    python -m tools.bench demo_step [--baseline REV] [--steps 3]

The demo's shape: a global batch of 16 samples, 2 designer samples of 3,600 tokens (the designer prompt quotes the
environment contract) and 14 agent samples of 300-560, packed into 4,096-token rows; a step is the no-grad old
log-prob forward the loop runs first plus the optimizer step. The baseline is a git worktree of ``--baseline``
(default: the commit before the local layers' core attention went per segment), run in its own process with the
same config, seed and batch, so the printed ratio and the loss difference are against that code measured in the same
run. Times are CPU seconds of the process (one torch thread), not wall time: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples/configs/tiny_cpu.yaml"
BASELINE = "166530a"  # Megatron's local DotProductAttention over the whole [L, L] score matrix of a packed row


def demo_batch(vocab: int) -> list:
    """2 designer samples of 3,600 tokens and 14 agent samples of 300-560, the last eighth of each trained."""
    import torch

    from spade_mega.megatron import TrainSample

    g = torch.Generator().manual_seed(0)
    lengths = [(3600, "designer")] * 2 + [(300 + 20 * i, "agent") for i in range(14)]
    batch = []
    for n, role in lengths:
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n - n // 8:] = True
        behaviour = -math.log(vocab) + 0.1 * torch.randn(n, generator=g)
        batch.append(TrainSample(torch.randint(0, vocab, (n,), generator=g), mask,
                                 torch.where(mask, torch.randn(n, generator=g), 0.0), role=role,
                                 rollout_logprobs=behaviour))
    return batch


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, args.tree)  # the tree measured: this checkout or the baseline's worktree
    import torch

    from spade_mega.config.loader import load_config
    from spade_mega.megatron import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(load_config(str(CONFIG)))
    batch = demo_batch(trainer.model_cfg.vocab_size)
    times, losses = [], []
    for step in range(args.steps + 1):  # the first is a warm-up
        start = time.process_time()
        for sample, values in zip(batch, trainer.logprobs(batch)):
            sample.old_logprobs = values
        result = trainer.train_step(batch)
        if step:
            times.append(time.process_time() - start)
        losses.append(result.metrics["loss"])
    import spade_mega

    if not Path(spade_mega.__file__).is_relative_to(args.tree):
        raise SystemExit(f"measured {spade_mega.__file__}, not the tree {args.tree}")
    print("RESULT " + json.dumps({"step_cpu_s": sum(times) / len(times), "losses": losses}), flush=True)


def run_tree(tree: Path, steps: int) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), PYTHONPATH=str(tree))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tree", str(tree), "--steps", str(steps)]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tree)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"benchmark job failed in {tree}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench demo_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=BASELINE, help=f"git revision measured as the baseline ({BASELINE})")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="spade-bench-") as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.baseline],
                       check=True, capture_output=True)
        try:
            before = run_tree(base, args.steps)
            after = run_tree(ROOT, args.steps)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], capture_output=True)
    diff = max(abs(a - b) for a, b in zip(before["losses"], after["losses"]))
    print(f"make demo's training, one rollout's step (old log-probs + optimizer step) of a 16-sample batch "
          f"(2 x 3,600 + 14 x 300-560 tokens), CPU seconds per step, mean of {args.steps} after a warm-up")
    print("| code | CPU s per step | vs baseline |")
    print("|---|---|---|")
    print(f"| baseline {args.baseline} | {before['step_cpu_s']:.2f} | x1.00 |")
    print(f"| this tree | {after['step_cpu_s']:.2f} | x{before['step_cpu_s'] / after['step_cpu_s']:.1f} faster |")
    print(f"largest loss difference over the {len(after['losses'])} steps: {diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
