"""A step whose gradients are all finite but whose global norm overflows float32 (above ~1.8e19) is skipped like a
non-finite one. With clipping on, Megatron's clip scales every gradient by max_norm / inf = 0 and its optimizer still
steps: Adam's moments move the weights on zero gradients, its step count and the learning-rate schedule advance, and
the step said ``updated`` with ``grad_norm`` inf. With clipping off, Adam squares large enough gradients (~5e21 here)
into second moments of inf, which freeze those weights for the rest of the run (their update m / sqrt(inf) is 0).
Real Megatron steps of the demo model (fp32), in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"

# One ordinary step (Adam's moments are then non-zero), then a step of advantage argv[3] (1e20, 1e23): every
# gradient finite (the largest well under float32's 3.4e38), their norm inf in float32. What the weights, Adam's state
# and the schedule do.
SCRIPT = """
import json, math, sys
import torch
from spade_mega.config.loader import load_config
from spade_mega.megatron import Trainer
from spade_mega.selfplay.batch import Trajectory, train_samples

cfg = load_config(sys.argv[1], ["rl.loss_aggregation=token-mean", "optimizer.warmup_steps=2", *sys.argv[4:]])
trainer = Trainer(cfg)
g = torch.Generator().manual_seed(0)
trajectories = []
for i in range(2):
    ids = torch.randint(0, 256, (24,), generator=g).tolist()
    trajectories.append(Trajectory(ids, [0] * 8 + [1] * 16, [0.0] * 8 + [-5.0] * 16, "designer", 0.5, "logic"))
weights = lambda: torch.cat([p.detach().flatten().clone() for chunk in trainer.model for p in chunk.parameters()])
moments = lambda key="exp_avg": torch.cat([s[key].flatten().clone() for opt in trainer.optimizer.chained_optimizers
                                          for s in opt.optimizer.state.values()])
grads = lambda: torch.cat([b.grad_data.flatten().clone() for chunk in trainer.model
                           for b in chunk.buffers + chunk.expert_parallel_buffers])
backward = trainer._run_schedule
computed = []  # the gradients each step's backward left in the buffers, before the optimizer (whose clip scales them)


def run_schedule(micro_batches, loss_fn, forward_only, **route):
    backward(micro_batches, loss_fn, forward_only, **route)
    if not forward_only:
        computed.append(grads())


trainer._run_schedule = run_schedule
# passes over the gradients per step: the main-gradient copy of each chained optimizer, and the global norm
passes = {"prepare_grads": [], "get_grad_norm": []}


def counted(owner, name, key):
    method = getattr(owner, name)
    def call(*args, **kwargs):
        passes[key][-1] += 1
        return method(*args, **kwargs)
    setattr(owner, name, call)


for sub in trainer.optimizer.chained_optimizers:
    counted(sub, "prepare_grads", "prepare_grads")
counted(trainer.optimizer, "get_grad_norm", "get_grad_norm")


def step(advantage):
    for calls in passes.values():
        calls.append(0)
    return trainer.train_step(train_samples(trajectories, torch.tensor([advantage, -advantage])))


first = step(1.0)
before, moments_before, lr_before = weights(), moments(), trainer.optimizer.param_groups[0]["lr"]
big = step(float(sys.argv[3]))
held = computed[-1]
after, moments_after, lr_after = weights(), moments(), trainer.optimizer.param_groups[0]["lr"]
following = step(1.0)
json.dump({"first_updated": first.updated, "updated": big.updated, "grad_norm": repr(big.metrics["grad_norm"]),
           "grads_finite": bool(torch.isfinite(held).all()), "grads_max": float(held.abs().max()),
           "grads_norm32": repr(float(torch.linalg.vector_norm(held))),
           "weights_kept": torch.equal(before, after), "moments_kept": torch.equal(moments_before, moments_after),
           "lr_kept": lr_before == lr_after, "next_updated": following.updated,
           "next_moved": not torch.equal(after, weights()), "next_finite": bool(torch.isfinite(weights()).all()),
           "second_moments_finite": bool(torch.isfinite(moments("exp_avg_sq")).all()),
           "optimizers": len(trainer.optimizer.chained_optimizers), "passes": passes},
          open(sys.argv[2], "w"))
"""


_RESULTS: dict[tuple[str, str], dict] = {}


def _run(tmp_path: Path, advantage: str, clip_grad: str) -> dict:
    """SCRIPT's result for one case, run once per case for the tests that read it."""
    if (advantage, clip_grad) not in _RESULTS:
        out = tmp_path / "result.json"
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(TINY), str(out), advantage,
                               f"optimizer.clip_grad={clip_grad}"], capture_output=True, text=True,
                              timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-4000:]
        _RESULTS[advantage, clip_grad] = json.loads(out.read_text())
    return _RESULTS[advantage, clip_grad]


@pytest.mark.parametrize("advantage, clip_grad", [("1e20", "1.0"), ("1e23", "0")], ids=["clipped", "unclipped"])
def test_finite_gradients_whose_norm_overflows_skip_the_step(tmp_path: Path, advantage: str, clip_grad: str) -> None:
    """Unclipped (optimizer.clip_grad 0) the step was taken too: updated, grad_norm inf, and thousands of Adam second
    moments inf."""
    result = _run(tmp_path, advantage, clip_grad)
    assert result["first_updated"]
    # the step's gradients: finite, their float32 norm not (the case the element-wise check let through)
    assert result["grads_finite"] and 0 < result["grads_max"] < 3e38 and result["grads_norm32"] == "inf", result
    assert not result["updated"] and result["grad_norm"] == "nan", result  # skipped (updated, norm inf before)
    assert result["weights_kept"] and result["moments_kept"] and result["lr_kept"], result  # all moved before
    assert result["next_updated"] and result["next_moved"] and result["next_finite"], result
    assert result["second_moments_finite"], result  # no weight frozen by a second moment of inf


@pytest.mark.parametrize("advantage, clip_grad", [("1e20", "1.0"), ("1e23", "0")], ids=["clipped", "unclipped"])
def test_each_step_copies_and_norms_the_gradients_once(tmp_path: Path, advantage: str, clip_grad: str) -> None:
    """The overflow check reads the norm Megatron's step computes: each chained optimizer copies its main gradients
    once per step (prepare_grads) and the global norm is taken once (get_grad_norm), in the updated steps and the
    skipped one alike. Before, the trainer asked both once more ahead of optimizer.step(): 2 of each per step."""
    result = _run(tmp_path, advantage, clip_grad)
    copies = [result["optimizers"]] * 3  # one per chained optimizer (experts have their own under EP)
    assert result["passes"] == {"prepare_grads": copies, "get_grad_norm": [1, 1, 1]}, result["passes"]
