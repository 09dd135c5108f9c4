"""The KL estimators of rl.kl_estimator by hand (values and gradients, as verl defines them), their term in the GRPO
loss, and the rl.reference / rl.kl_estimator settings refused by name. The trainer side (the reference policy kept in
host memory, swapped in for its log-probs) is tests/megatron/test_megatron_kl.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from spade_mega.config import load_config
from spade_mega.config.errors import ConfigError
from spade_mega.config.schema import RLConfig
from spade_mega.megatron.checkpoint import FORMAT_VERSION
from spade_mega.megatron.reference import check_reference, host_copies, pack_buckets, reference_source
from spade_mega.rl.loss import KL_ESTIMATORS, LOW_VAR_KL_LIMIT, kl_to_reference, policy_loss
from spade_mega.tokenizer import byte_tokenizer

TINY = "examples/configs/tiny_cpu.yaml"
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("spade-mega")


def estimate(estimator: str, lp: float, ref: float) -> tuple[float, float]:
    """The estimate and its derivative in the current log-prob."""
    x = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    value = kl_to_reference(x, torch.tensor(ref, dtype=torch.float64), estimator)
    value.backward()
    return float(value.detach()), float(x.grad)


@pytest.mark.parametrize("estimator, value, derivative", [
    ("k1", math.log(2), 1.0),  # lp - ref
    ("k2", 0.5 * math.log(2) ** 2, math.log(2)),  # (lp - ref)^2 / 2
    ("k3", 0.5 + math.log(2) - 1, 1 - 0.5),  # e^(ref-lp) - (ref-lp) - 1
    ("low_var_kl", 0.5 + math.log(2) - 1, 1 - 0.5),  # k3 below its clamp
])
def test_estimators_by_hand(estimator: str, value: float, derivative: float) -> None:
    got = estimate(estimator, math.log(0.5), math.log(0.25))
    assert got == (pytest.approx(value), pytest.approx(derivative))


def test_low_var_kl_stops_pulling_past_its_clamp_and_k3_does_not() -> None:
    k3 = estimate("k3", 0.0, -15.0)
    assert k3 == (pytest.approx(math.exp(-15) + 14), pytest.approx(1 - math.exp(-15)))
    assert estimate("low_var_kl", 0.0, -15.0) == (LOW_VAR_KL_LIMIT, 0.0)


def test_every_estimator_is_zero_with_no_gradient_but_k1s_at_the_reference() -> None:
    for estimator in KL_ESTIMATORS:
        value, derivative = estimate(estimator, -1.3, -1.3)
        assert value == 0.0 and derivative == (1.0 if estimator == "k1" else 0.0), estimator


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_the_loss_adds_kl_coef_times_the_token_mean_estimate(estimator: str) -> None:
    """Zero advantages: the loss is the KL term alone, kl_coef x the mean estimate over the loss tokens (the token
    off the mask, with a wild reference, adds nothing)."""
    lp = torch.tensor([[math.log(0.5), math.log(0.2), -0.1]], dtype=torch.float64)
    ref = torch.tensor([[math.log(0.25), math.log(0.3), -40.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    cfg = replace(RLConfig(), kl_coef=0.25, kl_estimator=estimator)
    loss, metrics = policy_loss(lp, lp, torch.zeros_like(lp), mask, cfg, ref_logprobs=ref)
    per_token = kl_to_reference(lp[0, :2], ref[0, :2], estimator)
    assert float(metrics["kl_ref"]) == pytest.approx(float(per_token.mean()))
    assert float(loss) == pytest.approx(0.25 * float(per_token.mean()))


def test_an_unknown_estimator_and_an_empty_reference_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"rl\.kl_estimator: expected one of 'k1', 'k2', 'k3', 'low_var_kl'"):
        load_config(TINY, ["rl.kl_estimator=k4"])
    with pytest.raises(ConfigError, match=r"rl\.reference"):
        load_config(TINY, ["rl.reference=''"])
    with pytest.raises(ValueError, match="rl.kl_estimator must be one of"):
        kl_to_reference(torch.zeros(1), torch.zeros(1), "k4")


def test_the_reference_is_the_runs_initial_weights_unless_a_folder_is_named() -> None:
    assert reference_source(load_config(TINY)) == ("inference.hf_weights", None)  # the seeded initialisation
    assert reference_source(load_config(TINY, ["inference.hf_weights=/models/base"])) == \
        ("inference.hf_weights", "/models/base")
    assert reference_source(load_config(TINY, ["inference.hf_weights=/models/base", "rl.reference=/models/sft",
                                               "rl.kl_coef=0.1"])) == ("rl.reference", "/models/sft")


def test_a_named_reference_without_the_kl_term_is_refused_by_name() -> None:
    """Nothing would read it: the run would train without the KL its user asked for, silently."""
    with pytest.raises(ConfigError, match=r"rl\.reference: names /models/sft but rl\.kl_coef is 0"):
        load_config(TINY, ["rl.reference=/models/sft"])
    load_config(TINY, ["rl.reference=initial"])


def test_a_reference_folder_that_cannot_be_read_is_refused_before_the_run_builds_anything(tmp_path: Path) -> None:
    """spade-mega train with a missing rl.reference stops at once (exit 2, one line naming the field), before the
    trainer and the engine are built: no run directory is written."""
    missing = tmp_path / "sft_missing"
    proc = subprocess.run([str(SCRIPT), "train", TINY, f"run.output_dir={tmp_path / 'runs'}", "rl.kl_coef=0.1",
                           f"rl.reference={missing}"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "rl.reference" in last and f"{missing}: no such folder" in last, last
    assert not (tmp_path / "runs").exists()


def test_references_are_checked_before_the_run_builds_anything(tmp_path: Path) -> None:
    """What prepare_reference would refuse after the trainer and the engine are built: a folder that is no
    checkpoint, an HF folder carrying another tokenizer (its token ids mean other things: the KL would compare the
    policy with garbage), inference.hf_weights when a resumed run re-reads its initial weights from it, a resume in
    another model-parallel layout from the seeded initialisation (data and sequence parallelism aside); nothing when the KL term
    is off or a new run takes the reference from its first step."""
    empty = tmp_path / "empty"
    empty.mkdir()
    foreign = tmp_path / "foreign"
    other = byte_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    other.save_pretrained(str(foreign))
    (foreign / "config.json").write_text("{}")
    same = tmp_path / "same"
    byte_tokenizer().save_pretrained(str(same))
    (same / "config.json").write_text("{}")
    checkpoint = tmp_path / "run" / "step_2"
    checkpoint.mkdir(parents=True)
    kl = ["rl.kl_coef=0.1"]
    with pytest.raises(ConfigError, match=r"rl\.reference: cannot be read .* holds no complete checkpoint"):
        check_reference(load_config(TINY, [*kl, f"rl.reference={empty}"]), None, 1)
    with pytest.raises(ConfigError, match=r"rl\.reference: cannot be read .* their token ids mean different"):
        check_reference(load_config(TINY, [*kl, f"rl.reference={foreign}"]), None, 1)
    check_reference(load_config(TINY, [*kl, f"rl.reference={same}"]), None, 1)
    with pytest.raises(ConfigError, match=r"inference\.hf_weights: .*missing: no such folder"):
        check_reference(load_config(TINY, [*kl, f"inference.hf_weights={tmp_path / 'missing'}"]), checkpoint, 1)
    check_reference(load_config(TINY, [*kl, f"inference.hf_weights={tmp_path / 'missing'}"]), None, 1)
    check_reference(load_config(TINY, [f"inference.hf_weights={tmp_path / 'missing'}"]), checkpoint, 1)
    manifest = {"format": FORMAT_VERSION, "step": 2, "architecture": {}, "layout": "TP2+SP PP1 EP2 ETP2 DP1"}
    (checkpoint / "spade_checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"rl\.reference: .* trained in TP2\+SP PP1 EP2 ETP2 DP1, this run is TP1"):
        check_reference(load_config(TINY, kl), checkpoint, 1)
    two_by_two = ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert=2"]
    check_reference(load_config(TINY, [*kl, *two_by_two]), checkpoint, 4)  # another data-parallel size only
    # sequence parallelism changes activations' layout, not the seeded weights: switching it alone resumes
    manifest["layout"] = "TP2 PP1 EP2 ETP2 DP2"
    (checkpoint / "spade_checkpoint.json").write_text(json.dumps(manifest))
    check_reference(load_config(TINY, [*kl, *two_by_two]), checkpoint, 4)


def test_a_checkpoint_root_named_as_the_reference_is_pinned_to_its_step_for_the_whole_run(tmp_path: Path) -> None:
    """rl.reference naming a root (not a step folder) reads its newest checkpoint; if that root is still being
    written (another run's), a resume must read the same step as the run's start, or a resumed run differs from a
    straight one. The step folder chosen at the start is kept in the run's loop states and used on resume (unless
    rl.reference now names another root); nothing is pinned for the initial weights, a step folder or an HF folder."""
    from spade_mega.megatron.reference import pinned_reference
    from spade_mega.selfplay.state import LoopState

    root = tmp_path / "other-run" / "checkpoints"

    def saved(step: int) -> Path:
        folder = root / f"step_{step:06d}"
        folder.mkdir(parents=True)
        (folder / "spade_checkpoint.json").write_text(json.dumps({"format": FORMAT_VERSION, "step": step,
                                                                  "architecture": {}}))
        return folder

    first = saved(1)
    cfg = load_config(TINY, ["rl.kl_coef=0.1", f"rl.reference={root}"])
    pinned = pinned_reference(cfg, None)  # the run's start
    assert pinned == str(first)
    saved(2)  # the other run goes on saving
    state = LoopState.from_dict(LoopState(rollout=1, reference=pinned).to_dict(), "state")
    assert pinned_reference(cfg, state.reference) == str(first)  # the resume
    assert pinned_reference(cfg, None).endswith("step_000002")  # a state saved before it was recorded: the newest
    elsewhere = tmp_path / "third" / "checkpoints"
    elsewhere.mkdir(parents=True)
    (elsewhere / first.name).symlink_to(first)
    assert pinned_reference(load_config(TINY, ["rl.kl_coef=0.1", f"rl.reference={elsewhere}"]), pinned) == \
        str(elsewhere / first.name)  # rl.reference changed: its own newest, not the recorded one
    assert pinned_reference(load_config(TINY, ["rl.kl_coef=0.1", f"rl.reference={first}"]), None) is None
    assert pinned_reference(load_config(TINY, ["rl.kl_coef=0.1"]), None) is None
    assert LoopState.from_dict({**LoopState().to_dict(), "reference": None}, "state").reference is None


def test_the_reference_is_packed_into_buckets_that_the_pinned_allocators_rounding_barely_grows() -> None:
    """torch's pinned host allocator rounds every allocation up to a power of two. A rank's shards of Qwen3-30B-A3B
    in bf16 in the example layout (TP4, EP8, ETP1: 16 experts of each of 48 layers, a quarter of attention,
    embeddings and output layer), 8.04 GB, took 10.8 GB allocated one by one; packed, 8.05 GB (docs/megatron.md)."""
    def pow2(n: int) -> int:
        return 1 << (n - 1).bit_length()

    hidden, vocab, bf16 = 2048, 151936, 2
    sizes = []
    for _ in range(48):
        sizes += [bf16 * 2 * 768 * hidden] * 16 + [bf16 * hidden * 768] * 16  # local experts' fc1 (gate, up), fc2
        sizes += [bf16 * (4096 + 2 * 512) // 4 * hidden, bf16 * 4096 // 4 * hidden]  # attention qkv, proj shards
        sizes += [bf16 * 128 * hidden, bf16 * hidden, bf16 * hidden, bf16 * 128, bf16 * 128]  # router, norms
    sizes += [bf16 * vocab // 4 * hidden] * 2 + [bf16 * hidden]  # embedding, output layer shards, final norm
    total = sum(sizes)
    assert total == pytest.approx(8.04e9, rel=1e-3)
    assert sum(map(pow2, sizes)) / total > 1.34  # one by one
    used, place = pack_buckets(sizes)
    assert sum(map(pow2, used)) / total < 1.005
    spans = sorted((b, offset, offset + size) for (b, offset), size in zip(place, sizes))
    assert all(a[2] <= b[1] for a, b in zip(spans, spans[1:]) if a[0] == b[0])  # no two tensors overlap
    assert all(end <= used[b] for b, _, end in spans)


def test_host_copies_hold_every_dtype_and_shape_exactly() -> None:
    params = [torch.randn(3, 5), torch.randn(7).bfloat16(), torch.randn(()), torch.zeros(0, 4),
              torch.randn(100, 10, dtype=torch.float64), torch.randint(0, 9, (5,))]
    held = host_copies(params, pin=False, bucket_bytes=1024)  # several buckets, one raised to the largest tensor
    for h, p in zip(held, params):
        h.copy_(p)
    assert all(h.shape == p.shape and h.dtype == p.dtype and torch.equal(h, p) for h, p in zip(held, params))
    assert len({h.untyped_storage().data_ptr() for h in held}) == 2
