"""GSPO (rl.policy_loss gspo) in the Megatron train step: one process's step has the loss of the paper's formula on
the whole batch, and two context-parallel ranks (each sample's sequence mean totalled over both shards) take the
same step. The scenario is context_worker.py's (six samples in three rows, padded under CP2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from context_worker import make_batch
from megatron_launch import read_json, run_worker

WORKER = Path(__file__).with_name("context_worker.py")
GSPO = ["rl.policy_loss=gspo", "rl.loss_aggregation=seq-mean-token-mean", "rl.eps_clip_low=3e-4",
        "rl.eps_clip_high=4e-4", "rl.tis_level=sequence"]
COMPARED = ("loss", "pg_loss", "clip_frac", "seq_clip_frac", "approx_kl", "tis_ratio_mean", "tis_ratio_max",
            "grad_norm", "moe_load_balancing_loss")
RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process (rows of 26 tokens), then CP2 (16 a rank: the same rows, each sample padded to a multiple of 4)
    from the one process's initial weights."""
    out = tmp_path_factory.mktemp("gspo")
    run_worker(1, "step", out, "--tag", "one", "parallel.max_tokens_per_gpu=26", *GSPO, worker=WORKER)
    run_worker(2, "step", out, "--tag", "cp2", "--load", str(out / "init"), "parallel.context=2",
               "parallel.max_tokens_per_gpu=16", *GSPO, worker=WORKER)
    return out


def paper_loss(logprobs: list[torch.Tensor]) -> float:
    """GSPO's objective on the whole batch in float64, per sample: -min(s_i A_i, clip(s_i) A_i) times its truncated
    sequence-level IS weight (exp of the summed old - rollout log-ratio, at most rl.tis_clip 2), s_i the geometric
    mean of its loss tokens' ratios; the mean over the samples."""
    terms = []
    for sample, lp in zip(make_batch(1), logprobs):
        m = sample.loss_mask
        lp, old, adv, rollout = (t.double()[m] for t in (lp, sample.old_logprobs, sample.advantages,
                                                          sample.rollout_logprobs))
        s = torch.exp((lp - old).mean())
        weight = torch.exp((old - rollout).sum()).clamp(max=2.0)
        terms.append(float(-torch.minimum(s * adv[0], s.clamp(1 - 3e-4, 1 + 4e-4) * adv[0]) * weight))
    return sum(terms) / len(terms)


def paper_clipping(logprobs: list[torch.Tensor]) -> tuple[float, float]:
    """The fraction of samples whose clipped branch GSPO takes (s_i above 1 + 4e-4 with A > 0, below 1 - 3e-4 with
    A < 0), and the fraction of loss tokens in them, on the whole batch."""
    clipped, tokens, total = [], 0, 0
    for sample, lp in zip(make_batch(1), logprobs):
        m = sample.loss_mask
        s = float(torch.exp((lp.double()[m] - sample.old_logprobs.double()[m]).mean()))
        a = float(sample.advantages[m][0])
        clipped.append((a > 0 and s > 1 + 4e-4) or (a < 0 and s < 1 - 3e-4))
        tokens += int(m.sum()) if clipped[-1] else 0
        total += int(m.sum())
    return sum(clipped) / len(clipped), tokens / total


@pytest.mark.multiproc
def test_one_process_step_is_the_papers_objective(runs: Path) -> None:
    step = read_json(runs / "one.json")["step"]
    logprobs = torch.load(runs / "one_logprobs.pt")
    assert step["loss"] == pytest.approx(paper_loss(logprobs["before"]), rel=1e-5)
    assert 0 < step["seq_clip_frac"] < 1, "the batch must have clipped samples and samples that train"
    # the step's micro-batches (rows of 1 to 3 samples) combine into the whole batch's fractions
    assert (step["seq_clip_frac"], step["clip_frac"]) == pytest.approx(paper_clipping(logprobs["before"]), rel=1e-6)
    assert 0 < step["clip_frac"] < 1 and step["grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(logprobs["before"], logprobs["after"]))


@pytest.mark.multiproc
def test_a_cp2_gspo_step_equals_one_process(runs: Path) -> None:
    want, got = read_json(runs / "one.json"), read_json(runs / "cp2.json")
    assert got["rows"] == want["rows"] and got["padding"] == [11], "the comparison must include padded segments"
    for key in COMPARED:
        w, g = want["step"][key], got["step"][key]
        assert abs(g - w) <= RTOL * max(abs(w), 1e-12), f"CP2: {key} = {g!r}, {w!r} in one process"
    one, cp2 = torch.load(runs / "one_logprobs.pt"), torch.load(runs / "cp2_logprobs.pt")
    for when in ("before", "after"):
        for i, (w, g) in enumerate(zip(one[when], cp2[when])):
            assert float((w - g).abs().max()) < 1e-5, f"sample {i}: log-probs {when} the step differ from one process"
