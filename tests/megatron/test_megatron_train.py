"""The GRPO train step in one process: packing leaves log-probs unchanged, the loss is the GRPO loss of the whole batch
however it is cut into micro-batches, bad input is refused clearly, and GRPO learns a verifiable task."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_launch import read_json, run_worker
from megatron_worker import make_batch

from spade_mega.config.loader import build
from spade_mega.config.schema import RLConfig
from spade_mega.rl.loss import loss_normalizer, policy_loss

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("megatron_single")
    # the MoE load-balancing loss is a per-micro-batch quantity by design: off, so cutting the batch is invisible
    run_worker(1, "single", out, "model.moe_aux_loss_coeff=0.0")
    return out, read_json(out / "single.json")


def test_packed_rows_give_the_same_logprobs_as_one_sample_per_micro_batch(single: tuple[Path, dict]) -> None:
    logprobs = single[1]["logprobs"]
    for alone, packed in zip(logprobs["one_per_micro_batch"], logprobs["all_in_one_row"]):
        assert alone[0] == packed[0] == 0.0  # the first token has no prefix
        assert torch.allclose(torch.tensor(alone), torch.tensor(packed), atol=1e-5, rtol=0)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_step_is_independent_of_the_micro_batching(single: tuple[Path, dict], aggregation: str) -> None:
    out, result = single
    alone = result["steps"][f"{aggregation}/one_per_micro_batch"]
    packed = result["steps"][f"{aggregation}/all_in_one_row"]
    assert (alone["micro_batches"], packed["micro_batches"]) == (6, 1)
    for key in ("loss", "grad_norm", "clip_frac", "tis_ratio_mean"):
        assert packed[key] == pytest.approx(alone[key], rel=1e-5), key
    a = torch.load(out / f"single_{aggregation}_one_per_micro_batch.pt")
    b = torch.load(out / f"single_{aggregation}_all_in_one_row.pt")
    assert float((a - b).norm() / a.norm()) < 1e-6


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_step_loss_is_the_grpo_loss_of_the_whole_batch(single: tuple[Path, dict], aggregation: str) -> None:
    """The trainer's loss equals rl.loss.policy_loss on the whole batch, with the trainer's own log-probs (checks the
    label shift, the loss mask alignment and the normalisation across micro-batches)."""
    result = single[1]
    batch = make_batch(1)
    logprobs = [torch.tensor(lp) for lp in result["logprobs"]["one_per_micro_batch"]]
    width = max(len(s) for s in batch)

    def rows(values: list[torch.Tensor], fill: float = 0.0) -> torch.Tensor:
        return torch.stack([torch.cat([v, v.new_full((width - len(v),), fill)]) for v in values])

    mask = rows([s.loss_mask for s in batch], False)
    cfg = build(RLConfig, {"loss_aggregation": aggregation})
    loss, metrics = policy_loss(rows(logprobs), rows([s.old_logprobs for s in batch]),
                                rows([s.advantages for s in batch]), mask, cfg,
                                rollout_logprobs=rows([s.rollout_logprobs for s in batch]))
    step = result["steps"][f"{aggregation}/one_per_micro_batch"]
    assert step["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert step["clip_frac"] == pytest.approx(float(metrics["clip_frac"]), rel=1e-5)
    assert step["loss_tokens"] == int(mask.sum())
    assert loss_normalizer(mask, aggregation) > 0


def test_step_metrics_are_reported(single: tuple[Path, dict]) -> None:
    step = single[1]["steps"]["token-mean/one_per_micro_batch"]
    for key in ("loss", "grad_norm", "lr", "clip_frac", "approx_kl", "tis_ratio_mean", "tis_ratio_max",
                "tis_truncated_frac", "tokens_per_s", "moe_load_balancing_loss", "samples_agent", "samples_designer"):
        assert key in step and step[key] == step[key], key  # present and not NaN
    assert step["tokens_per_s"] > 0 and step["samples_agent"] + step["samples_designer"] == 6
    assert 0 < step["clip_frac"] < 1 and step["tis_ratio_max"] >= step["tis_ratio_mean"]


@pytest.mark.multiproc
def test_batch_not_splitting_evenly_over_data_parallel_ranks_matches_one_process(tmp_path: Path) -> None:
    """Five samples over two data-parallel ranks: the short rank runs an empty micro-batch to keep the schedules in
    step, and the step (loss, PPO and TIS metrics, gradient norm) is the one-process step. The MoE load-balancing
    loss is off: it is a per-micro-batch quantity, and the two layouts cut the batch differently."""
    common = ["--num-samples", "5", "model.moe_aux_loss_coeff=0.0"]
    run_worker(1, "reference", tmp_path, *common)
    run_worker(2, "layout", tmp_path, "--tag", "dp2", *common)
    want = read_json(tmp_path / "reference.json")["step1"]
    got = read_json(tmp_path / "dp2.json")["step1"]
    assert (want["micro_batches"], got["micro_batches"]) == (5, 3)
    assert got["loss_tokens"] == want["loss_tokens"]
    for key in ("loss", "pg_loss", "clip_frac", "approx_kl", "tis_ratio_mean", "tis_ratio_max", "tis_truncated_frac",
                "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key


def test_trainers_built_one_after_another_in_one_process_each_train(tmp_path: Path) -> None:
    """Megatron's MoE metrics tracker is process-global: a deeper model built after a shallower one must still train,
    and a model built after others steps exactly as the first one of its shape did."""
    run_worker(1, "models", tmp_path)
    steps = read_json(tmp_path / "models.json")
    assert 0 < steps["deeper"]["moe_load_balancing_loss"] < float("inf")
    for key in ("loss", "grad_norm", "clip_frac", "moe_load_balancing_loss"):
        assert steps["again"][key] == pytest.approx(steps["first"][key], rel=1e-6), key


@pytest.mark.slow
def test_grpo_learns_one_digit_sums(tmp_path: Path) -> None:
    run_worker(1, "grpo", tmp_path, "--steps", "30", "model.vocab_size=16", "optimizer.lr=3e-3",
               "parallel.max_tokens_per_gpu=1024", "rollout.temperature=1.0")
    rewards = read_json(tmp_path / "grpo.json")["mean_reward"]
    assert len(rewards) == 30
    start, end = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert end > 2 * start and end - start > 0.1, f"mean reward {start:.3f} -> {end:.3f}: {rewards}"


def test_step_through_the_triton_kernels_equals_the_reference_step(single: tuple[Path, dict], tmp_path: Path) -> None:
    """kernels.enabled routes the log-probs through spade_mega.kernels (the interpreter without a GPU)."""
    run_worker(1, "reference", tmp_path, "kernels.enabled=true", "model.moe_aux_loss_coeff=0.0")
    launches = read_json(tmp_path / "reference.json")["kernel_launches"]
    for stage in ("tis_logprob.shard_stats", "tis_logprob.finalize", "tis_logprob.logits_grad"):
        assert launches.get(stage, 0) > 0, (stage, launches)  # the kernels ran, not the references
    fused = read_json(tmp_path / "reference.json")["step1"]
    plain = single[1]["steps"]["token-mean/one_per_micro_batch"]
    for key in ("loss", "grad_norm", "clip_frac", "tis_ratio_mean", "approx_kl"):
        assert fused[key] == pytest.approx(plain[key], rel=1e-5), key
