"""A decaying learning-rate schedule follows the run's rollouts. Its horizon is the run's planned optimizer steps (every
play and one designer sample per slot, per rollout), but rollouts take fewer: ``rl.filter_zero_std_groups`` drops
flat groups (a rollout of flat groups takes none), broken plays are not trained, designer samples are released late,
non-finite steps are skipped. Counting only the steps taken, a cosine or linear schedule ended the run above
``optimizer.min_lr``. Real Megatron steps of the demo model (fp32) through the loop's own training, in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"

# One environment of 3 plays and its designer sample in steps of 2: 2 planned steps per rollout, 6 over 3 rollouts.
# The rollouts argv[3] lists have nothing to train (every group flat), the others 4 samples (2 steps each).
SCRIPT = """
import json, sys
import torch
from spade_mega.config.loader import load_config
from spade_mega.megatron import Trainer
from spade_mega.selfplay.batch import Trajectory, train_samples
from spade_mega.selfplay.loop import SelfPlay

cfg = load_config(sys.argv[1], ["optimizer.lr_schedule=linear", "optimizer.lr=1e-4", "optimizer.min_lr=1e-6",
                                "optimizer.warmup_steps=0", "selfplay.num_rollouts=3", "rollout.envs_per_rollout=1",
                                "rollout.agent_trajectories_per_env=3", "selfplay.global_batch_size=2",
                                "rl.loss_aggregation=token-mean", *sys.argv[4:]])
loop = SelfPlay(cfg)
trainer = Trainer(cfg, total_steps=loop._steps_estimate())
g = torch.Generator().manual_seed(0)
trajectories = [Trajectory(torch.randint(0, 256, (24,), generator=g).tolist(), [0] * 8 + [1] * 16,
                           [0.0] * 8 + [-5.0] * 16, "agent", float(i % 2), "env0") for i in range(4)]
step, step_lrs = trainer.train_step, []


def train_step(samples):  # the learning rate each optimizer step applies
    step_lrs.append(trainer.optimizer.param_groups[0]["lr"])
    return step(samples)


trainer.train_step = train_step
progress, flat = [], json.loads(sys.argv[3])
for r in range(1, cfg.selfplay.num_rollouts + 1):
    samples = [] if r in flat else train_samples(trajectories, torch.tensor([0.5, -0.5, 0.25, -0.25]))
    step_lrs = []
    metrics, updated = loop._train(trainer, samples, r)
    progress.append({"steps": metrics["train/steps"], "schedule": trainer.scheduler.num_steps,
                     "lr": trainer.optimizer.param_groups[0]["lr"], "step_lrs": step_lrs})
json.dump({"planned": loop._steps_estimate(), "horizon": trainer.scheduler.lr_decay_steps, "progress": progress},
          open(sys.argv[2], "w"))
"""


def _run(tmp_path: Path, flat_rollouts: list[int], *overrides: str) -> dict:
    """SCRIPT's result: ``flat_rollouts`` have nothing to train, the others 4 samples (2 steps)."""
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(TINY), str(out), json.dumps(flat_rollouts), *overrides],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_a_rollout_that_took_fewer_steps_than_planned_leaves_no_share_of_the_schedule_unspent(tmp_path: Path) -> None:
    """The schedule ends at optimizer.min_lr (before: 4 of its 6 steps done, the learning rate a third of the way
    down from 1e-4), and each rollout's steps start where the plan puts that rollout."""
    result = _run(tmp_path, [2])
    assert result["planned"] == result["horizon"] == 6, result
    assert [p["steps"] for p in result["progress"]] == [2, 0, 2], result
    # rollout 2 took no step and leaves the trainer as it was; rollout 3 starts at its planned step 4, not 2
    assert [p["schedule"] for p in result["progress"]] == [2, 2, 6], result
    assert result["progress"][-1]["lr"] == 1e-6, result  # the end of the linear decay: min_lr


def test_warmup_counts_the_optimizer_steps_taken(tmp_path: Path) -> None:
    """optimizer.warmup_steps warms up the first optimizer steps the run takes: a first rollout that took none (every
    group flat) does not skip them (before, rollout 2's steps started at its planned step 2, past a warmup of 2: the
    run's first updates were taken at the full 1e-4, without warmup). Once warmed up, the schedule follows the plan
    again and still ends at min_lr: linear over 8 planned steps, rollouts of 0, 2, 2, 2 steps."""
    result = _run(tmp_path, [1], "optimizer.warmup_steps=2", "selfplay.num_rollouts=4")
    assert result["planned"] == result["horizon"] == 8, result
    assert [p["steps"] for p in result["progress"]] == [0, 2, 2, 2], result
    assert [p["schedule"] for p in result["progress"]] == [0, 2, 6, 8], result  # before: [0, 4, 6, 8]
    assert result["progress"][1]["step_lrs"] == pytest.approx([0.0, 5e-5]), result  # warming up (init_lr 0)
    assert result["progress"][-1]["lr"] == 1e-6, result
