"""The GRPO policy loss: hand-computed values, micro-batch/packing invariance, gradients, TIS clamp, masking."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from spade_mega.config.schema import RLConfig
from spade_mega.rl.loss import AGGREGATIONS, KL_ESTIMATORS, loss_normalizer, policy_loss, truncated_is_weights

T = torch.tensor
CFG = RLConfig()
PROPS = settings(max_examples=60, deadline=None)


def row(*values: float, dtype=torch.float64) -> torch.Tensor:
    return T([list(values)], dtype=dtype)


def test_ppo_clip_asymmetric_by_hand_positive_advantage() -> None:
    # ratios [1, 1.5, 0.5]; A = +1: clipped surrogate -min(r, clip(r, 0.8, 1.28)) = [-1, -1.28, -0.5]
    lp = row(0.0, math.log(1.5), math.log(0.5)).requires_grad_()
    loss, m = policy_loss(lp, row(0, 0, 0), row(1, 1, 1), row(1, 1, 1), CFG)
    assert loss.item() == pytest.approx(-(1 + 1.28 + 0.5) / 3)
    assert m["clip_frac"].item() == pytest.approx(1 / 3) and m["num_tokens"].item() == 3
    loss.backward()
    assert torch.allclose(lp.grad, row(-1 / 3, 0.0, -0.5 / 3))  # d(-r)/dlp = -r; the clipped token has no gradient


def test_ppo_clip_asymmetric_by_hand_negative_advantage() -> None:
    # A = -1: max(r, clip(r, 0.8, 1.28)) = [1, 1.5, 0.8]: the low side clips at 1 - 0.2, the high side never does
    lp = row(0.0, math.log(1.5), math.log(0.5)).requires_grad_()
    loss, m = policy_loss(lp, row(0, 0, 0), row(-1, -1, -1), row(1, 1, 1), CFG)
    assert loss.item() == pytest.approx((1 + 1.5 + 0.8) / 3)
    assert m["clip_frac"].item() == pytest.approx(1 / 3)
    wide = replace(CFG, eps_clip_low=0.6)
    assert policy_loss(lp, row(0, 0, 0), row(-1, -1, -1), row(1, 1, 1), wide)[0].item() == pytest.approx(1.0)


def test_truncated_importance_sampling_token_and_sequence_by_hand() -> None:
    old, rollout, mask = row(math.log(3), 0.0, math.log(0.5)), row(0.0, 0.0, 0.0), row(1, 1, 1)
    w, raw = truncated_is_weights(old, rollout, mask, CFG)
    assert torch.allclose(w, T([2.0, 1.0, 0.5], dtype=torch.float64))  # 3 truncated to 2
    assert torch.allclose(raw, T([3.0, 1.0, 0.5], dtype=torch.float64))
    w_seq, _ = truncated_is_weights(old, rollout, mask, replace(CFG, tis_level="sequence"))
    assert torch.allclose(w_seq, T([1.5, 1.5, 1.5], dtype=torch.float64))  # exp(log 3 + log 0.5)
    w_low, _ = truncated_is_weights(old, rollout, mask, replace(CFG, tis_clip_low=0.8))
    assert torch.allclose(w_low, T([2.0, 1.0, 0.8], dtype=torch.float64))

    lp = old.clone().requires_grad_()  # ratio 1 everywhere: the surrogate is -A * w per token
    loss, m = policy_loss(lp, old, row(1, 1, 1), mask, CFG, rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(-(2 + 1 + 0.5) / 3)
    assert m["tis_ratio_max"].item() == pytest.approx(3.0) and m["tis_truncated_frac"].item() == pytest.approx(1 / 3)
    assert m["tis_ratio_mean"].item() == pytest.approx(1.5)


def test_aggregation_modes_by_hand() -> None:
    # ratio 1 so each token's loss is -A; seq 0 has one loss token (A = 2), seq 1 three (A = 1)
    lp = T([[0.0, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    adv = T([[2.0, 9, 9, 9], [1, 1, 1, 9]], dtype=torch.float64)
    mask = T([[1, 0, 0, 0], [1, 1, 1, 0]])
    expected = {"token-mean": -5 / 4, "seq-mean-token-sum": -5 / 2, "seq-mean-token-mean": -(2 + 1) / 2}
    for mode, value in expected.items():
        loss, _ = policy_loss(lp, lp, adv, mask, replace(CFG, loss_aggregation=mode))
        assert loss.item() == pytest.approx(value), mode


def test_kl_estimators_and_entropy_bonus_by_hand() -> None:
    lp = row(math.log(0.5)).requires_grad_()
    ref = row(math.log(0.25))
    zero_adv, mask = row(0.0), row(1)
    k1, m1 = policy_loss(lp, lp.detach(), zero_adv, mask, replace(CFG, kl_coef=0.1, kl_estimator="k1"),
                         ref_logprobs=ref)
    assert k1.item() == pytest.approx(0.1 * math.log(2)) and m1["kl_ref"].item() == pytest.approx(math.log(2))
    k3, _ = policy_loss(lp, lp.detach(), zero_adv, mask, replace(CFG, kl_coef=0.1), ref_logprobs=ref)
    assert k3.item() == pytest.approx(0.1 * (0.5 + math.log(2) - 1))
    k3.backward()
    assert lp.grad.item() == pytest.approx(0.1 * (1 - 0.5))  # d/dlp [e^(ref-lp) - (ref-lp) - 1]
    # KL 0 (the reference recipe): reported, not trained on
    k0, m0 = policy_loss(lp, lp.detach(), zero_adv, mask, CFG, ref_logprobs=ref)
    assert k0.item() == 0.0 and m0["kl_ref"].item() == pytest.approx(0.5 + math.log(2) - 1)

    entropy = row(1.5, 0.5).requires_grad_()
    lp2 = row(0.0, 0.0)
    loss, m = policy_loss(lp2, lp2, row(0, 0), row(1, 1), replace(CFG, entropy_coef=0.01), entropy=entropy)
    assert loss.item() == pytest.approx(-0.01 * 1.0) and m["entropy"].item() == pytest.approx(1.0)
    loss.backward()
    assert torch.allclose(entropy.grad, row(-0.005, -0.005))


def test_missing_inputs_and_bad_shapes_are_clear_errors() -> None:
    lp = row(0.0, 0.0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, lp, lp, row(1, 1), replace(CFG, kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(lp, lp, lp, row(1, 1), replace(CFG, entropy_coef=0.1))
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(lp, lp, row(0.0), row(1, 1), CFG)
    with pytest.raises(ValueError, match="sample_ids"):
        policy_loss(T([0.0, 0.0]), T([0.0, 0.0]), T([1.0, 1.0]), T([1, 1]),
                    replace(CFG, loss_aggregation="seq-mean-token-mean"))


def test_a_normalizer_below_the_calls_own_count_is_refused() -> None:
    # the global count can never be below one call's count: a smaller one (a per-rank mean, a stale value) or NaN
    # would silently scale this share up
    lp, mask = T([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]), T([[1, 1, 1], [1, 0, 0]])
    for mode, local in (("token-mean", 4), ("seq-mean-token-sum", 2), ("seq-mean-token-mean", 2)):
        cfg = replace(CFG, loss_aggregation=mode)
        for bad in (local - 1, float("nan"), -1.0):
            with pytest.raises(ValueError, match=f"normalizer .* below this call's own count {local}"):
                policy_loss(lp, lp, lp + 1, mask, cfg, normalizer=bad)
        assert policy_loss(lp, lp, lp + 1, mask, cfg, normalizer=local)[0].item() == pytest.approx(
            policy_loss(lp, lp, lp + 1, mask, cfg)[0].item())
    empty = T([[0, 0, 0]])
    assert policy_loss(lp[:1], lp[:1], lp[:1], empty, CFG, normalizer=0)[0].item() == 0.0

def test_bfloat16_inputs_are_upcast() -> None:
    lp = row(0.0, -1.0, dtype=torch.bfloat16).requires_grad_()
    loss, _ = policy_loss(lp, lp.detach(), row(1.0, -1.0, dtype=torch.bfloat16), row(1, 1), CFG)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(0.0)
    loss.backward()
    assert lp.grad.dtype == torch.bfloat16


# --- micro-batches, data parallelism and packing -------------------------------------------------------------------


def random_batch(gen: torch.Generator, b: int = 6, t: int = 7) -> dict[str, torch.Tensor]:
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    lengths[0] = t  # at least one full row
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    mask[:, 0] = mask[:, 0] * (torch.rand(b, generator=gen) > 0.3)  # some rows start with a prompt token
    def noise(scale: float) -> torch.Tensor:
        return torch.randn(b, t, generator=gen, dtype=torch.float64) * scale
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    return {"logprobs": old + noise(0.3), "old_logprobs": old, "advantages": noise(1.0), "loss_mask": mask,
            "rollout_logprobs": old + noise(0.5), "ref_logprobs": old + noise(0.2), "entropy": noise(1.0).abs()}


FULL = replace(CFG, kl_coef=0.05, entropy_coef=0.01)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("tis_level", ["token", "sequence"])
def test_micro_batches_with_the_global_normalizer_sum_to_the_full_batch(aggregation: str, tis_level: str) -> None:
    cfg = replace(FULL, loss_aggregation=aggregation, tis_level=tis_level)
    batch = random_batch(torch.Generator().manual_seed(3))
    full_lp = batch["logprobs"].clone().requires_grad_()
    full, _ = policy_loss(full_lp, **{k: v for k, v in batch.items() if k in ("old_logprobs", "advantages",
                                                                          "loss_mask")}, cfg=cfg,
                          **{k: batch[k] for k in ("rollout_logprobs", "ref_logprobs", "entropy")})
    full.backward()

    # split 6 rows into micro-batches of 2, 1, 3 (as over micro-batches x data-parallel ranks)
    splits = [(0, 2), (2, 3), (3, 6)]
    global_norm = sum(loss_normalizer(batch["loss_mask"][a:b], aggregation) for a, b in splits)
    assert global_norm == loss_normalizer(batch["loss_mask"], aggregation)
    lp = batch["logprobs"].clone().requires_grad_()
    total = torch.zeros((), dtype=torch.float64)
    for a, b in splits:
        part = {k: (lp if k == "logprobs" else v)[a:b] for k, v in batch.items()}
        loss, _ = policy_loss(part.pop("logprobs"), part.pop("old_logprobs"), part.pop("advantages"),
                              part.pop("loss_mask"), cfg, normalizer=global_norm, **part)
        loss.backward()
        total = total + loss.detach()
    assert total.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-12)
    assert torch.allclose(lp.grad, full_lp.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_packed_layout_matches_padded(aggregation: str) -> None:
    cfg = replace(FULL, loss_aggregation=aggregation, tis_level="sequence")
    batch = random_batch(torch.Generator().manual_seed(5), b=4, t=5)
    padded, _ = policy_loss(batch["logprobs"], batch["old_logprobs"], batch["advantages"], batch["loss_mask"], cfg,
                            rollout_logprobs=batch["rollout_logprobs"], ref_logprobs=batch["ref_logprobs"],
                            entropy=batch["entropy"])
    # pack: cut each row after its last loss token plus one padding token; ids are labels, not positions
    lengths = [min(5, int(torch.nonzero(m).max()) + 2) if m.any() else 1 for m in batch["loss_mask"]]
    assert lengths != [5, 5, 5, 5]
    sample_ids = torch.cat([torch.full((n,), 10 * (i + 1)) for i, n in enumerate(lengths)])
    packed = {k: torch.cat([v[i, :n] for i, n in enumerate(lengths)]) for k, v in batch.items()}
    loss, _ = policy_loss(packed["logprobs"], packed["old_logprobs"], packed["advantages"], packed["loss_mask"], cfg,
                          rollout_logprobs=packed["rollout_logprobs"], ref_logprobs=packed["ref_logprobs"],
                          entropy=packed["entropy"], sample_ids=sample_ids)
    assert loss.item() == pytest.approx(padded.item(), rel=1e-12)


# --- properties ----------------------------------------------------------------------------------------------------

def tensors(n: int, lo: float, hi: float):
    return st.lists(st.floats(lo, hi, allow_nan=False), min_size=n, max_size=n).map(
        lambda xs: T(xs, dtype=torch.float64))


@st.composite
def loss_inputs(draw):
    n = draw(st.integers(1, 12))
    lp, old, rollout, ref = (draw(tensors(n, -6.0, 0.0)) for _ in range(4))
    adv, ent = draw(tensors(n, -3.0, 3.0)), draw(tensors(n, 0.0, 4.0))
    mask = T(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    ids = T(sorted(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))))
    cfg = replace(CFG, loss_aggregation=draw(st.sampled_from(AGGREGATIONS)),
                  tis_level=draw(st.sampled_from(["token", "sequence"])),
                  kl_estimator=draw(st.sampled_from(KL_ESTIMATORS)),
                  kl_coef=draw(st.sampled_from([0.0, 0.1])), entropy_coef=draw(st.sampled_from([0.0, 0.01])))
    return lp, old, adv, mask, rollout, ref, ent, ids, cfg


@PROPS
@given(inputs=loss_inputs())
def test_gradient_wrt_logprobs_matches_finite_differences(inputs) -> None:
    lp, old, adv, mask, rollout, ref, ent, ids, cfg = inputs
    log_ratio = lp - old
    for edge in (math.log(1 - cfg.eps_clip_low), math.log(1 + cfg.eps_clip_high)):
        assume(((log_ratio - edge).abs()[mask] > 1e-4).all())  # the clip's kinks have no derivative

    def f(lp_: torch.Tensor, ent_: torch.Tensor) -> torch.Tensor:
        return policy_loss(lp_, old, adv, mask, cfg, rollout_logprobs=rollout, ref_logprobs=ref, entropy=ent_,
                           sample_ids=ids)[0]

    assert torch.autograd.gradcheck(f, (lp.clone().requires_grad_(), ent.clone().requires_grad_()),
                                    eps=1e-7, atol=1e-6, rtol=1e-5)


@PROPS
@given(n=st.integers(1, 16), data=st.data(), level=st.sampled_from(["token", "sequence"]),
       clip=st.floats(1.0, 10.0), low=st.floats(0.0, 1.0))
def test_tis_weights_never_exceed_the_clamp(n, data, level, clip, low) -> None:
    cfg = replace(CFG, tis_level=level, tis_clip=clip, tis_clip_low=low)
    old = data.draw(tensors(n, -1e4, 0.0))
    rollout = data.draw(tensors(n, -1e4, 0.0))
    mask = T(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    ids = T(sorted(data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))))
    w, raw = truncated_is_weights(old.float(), rollout.float(), mask, cfg, sample_ids=ids)
    assert (w[mask] <= clip).all() and (w[mask] >= low).all() and w[~mask].eq(0).all()
    assert w.isfinite().all() and raw.isfinite().all() and not w.requires_grad


garbage = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.0])


@PROPS
@given(inputs=loss_inputs(), data=st.data())
def test_masked_tokens_get_zero_gradient_whatever_they_hold(inputs, data) -> None:
    lp, old, adv, mask, rollout, ref, ent, ids, cfg = inputs

    def run(fill: bool):
        tensors_ = [t.clone() for t in (lp, old, adv, rollout, ref, ent)]
        if fill:
            for t in tensors_:
                for i in torch.nonzero(~mask).flatten().tolist():
                    t[i] = data.draw(garbage)
        lp_, ent_ = tensors_[0].requires_grad_(), tensors_[5].requires_grad_()
        loss, metrics = policy_loss(lp_, tensors_[1], tensors_[2], mask, cfg, rollout_logprobs=tensors_[3],
                                    ref_logprobs=tensors_[4], entropy=ent_, sample_ids=ids)
        loss.backward()
        return loss, metrics, lp_.grad, ent_.grad

    clean_loss, clean_metrics, clean_grad, _ = run(False)
    loss, metrics, grad, ent_grad = run(True)
    assert grad[~mask].eq(0).all() and (ent_grad is None or ent_grad[~mask].eq(0).all())  # None: entropy_coef 0
    assert grad.isfinite().all() and loss.isfinite()
    assert loss.item() == clean_loss.item() and torch.equal(grad, clean_grad)
    assert all(torch.equal(metrics[k], clean_metrics[k]) for k in clean_metrics)
