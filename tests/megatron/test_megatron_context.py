"""Context parallelism in the GRPO train step: the row layout it needs (segments padded to 2*CP, load-balanced
shards), and one step on two CP ranks (gloo), alone (with full recompute), with TP2 + sequence parallelism and with
PP2, equal to one process: loss, metrics, log-probs before and after, updated weights, with sequence-level truncated
IS, the seq-mean-token-mean aggregation and the entropy bonus (the per-sample quantities a shard cannot compute
alone), and the MoE load-balancing loss over padded rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_launch import read_json, run_worker

from spade_mega.megatron.attention import context_order
from spade_mega.megatron.batch import BatchError, TrainSample, pack, samples_from

WORKER = Path(__file__).with_name("context_worker.py")
PER_SAMPLE = ["rl.tis_level=sequence", "rl.loss_aggregation=seq-mean-token-mean", "rl.entropy_coef=0.01"]
COMPARED = ("loss", "pg_loss", "clip_frac", "approx_kl", "tis_ratio_mean", "tis_ratio_max", "entropy", "grad_norm",
            "moe_load_balancing_loss")
RTOL = 1e-5


def batch(lengths: list[int]) -> list[TrainSample]:
    return samples_from([TrainSample(torch.arange(n) % 7, torch.arange(n) > 0, torch.ones(n)) for n in lengths])


def test_context_parallel_rows_pad_each_sample_and_shards_partition_the_row() -> None:
    plan = pack(batch([7, 5, 9]), token_budget=12, length_multiple=4, context=2)  # a row holds 24 = 12 x 2
    rows = plan.micro_batches[0]
    assert [mb.samples for mb in rows] == [[0, 2], [1]]  # slots of 8 + 12 = 20 fit, 8 more would not
    first = rows[0]
    assert first.cu_seqlens.tolist() == [0, 8, 20] and first.seqlens == [7, 9]
    assert first.sample_ids[0].tolist() == [0] * 7 + [-1] + [2] * 9 + [-1] * 3
    assert first.labels[0, :6].tolist() == (torch.arange(1, 7) % 7).tolist() and not first.loss_mask[0, 6:8].any()
    shards = [first.context_shard(rank, 2) for rank in range(2)]
    # chunks r and 3 - r of each segment: segment 0 in chunks of 2, segment 1 in chunks of 3
    assert shards[0].row_index.tolist() == [0, 1, 6, 7, 8, 9, 10, 17, 18, 19]
    assert shards[1].row_index.tolist() == [2, 3, 4, 5, 11, 12, 13, 14, 15, 16]
    for shard in shards:
        assert torch.equal(shard.tokens[0], first.tokens[0, shard.row_index])
        assert shard.row_length == 20 and shard.length == 10
    # all-gathered keys (rank 0's shard, then rank 1's) back in row order
    gathered = torch.cat([s.row_index for s in shards])
    assert torch.equal(gathered[context_order(first.cu_seqlens.tolist(), 2)], torch.arange(20))
    params = first.packed_seq_params(torch.device("cpu"))
    assert params.cu_seqlens_q.tolist() == [0, 7, 16] and params.cu_seqlens_q_padded.tolist() == [0, 8, 20]
    assert params.max_seqlen_q == 12
    unsplit = pack(batch([7, 5, 9]), token_budget=24).micro_batches[0][0]
    assert unsplit.packed_seq_params(torch.device("cpu")).cu_seqlens_q_padded is None  # as before: no CP, no padding


def test_the_budget_is_per_rank_and_a_sample_counts_with_its_padding() -> None:
    with pytest.raises(BatchError, match=r"sample 0 has 23 tokens \(24 padded to a multiple of 2 x parallel.context\)"
                                         r", more than the micro-batch token budget 16 = parallel.max_tokens_per_gpu "
                                         r"\(8\) x parallel.context \(2\)"):
        pack(batch([23]), token_budget=8, length_multiple=4, context=2)
    assert pack(batch([16]), token_budget=8, length_multiple=4, context=2).micro_batches[0][0].length == 16


LAYOUTS = {  # tag: (processes, overrides); a row holds 16 x 2 tokens in each
    "cp2": (2, ["parallel.recompute=full", "kernels.enabled=true"]),  # the fused log-prob kernel on each shard
    "cp2_tp2_sp": (4, ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
    "cp2_pp2": (4, ["parallel.pipeline=2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six samples of 5-14 tokens in three rows; under CP each sample is padded to a multiple of 4 (17% of the row
    positions), one process has no padding; the budgets (26 for one process, 16 per rank for two CP ranks) give both
    the same rows, so the MoE load-balancing loss is compared on the same compositions."""
    out = tmp_path_factory.mktemp("context")
    run_worker(1, "step", out, "--tag", "ref", "--weights", "parallel.max_tokens_per_gpu=26", *PER_SAMPLE,
               worker=WORKER)
    for tag, (nproc, overrides) in LAYOUTS.items():
        weights = ["--weights", "--resave"] if tag == "cp2" else []  # CP alone: every rank holds all weights
        run_worker(nproc, "step", out, "--tag", tag, *weights, "--load", str(out / "init"), "parallel.context=2",
                   "parallel.max_tokens_per_gpu=16", *overrides, *PER_SAMPLE, worker=WORKER)
    # the CP2 checkpoint (saved after the step, with its optimizer state) resumed by one process
    run_worker(1, "resume", out, "--tag", "cp2_to_1", "--load", str(out / "cp2_checkpoint"),
               "parallel.max_tokens_per_gpu=26", *PER_SAMPLE, worker=WORKER)
    return out


@pytest.fixture(scope="module")
def expert_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """EP2 (two data-parallel ranks) and CP2 x EP2 (four ranks: the same two data-parallel ranks, each split over two
    CP ranks): the same rows, one per data-parallel rank, so the router loss is compared on the same compositions;
    EP2 itself equals one process (test_megatron_parallel)."""
    out = tmp_path_factory.mktemp("context_expert")
    run_worker(2, "step", out, "--tag", "ep2", "parallel.expert=2", "parallel.max_tokens_per_gpu=32", *PER_SAMPLE,
               worker=WORKER)
    run_worker(4, "step", out, "--tag", "cp2_ep2", "--load", str(out / "init"), "parallel.expert=2",
               "parallel.context=2", "parallel.max_tokens_per_gpu=16", *PER_SAMPLE, worker=WORKER)
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_context_parallel_step_equals_one_process(runs: Path, layout: str) -> None:
    want, got = read_json(runs / "ref.json"), read_json(runs / f"{layout}.json")
    assert got["rows"] == want["rows"] == [[[0, 1], [2, 3, 4], [5]]]
    assert want["padding"] == [0] and got["padding"] == [11], "the comparison must include padded segments"
    assert want["step"]["clip_frac"] > 0 and want["step"]["tis_ratio_mean"] != 1.0
    for key in COMPARED:
        w, g = want["step"][key], got["step"][key]
        assert abs(g - w) <= RTOL * max(abs(w), 1e-12), f"{layout}: {key} = {g!r}, {w!r} in one process"
    logprobs = {tag: torch.load(runs / f"{tag}_logprobs.pt") for tag in ("ref", layout)}
    # the log-probs after the step are those of the updated weights
    for when in ("before", "after"):
        for i, (w, g) in enumerate(zip(logprobs["ref"][when], logprobs[layout][when])):
            assert w.shape == g.shape and float((w - g).abs().max()) < 1e-5, \
                f"{layout}: sample {i}: log-probs {when} the step differ from one process"
    assert any(not torch.equal(a, b) for a, b in zip(logprobs["ref"]["before"], logprobs["ref"]["after"]))


@pytest.mark.multiproc
def test_cp2_updates_the_weights_as_one_process(runs: Path) -> None:
    reference, weights = torch.load(runs / "ref_weights.pt"), torch.load(runs / "cp2_weights.pt")
    assert weights["after"].keys() == reference["after"].keys()
    for name, w in reference["after"].items():
        assert torch.equal(weights["before"][name], reference["before"][name]), f"{name}: not the same start"
        err = float((weights["after"][name] - w).norm() / w.norm())
        assert err < RTOL, f"updated weight {name} differs from one process (relative error {err:.2e})"
        update = w - reference["before"][name]
        assert update.norm() > 0, f"{name} did not move: the comparison would prove nothing"
        update_err = float((weights["after"][name] - weights["before"][name] - update).norm() / update.norm())
        assert update_err < 1e-3, f"the update of {name} differs by {update_err:.2e} of its size"


def test_a_rollout_context_no_row_holds_is_refused_before_any_rollout() -> None:
    """Under CP a row is parallel.context x parallel.max_tokens_per_gpu tokens, a sample its length padded to a
    multiple of 2 x CP: a 32768-token context needs 16384 per rank on two CP ranks (the config error names the key
    and that size), not the full 32768 per rank as without CP."""
    from spade_mega.config import ConfigError
    from spade_mega.config.loader import load_config
    from spade_mega.rollout.runner import _check_context

    _check_context(load_config(None, ["parallel.context=2", "parallel.max_tokens_per_gpu=16384"]))
    with pytest.raises(ConfigError, match=r"holds 32764 tokens.*raise parallel.max_tokens_per_gpu to at least 16384 "
                                          r"\(a row is parallel.context x") as error:
        _check_context(load_config(None, ["parallel.context=2", "parallel.max_tokens_per_gpu=16383"]))
    assert error.value.path == "parallel.max_tokens_per_gpu"


def test_context_parallel_layouts_and_their_row_multiples() -> None:
    from spade_mega.config import ConfigError
    from spade_mega.config.schema import ModelConfig, ParallelConfig
    from spade_mega.megatron import resolve_layout
    from spade_mega.megatron.batch import row_length_multiple

    both = resolve_layout(ParallelConfig(context=2, tensor=2, sequence_parallel=True), ModelConfig(), 4)
    assert (both.context, both.data) == (2, 1) and both.describe() == "TP2+SP PP1 CP2 EP1 ETP2 DP1"
    # each CP rank two equal chunks of every segment; its share of a row a multiple of TP under SP
    assert row_length_multiple(1, 2) == 4 and row_length_multiple(2, 2, True) == 4
    assert row_length_multiple(4, 2, True) == 8 and row_length_multiple(2, 1, True) == 2 and row_length_multiple() == 1
    with pytest.raises(ConfigError) as err:  # TP x PP would tile 4 processes: CP is the size to change
        resolve_layout(ParallelConfig(context=3), ModelConfig(), 4)
    assert err.value.path == "parallel.context" and "divide the world size (4 processes)" in str(err.value)


@pytest.mark.multiproc
def test_a_checkpoint_saved_under_cp2_restores_the_trained_weights(runs: Path) -> None:
    """Saved by two CP ranks after the step; the initial weights loaded over the model, then the saved checkpoint:
    the log-probs are the trained ones again (a shard left out of the save would fail the load or differ)."""
    logprobs = torch.load(runs / "cp2_logprobs.pt")
    for i, (after, initial, reloaded) in enumerate(zip(logprobs["after"], logprobs["initial_reloaded"],
                                                       logprobs["reloaded"])):
        assert torch.equal(reloaded, after), f"sample {i}: log-probs after reloading differ"
        assert torch.allclose(initial, logprobs["before"][i], atol=1e-6), f"sample {i}: the initial load changed"
    assert any(not torch.equal(a, b) for a, b in zip(logprobs["after"], logprobs["initial_reloaded"]))


@pytest.mark.multiproc
def test_cp2_with_expert_and_data_parallelism_equals_ep2(expert_runs: Path) -> None:
    """Dense gradients reduced over DP x CP (four ranks), expert gradients over the expert-data ranks, the experts'
    all-to-all over CP-split rows, the loss normalised over the whole global batch."""
    want, got = read_json(expert_runs / "ep2.json"), read_json(expert_runs / "cp2_ep2.json")
    assert got["rows"] == want["rows"] == [[[0, 3, 4]], [[1, 2, 5]]]  # one row per data-parallel rank
    assert got["padding"] == [5, 6]
    for key in COMPARED:
        w, g = want["step"][key], got["step"][key]
        assert abs(g - w) <= RTOL * max(abs(w), 1e-12), f"{key} = {g!r} under CP2 x EP2, {w!r} under EP2"
    logprobs = {tag: torch.load(expert_runs / f"{tag}_logprobs.pt") for tag in ("ep2", "cp2_ep2")}
    for when in ("before", "after"):
        for i, (w, g) in enumerate(zip(logprobs["ep2"][when], logprobs["cp2_ep2"][when])):
            assert float((w - g).abs().max()) < 1e-5, f"sample {i}: log-probs {when} the step differ from EP2"


@pytest.mark.multiproc
def test_cp2_runs_the_fused_kernels(runs: Path) -> None:
    """kernels.enabled under CP: the log-probs of each shard through the Triton kernels (the interpreter here), the
    per-sample sums in policy_loss as without them; the step itself equals one process above."""
    launches = read_json(runs / "cp2.json")["kernel_launches"]
    for stage in ("tis_logprob.shard_stats", "tis_logprob.finalize", "tis_logprob.logits_grad"):
        assert launches.get(stage, 0) > 0, (stage, launches)


@pytest.mark.multiproc
def test_a_cp2_checkpoint_resumes_in_one_process(runs: Path) -> None:
    """Model and optimizer state saved by two CP ranks, loaded by one process: its next step (Adam moments, step
    count and schedule resharded) equals the CP2 run's own next step after reloading the same checkpoint."""
    want, got = read_json(runs / "cp2.json")["second"], read_json(runs / "cp2_to_1.json")["second"]
    assert want["lr"] == got["lr"]
    for key in COMPARED:
        w, g = want[key], got[key]
        assert abs(g - w) <= RTOL * max(abs(w), 1e-12), f"{key} = {g!r} resumed in one process, {w!r} under CP2"
    cp2, one = torch.load(runs / "cp2_logprobs.pt")["second"], torch.load(runs / "cp2_to_1_logprobs.pt")["second"]
    for i, (w, g) in enumerate(zip(cp2, one)):
        assert float((w - g).abs().max()) < 1e-5, f"sample {i}: log-probs after the resumed step differ"
    assert any(not torch.equal(a, b) for a, b in zip(cp2, torch.load(runs / "cp2_logprobs.pt")["after"]))
