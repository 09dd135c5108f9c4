"""The KL reference's log-probs once per rollout (rl.kl_coef > 0): the self-play loop computes them in its pre-pass,
under one swap of the reference weights, and its optimizer steps use them. The rollout trains exactly as when each
step swapped the reference in for its own forward (the reference is fixed): the same KL metrics and weights, bit for
bit, with one swap instead of one per step. One process on gloo, the tiny model, rows packing several samples."""

from __future__ import annotations

import pytest
import torch
from megatron_worker import config, make_batch

from spade_mega.megatron import Trainer
from spade_mega.megatron.reference import ReferencePolicy
from spade_mega.selfplay.batch import optimizer_batches
from spade_mega.selfplay.loop import SelfPlay
from spade_mega.selfplay.state import derive_seed

# 12 samples in steps of 4 (3 optimizer steps); a row holds several samples, so a forward's packing is not one sample's
OVERRIDES = ["rl.kl_coef=0.1", "parallel.max_tokens_per_gpu=40", "selfplay.global_batch_size=4"]


def _rollout(tmp_path, monkeypatch: pytest.MonkeyPatch, *, per_step: bool) -> tuple[list[dict], list[torch.Tensor], int]:
    """One rollout of three optimizer steps: each step's metrics, the weights after them, and how many times the
    reference was swapped in. ``per_step``: the path before the pre-pass, each train_step computing its batch's
    reference log-probs itself."""
    cfg = config([*OVERRIDES, f"run.output_dir={tmp_path}"])
    swaps = [0]
    exchange = ReferencePolicy.exchange

    def counted(self: ReferencePolicy) -> None:
        swaps[0] += 1
        exchange(self)

    monkeypatch.setattr(ReferencePolicy, "exchange", counted)
    trainer = Trainer(cfg)
    steps: list[dict] = []
    train_step = trainer.train_step

    def recorded(batch):
        result = train_step(batch)
        steps.append({k: v for k, v in result.metrics.items() if k not in ("tokens_per_s", "step_time_s")})
        return result

    trainer.train_step = recorded  # type: ignore[method-assign]
    samples = make_batch(1) + make_batch(2)
    for sample in samples:
        sample.old_logprobs = None  # the loop takes them from the trainer's pre-pass
    try:
        trainer.reference.capture()  # the run's reference: the initial weights (one copy, not a swap)
        if per_step:
            for sample, values in zip(samples, trainer.logprobs(samples)):
                sample.old_logprobs = values
            for batch in optimizer_batches(samples, 4, derive_seed(cfg.run.seed, "batch", 1)):
                trainer.train_step(batch)
        else:
            SelfPlay(cfg)._train(trainer, samples, 1)
        weights = [p.detach().clone() for chunk in trainer.model for p in chunk.module.parameters()]
    finally:
        trainer.close()
        monkeypatch.setattr(ReferencePolicy, "exchange", exchange)
    return steps, weights, swaps[0] // 2


@pytest.mark.slow
def test_reference_logprobs_once_per_rollout_train_as_each_step_computing_them(tmp_path, monkeypatch) -> None:
    steps, weights, swaps = _rollout(tmp_path / "a", monkeypatch, per_step=False)
    before_steps, before_weights, before_swaps = _rollout(tmp_path / "b", monkeypatch, per_step=True)
    assert len(steps) == 3 and (swaps, before_swaps) == (1, 3)
    assert steps[0]["kl"] == 0.0 < steps[1]["kl"] < steps[2]["kl"]  # the KL term acts (the steps move the policy)
    assert steps == before_steps  # KL per role, loss, gradient norm: every metric, exactly
    assert all(torch.equal(a, b) for a, b in zip(weights, before_weights))
    assert any(not torch.equal(a, p) for a, p in zip(weights, _initial(tmp_path)))


def _initial(tmp_path) -> list[torch.Tensor]:
    trainer = Trainer(config([*OVERRIDES, f"run.output_dir={tmp_path / 'c'}"]))
    try:
        return [p.detach().clone() for chunk in trainer.model for p in chunk.module.parameters()]
    finally:
        trainer.close()
