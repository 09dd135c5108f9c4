"""An optimizer step whose gradients are not finite is skipped, and what was trained says so: the trainer leaves every
weight as it was (Megatron's optimizers skip only under an fp16 loss scaler; in fp32 and bf16 the step wrote NaN into
every weight while ``updated`` said True), the loop counts it in ``train/updated``, and the rollout transcript marks
the samples of that step not trained (``step_skipped``). Real Megatron steps of the demo model, in a subprocess."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spade_mega.cli import main
from spade_mega.monitor.transcripts import read_rollout

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"

# Four released designer samples trained in optimizer steps of two; the first carries an advantage of 3e38 (finite:
# TrainSample accepts it), whose loss and gradients overflow to inf / NaN: a real non-finite step.
SCRIPT = """
import json, sys
import torch
from spade_mega.config.loader import load_config
from spade_mega.curriculum.rewards import DesignerReward
from spade_mega.megatron import Trainer
from spade_mega.rl.delayed import DesignerSample, ReleasedDesignerSample
from spade_mega.selfplay.batch import Trajectory, optimizer_batches, train_samples
from spade_mega.selfplay.loop import SelfPlay
from spade_mega.selfplay.state import derive_seed
from spade_mega.selfplay.transcripts import RolloutTranscript
from spade_mega.tokenizer import byte_tokenizer

config, run_dir = sys.argv[1], sys.argv[2]
cfg = load_config(config, ["selfplay.global_batch_size=2", "rl.loss_aggregation=token-mean"])
trainer = Trainer(cfg)
weights = lambda: torch.cat([p.detach().flatten().clone() for chunk in trainer.model for p in chunk.parameters()])
g = torch.Generator().manual_seed(0)
released = []
for i in range(4):
    ids = torch.randint(0, 256, (24,), generator=g).tolist()
    mask = [0] * 8 + [1] * 16
    sample = DesignerSample(f"r1-s{i}", f"env-{i}", "logic", 1, 0, ids, mask, [0.0] * 8 + [-5.0] * 16)
    released.append(ReleasedDesignerSample(sample, DesignerReward(0.5, None, {"win_rate": 0.5})))
transcript = RolloutTranscript(cfg, 2, byte_tokenizer())
transcript.released(released)
trajectories = [Trajectory(item.sample.token_ids, item.sample.loss_mask, item.sample.behaviour_logprobs, "designer",
                           0.5, "logic") for item in released]
values = torch.tensor([3e38, 0.5, -0.5, 0.25])
samples = train_samples(trajectories, values)
seed = derive_seed(cfg.run.seed, "batch", 2)
index = {id(s): k for k, s in enumerate(samples)}
steps = [[index[id(s)] for s in batch] for batch in optimizer_batches(samples, 2, seed)]
before = weights()
steps_taken = []  # each optimizer step's own result, beside the rollout's averages
take_step = trainer.train_step
trainer.train_step = lambda batch: steps_taken.append(take_step(batch)) or steps_taken[-1]
metrics, trained = SelfPlay(cfg)._train(trainer, samples, 2)
trainer.train_step = take_step
after = weights()
transcript.settle(trajectories, values, trained)
transcript.write(run_dir)
skipped_step = next(batch for batch in steps if 0 in batch)
unchanged = torch.equal(before, after)
# the skipped step left no NaN behind: a finite step afterwards trains
step = trainer.train_step(train_samples(trajectories[1:], values[1:]))
json.dump({"steps": steps, "skipped_step": skipped_step, "trained": trained, "updated": metrics["train/updated"],
           "train_steps": metrics["train/steps"], "finite_after": bool(torch.isfinite(after).all()),
           "moved": not unchanged, "next_updated": step.updated,
           "next_finite": bool(torch.isfinite(weights()).all()), "next_moved": not torch.equal(after, weights()),
           "metrics": metrics, "step_metrics": [{"updated": res.updated, **res.metrics} for res in steps_taken]},
          open(run_dir + "/result.json", "w"))
"""


@pytest.fixture(scope="module")
def skipped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("skipped_step")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(TINY), str(run_dir)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir, json.loads((run_dir / "result.json").read_text())


def test_a_step_with_non_finite_gradients_changes_no_weight(skipped: tuple[Path, dict]) -> None:
    result = skipped[1]
    assert result["train_steps"] == 2 and result["updated"] == 1.0  # one of the two steps was skipped
    assert result["finite_after"]  # NaN in every weight before
    assert result["moved"]  # the other step trained
    assert result["next_updated"] and result["next_finite"] and result["next_moved"]


def test_the_rollout_metrics_average_the_applied_steps_and_count_the_skipped(skipped: tuple[Path, dict]) -> None:
    """A skipped step's loss and grad norm are left out of the rollout's train/* averages, as Megatron-LM leaves a
    skipped iteration out of its logged averages: one such step made the rollout's train/grad_norm NaN and its
    train/loss ~-2e37, hiding the steps that trained. train/skipped_steps counts it; counts still add up over all."""
    metrics, steps = skipped[1]["metrics"], skipped[1]["step_metrics"]
    applied = next(step for step in steps if step["updated"])
    bad = next(step for step in steps if not step["updated"])
    # what the skipped step reports itself: no grad norm, a loss of ~-4e37 (finite: it would swamp a mean unseen)
    assert math.isnan(bad["grad_norm"]) and abs(bad["loss"]) > 1e30
    assert metrics["train/skipped_steps"] == 1.0 and metrics["train/updated"] == 1.0
    for key in ("loss", "grad_norm", "pg_loss", "clip_frac", "approx_kl"):
        assert metrics[f"train/{key}"] == applied[key], key
    assert metrics["train/tokens"] == applied["tokens"] + bad["tokens"]  # the work of both steps


def test_the_transcript_says_which_samples_a_skipped_step_held(skipped: tuple[Path, dict],
                                                              capsys: pytest.CaptureFixture) -> None:
    run_dir, result = skipped
    held = set(result["skipped_step"])
    assert len(held) == 2 and result["trained"] == [i not in held for i in range(4)]
    records = {r["id"]: r for r in read_rollout(run_dir, 2)[1]}
    for i in range(4):
        record = records[f"r1-s{i}"]
        assert record["trained"] is (i not in held) and record["step_skipped"] is (i in held), record
        assert record["advantage"] is not None  # computed, as for every valid sample
    assert main(["rollouts", str(run_dir), "--role", "designer"]) == 0
    out = capsys.readouterr().out
    assert out.count("not trained (its optimizer step was skipped: gradients not finite)") == 2, out
