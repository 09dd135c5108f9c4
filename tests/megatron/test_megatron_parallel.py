"""One GRPO training step in TP2+SP, EP2, PP2, TP2xEP2 and PP2 with virtual stages (gloo, CPU) equals the
single-process step; a checkpoint saved in TP2xEP2 loads into TP1 and PP2 with the same logits, and the resumed runs
continue with the same losses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_launch import read_json, run_worker

pytestmark = pytest.mark.multiproc

TP2_SP = ["parallel.tensor=2", "parallel.sequence_parallel=true"]
LAYOUTS = {
    "tp2_sp": (2, TP2_SP),
    "ep2": (2, ["parallel.expert=2"]),
    "pp2": (2, ["parallel.pipeline=2"]),
    "tp2_ep2": (4, [*TP2_SP, "parallel.expert=2"]),
}
# The interleaved schedule needs more layers than pipeline stages: its own 4-layer reference. It pads all rows to one
# length (a fifth of its tokens are padding), which the MoE load-balancing loss must not count to match one process.
VPP = ("pp2_vpp2", 2, ["parallel.pipeline=2", "parallel.virtual_pipeline=2"])
FOUR_LAYERS = ["model.num_layers=4"]
RESUMES = {"resume_tp1": (1, []), "resume_pp2": (2, ["parallel.pipeline=2"])}
COMPARED = ("loss", "pg_loss", "clip_frac", "approx_kl", "tis_ratio_mean", "tis_ratio_max", "grad_norm",
            "moe_load_balancing_loss")
RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, reference_run) -> dict[str, Path]:
    out = reference_run(tmp_path_factory.mktemp("megatron_layouts"))
    for tag, (nproc, overrides) in LAYOUTS.items():
        extra = ["--continue-run"] if tag == "tp2_ep2" else []
        run_worker(nproc, "layout", out, "--tag", tag, *extra, *overrides)
    for tag, (nproc, overrides) in RESUMES.items():
        dump = ["--dump", "init", "reference", *LAYOUTS] if tag == "resume_tp1" else []
        run_worker(nproc, "resume", out, "--tag", tag, "--load", str(out / "tp2_ep2"), *dump, *overrides)
    four = out / "four_layers"
    four.mkdir()
    tag, nproc, overrides = VPP
    run_worker(1, "reference", four, *FOUR_LAYERS)
    run_worker(nproc, "layout", four, "--tag", tag, *FOUR_LAYERS, *overrides)
    run_worker(1, "resume", four, *FOUR_LAYERS, "--tag", "resume_tp1", "--load", str(four / tag),
               "--dump", "init", "reference", tag)
    return {layout: out for layout in LAYOUTS} | {tag: four}


def rel_err(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def assert_metrics_match(got: dict, want: dict, what: str) -> None:
    for key in COMPARED:
        assert rel_err(got[key], want[key]) < RTOL, f"{what}: {key} = {got[key]!r}, expected {want[key]!r}"


@pytest.mark.parametrize("layout", [*LAYOUTS, VPP[0]])
def test_one_step_matches_single_process(runs: dict[str, Path], layout: str) -> None:
    out = runs[layout]
    want = read_json(out / "reference.json")["step1"]
    got = read_json(out / f"{layout}.json")["step1"]
    assert want["micro_batches"] == 6 and want["clip_frac"] > 0, "the batch must exercise several micro-batches"
    if layout == VPP[0]:
        assert want["padding_frac"] == 0 and got["padding_frac"] > 0.2, "the comparison must include padded rows"
    assert_metrics_match(got, want, layout)
    initial = torch.load(out / "init_weights.pt")
    reference = torch.load(out / "reference_weights.pt")
    weights = torch.load(out / f"{layout}_weights.pt")
    assert weights.keys() == reference.keys() == initial.keys()
    for name, w in reference.items():
        err = float((weights[name] - w).norm() / w.norm())
        assert err < RTOL, f"{layout}: updated weight {name} differs from one process (relative error {err:.2e})"
        # and the step itself (not just the large unchanged part of the weights) agrees
        update = w - initial[name]
        assert update.norm() > 0, f"{name} did not move: the comparison would prove nothing"
        update_err = float((weights[name] - initial[name] - update).norm() / update.norm())
        assert update_err < 1e-3, f"{layout}: the update of {name} differs by {update_err:.2e} of its size"


@pytest.mark.parametrize("resume", list(RESUMES))
def test_tp2ep2_checkpoint_loads_with_identical_logits(runs: dict[str, Path], resume: str) -> None:
    out = runs["tp2_ep2"]
    saved = torch.load(out / "tp2_ep2_logits.pt")
    loaded = torch.load(out / f"{resume}_logits.pt")
    assert read_json(out / f"{resume}.json")["loaded_step"] == 1
    assert loaded.shape == saved.shape
    err = float((loaded - saved).abs().max() / saved.abs().max())
    assert err < RTOL, f"{resume}: logits after loading the TP2xEP2 checkpoint differ (relative {err:.2e})"


@pytest.mark.parametrize("resume", list(RESUMES))
def test_resumed_run_continues_with_same_losses(runs: dict[str, Path], resume: str) -> None:
    uninterrupted = read_json(runs["tp2_ep2"] / "tp2_ep2.json")
    resumed = read_json(runs["tp2_ep2"] / f"{resume}.json")
    for step in ("step2", "step3"):
        assert_metrics_match(resumed[step], uninterrupted[step], f"{resume} {step}")


@pytest.mark.multiproc
def test_dense_model_with_tied_embeddings_in_pp2_matches_single_process(tmp_path: Path) -> None:
    """A dense model (no token dispatcher) with tied embeddings over two pipeline stages: the last stage's copy of the
    word embeddings (its output layer) is the loaded checkpoint's, and follows the first stage's updates. The
    checkpoint comes from a run with another seed, so a copy left at the stage's own initialisation would show."""
    dense_tied = ["model.num_experts=0", "model.tie_embeddings=true"]
    run_worker(1, "reference", tmp_path, "--continue-run", "run.seed=7", *dense_tied)
    run_worker(2, "layout", tmp_path, "--tag", "pp2", "--continue-run", "parallel.pipeline=2", *dense_tied)
    want, got = read_json(tmp_path / "reference.json"), read_json(tmp_path / "pp2.json")
    assert "moe_load_balancing_loss" not in want["step1"]
    for step in ("step1", "step2", "step3"):
        for key in COMPARED[:-1]:
            assert rel_err(got[step][key], want[step][key]) < RTOL, \
                f"{step}: {key} = {got[step][key]!r}, expected {want[step][key]!r}"
    saved, loaded = torch.load(tmp_path / "reference_logits.pt"), torch.load(tmp_path / "pp2_logits.pt")
    err = float((loaded - saved).abs().max() / saved.abs().max())
    assert err < RTOL, f"logits after one step differ from one process (relative {err:.2e})"


def test_a_step_with_non_finite_gradients_is_skipped_alike_on_every_rank(tmp_path: Path) -> None:
    """PP2 with two virtual stages, EP2 and the distributed optimizer's reduce-scatter over two data-parallel ranks
    (four processes, each holding other parameters, expert buffers and optimizer shards): a step whose gradients
    overflow is skipped by every rank, none of which moves a weight, an Adam moment (its step count included), the
    schedule or the learning rate; the next finite step trains everywhere. The trainer's step counts the skipped one,
    as Megatron-LM's iteration does (a rollout whose steps were all skipped saves under a checkpoint name of its
    own)."""
    run_worker(4, "skip", tmp_path, "parallel.pipeline=2", "parallel.virtual_pipeline=2", "parallel.expert=2",
               *FOUR_LAYERS, "optimizer.distributed=true")
    ranks = [read_json(tmp_path / f"skip_{rank}.json") for rank in range(4)]
    for rank, got in enumerate(ranks):
        assert got["updated"] == [True, False, True], f"rank {rank}: {got}"
        assert got["moments"] > 0 and got["unchanged"], f"rank {rank}: the skipped step moved something ({got})"
        assert got["last_moved"] and got["finite_after"], f"rank {rank}: the next finite step did not train ({got})"
        assert got["trainer_step"] == 3 and got["skipped_grad_norm"] != got["skipped_grad_norm"]  # NaN
        assert got["local_finite"][0] and got["local_finite"][2], f"rank {rank}: {got}"


def test_a_step_whose_gradient_norm_overflows_is_skipped_alike_on_every_rank(tmp_path: Path) -> None:
    """EP2 with the distributed optimizer over two data-parallel ranks (two processes; dense and expert optimizers
    chained, each rank holding half the dense optimizer shards): a step whose gradients are finite on every rank but
    whose global norm overflows float32 is skipped by both (Megatron's get_grad_norm, asked by the trainer on every
    rank in the same order, reduces it over the grad-stats group), neither moving a weight, an Adam moment, the
    schedule or the learning rate; the next step trains everywhere. With the norm check off both ranks step (updated,
    grad_norm inf, weights moved on gradients clipped to 0)."""
    run_worker(2, "skip", tmp_path, "--advantage", "1e20", "parallel.expert=2", "optimizer.distributed=true")
    for rank in range(2):
        got = read_json(tmp_path / f"skip_{rank}.json")
        assert got["local_finite"] == [True, True, True], f"rank {rank}: gradients not finite ({got})"
        assert got["updated"] == [True, False, True], f"rank {rank}: {got}"
        assert got["moments"] > 0 and got["unchanged"], f"rank {rank}: the skipped step moved something ({got})"
        assert got["last_moved"] and got["finite_after"], f"rank {rank}: the next step did not train ({got})"
        assert got["trainer_step"] == 3 and got["skipped_grad_norm"] != got["skipped_grad_norm"]  # NaN
