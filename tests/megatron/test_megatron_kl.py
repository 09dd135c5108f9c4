"""KL to a reference policy in the Megatron trainer (rl.kl_coef > 0), on real tiny models over gloo: the reference is
the initial model after optimizer steps, the policy comes back bit for bit from the swap, the KL is 0 at the first step
and grows after, the KL term's gradient is rl.loss's formula, a resumed run keeps the straight run's reference, what
cannot be a reference is refused naming the field, and two expert-parallel ranks match one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_launch import read_json, run_worker

KL_WORKER = Path(__file__).with_name("kl_worker.py")
KL = ["rl.kl_coef=0.1", "optimizer.clip_grad=0.0"]  # no clipping: the gradient check reads the raw gradients
STEPS = ("step1", "step2", "step3", "step4")
TIMING = ("tokens_per_s", "step_time_s")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    out = tmp_path_factory.mktemp("megatron_kl")
    run_worker(1, "straight", out, *KL, worker=KL_WORKER)
    run_worker(1, "resumed", out, "--tag", "resumed", "--load", str(out / "straight"), *KL, worker=KL_WORKER)
    return out, read_json(out / "straight.json"), read_json(out / "resumed.json")


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(float((torch.tensor(x) - torch.tensor(y)).abs().max()) for x, y in zip(a, b))


def test_reference_logprobs_are_the_initial_models_after_steps_and_the_policy_comes_back_bit_exact(runs) -> None:
    _, straight, _ = runs
    assert not straight["reference_ready_before_step"]  # a new run takes it at its first step
    assert straight["reference_logprobs"] == straight["initial_logprobs"]  # the same weights, the same forward
    assert max_diff(straight["policy_logprobs"], straight["initial_logprobs"]) > 1e-3  # three steps moved it
    assert straight["weights_bit_exact_after_swap"]


def test_kl_is_zero_at_the_first_step_and_grows_after_it_per_role(runs) -> None:
    _, straight, _ = runs
    first, last = straight["step1"], straight["step4"]
    assert first["kl"] == first["kl_agent"] == first["kl_designer"] == 0.0
    assert 0 < straight["step2"]["kl"] < straight["step3"]["kl"] < last["kl"]
    assert last["kl_agent"] > 0 and last["kl_designer"] > 0
    # the step's kl is the token mean over both roles (make_batch: 4 agent samples, 2 designer samples)
    assert min(last["kl_agent"], last["kl_designer"]) <= last["kl"] <= max(last["kl_agent"], last["kl_designer"])


def test_the_loop_writes_each_rollouts_kl_per_role(runs) -> None:
    """SelfPlay._train over three steps whose first has no designer sample: train/kl_designer is still written (the
    loop took the metric names of the first step only)."""
    _, _, resumed = runs
    loop = resumed["loop"]
    assert loop["train/steps"] == 3
    assert loop["train/kl"] > 0 and loop["train/kl_agent"] > 0 and loop["train/kl_designer"] > 0


def test_the_kl_term_changes_the_gradients_as_rl_loss_says(runs) -> None:
    out, straight, _ = runs
    check = straight["gradient"]
    assert check["with_kl"]["loss"] == pytest.approx(check["policy_loss"], rel=1e-5)
    gradients = torch.load(out / "gradients.pt")
    with_kl, shifted = gradients["with_kl"], gradients["shifted"]
    assert float(with_kl.norm()) > 0
    assert float((with_kl - shifted).norm() / with_kl.norm()) < 1e-5
    # the KL term moves them: a step of the same batch without it differs (its kl-free loss is lower here)
    assert check["shifted"]["loss"] != pytest.approx(check["with_kl"]["loss"], rel=1e-4)


def test_a_resumed_run_keeps_the_straight_runs_reference(runs) -> None:
    """Resumed from the checkpoint after step 2 (not the initial weights): the reference is re-read from the run's
    initial weights, the seeded initialisation or, another seed, inference.hf_weights; the steps after it are the
    straight run's, KL included."""
    _, straight, resumed = runs
    assert resumed["reference_logprobs"] == straight["initial_logprobs"]
    assert resumed["hf_reference_logprobs"] == straight["initial_logprobs"]
    for step in ("step3", "step4"):
        want = {k: v for k, v in straight[step].items() if k not in TIMING}
        got = {k: v for k, v in resumed[step].items() if k not in TIMING}
        assert got == want, step


def test_a_checkpoint_named_as_reference_leaves_the_policy_step_and_schedule_alone(runs) -> None:
    """rl.reference naming a later checkpoint (step 2) in a new run: the reference is that checkpoint's policy, the
    trainer keeps its own initial weights, step 0 and its schedule (the checkpoint's step and schedule not taken)."""
    _, straight, resumed = runs
    named = resumed["named"]
    assert named["reference_logprobs"] == straight["step2_logprobs"]
    assert named["policy_logprobs"] == straight["initial_logprobs"]
    assert named["step"] == 0 and named["schedule_kept"]


def test_what_cannot_be_a_reference_is_refused_naming_the_field(runs) -> None:
    _, _, resumed = runs
    refused = resumed["refused"]
    assert all(r is not None and r["path"] == "rl.reference" for r in refused.values()), refused
    assert "missing: no such folder" in refused["missing"]["message"]
    assert "cannot be read as the reference policy" in refused["not_a_checkpoint"]["message"]
    assert "holds no complete checkpoint" in refused["not_a_checkpoint"]["message"]
    assert "TP2 PP1 EP2 ETP2 DP1" in refused["other_layout"]["message"]
    assert "Resume in the checkpoint's layout" in refused["other_layout"]["message"]
    assert resumed["weights_untouched_by_refusals"]


@pytest.mark.multiproc
def test_two_expert_parallel_ranks_match_one_process(runs) -> None:
    """EP2 reads both its policy and its reference (rl.reference) from the one-process run's step-0 checkpoint,
    resharded: the log-probs, KL and losses of its four steps are the one-process run's."""
    out, straight, _ = runs
    run_worker(2, "straight", out, "--tag", "ep2", "--init", str(out / "init"), *KL, "parallel.expert=2",
               f"rl.reference={out / 'init'}", worker=KL_WORKER)
    ep2 = read_json(out / "ep2.json")
    assert ep2["weights_bit_exact_after_swap"]
    assert max_diff(ep2["initial_logprobs"], straight["initial_logprobs"]) < 1e-5
    assert max_diff(ep2["reference_logprobs"], straight["reference_logprobs"]) < 1e-5
    assert ep2["step1"]["kl"] == 0.0
    for step in STEPS:
        for key in ("loss", "grad_norm", "kl", "kl_agent", "kl_designer"):
            assert ep2[step][key] == pytest.approx(straight[step][key], rel=1e-5, abs=1e-9), (step, key)


@pytest.mark.multiproc
def test_two_pipeline_stages_with_tied_embeddings_swap_both_copies(runs) -> None:
    """PP2 with tied embeddings: the first stage's embedding and the last stage's output layer are two copies of one
    weight, each swapped on its own stage. After three steps the reference log-probs are the initial model's exactly
    (a copy left out of the swap would give the policy's output layer to the reference), the weights come back bit
    for bit, the KL is 0 at the first step and grows."""
    out = runs[0] / "pp2_tied"
    out.mkdir()
    run_worker(2, "straight", out, "--tag", "pp2", *KL, "parallel.pipeline=2", "model.tie_embeddings=true",
               worker=KL_WORKER)
    pp2 = read_json(out / "pp2.json")
    assert pp2["weights_bit_exact_after_swap"]
    assert pp2["reference_logprobs"] == pp2["initial_logprobs"]
    assert max_diff(pp2["policy_logprobs"], pp2["initial_logprobs"]) > 1e-3
    assert pp2["step1"]["kl"] == 0.0 and 0 < pp2["step2"]["kl"] < pp2["step4"]["kl"]


def test_bf16_weights_with_fp32_main_copies(runs) -> None:
    """bf16 parameters under the distributed optimizer, whose fp32 main copies the swap must leave alone: the policy
    comes back bit for bit, the reference after three steps is the initial model exactly, and the KL step's gradients
    are those of the shifted-advantage step (as in fp32)."""
    out = runs[0] / "bf16"
    out.mkdir()
    run_worker(1, "straight", out, *KL, "model.params_dtype=bfloat16", worker=KL_WORKER)
    bf16 = read_json(out / "straight.json")
    assert bf16["weights_bit_exact_after_swap"]
    assert bf16["reference_logprobs"] == bf16["initial_logprobs"]
    assert bf16["step1"]["kl"] == 0.0 and 0 < bf16["step2"]["kl"] < bf16["step4"]["kl"]
    gradients = torch.load(out / "gradients.pt")
    with_kl, shifted = gradients["with_kl"], gradients["shifted"]
    assert float(with_kl.norm()) > 0 and float((with_kl - shifted).norm() / with_kl.norm()) < 1e-5


def test_the_reference_forward_leaves_the_policy_step_alone(runs) -> None:
    """At the first step the reference is the policy, where the k3 term is 0 with a gradient of exactly 0: the KL
    run's step is then the kl_coef-0 run's bit for bit (loss, gradient norm, MoE load-balancing loss), so the extra
    no-grad forward changes no state the step uses (router statistics, RNG, the DDP buffers)."""
    out, straight, _ = runs
    run_worker(1, "plain", out, "--tag", "plain", "optimizer.clip_grad=0.0", worker=KL_WORKER)
    plain = read_json(out / "plain.json")["step1"]
    with_kl = {k: v for k, v in straight["step1"].items() if not k.startswith("kl") and k not in TIMING}
    assert "moe_load_balancing_loss" in with_kl
    assert with_kl == {k: v for k, v in plain.items() if k not in TIMING}
