"""``kernels.enabled``: the switch point gives rl's results on both sides of it, and over a real tensor-parallel
vocab split. Kernels run compiled on a GPU when there is one, interpreted on CPU otherwise (see kernel_support); the
gloo ranks too (gloo gathers CUDA tensors as well), so on a GPU the split is checked with the compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spade_mega.config import load_config
from spade_mega.config.schema import KernelsConfig, RLConfig
from spade_mega.kernels import grpo
from spade_mega.kernels.dispatch import LAUNCHES
from spade_mega.rl.advantages import AGENT, DESIGNER
from kernel_support import to_cpu, to_kernel_device

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "configs"
ON, OFF = KernelsConfig(enabled=True), KernelsConfig(enabled=False)
RL = RLConfig(loss_aggregation="seq-mean-token-mean", tis_level="sequence", kl_coef=0.1, entropy_coef=0.01)
VOCAB, TEMPERATURE = 260, 0.6


def loss_batch(seed: int) -> dict:
    """Two samples of 14 tokens, [batch, tokens] layout, every policy_loss feature active."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, 14)
    logits = torch.randn(*shape, VOCAB, generator=g) * 2
    tokens = torch.randint(0, VOCAB, shape, generator=g)
    lp = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, tokens[..., None]).squeeze(-1)
    old = lp + 0.3 * torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.3
    return dict(logits=logits, tokens=tokens, old_logprobs=old, advantages=torch.randn(shape, generator=g),
                loss_mask=mask, rollout_logprobs=old + 0.2 * torch.randn(shape, generator=g),
                ref_logprobs=lp + 0.1 * torch.randn(shape, generator=g))


def run_loss(batch: dict, kernels: KernelsConfig, logits: torch.Tensor, **kw):
    """Loss, metrics and logits gradient on the kernel device, returned on CPU."""
    logits = to_kernel_device(logits).detach().clone().requires_grad_(True)  # a fresh leaf: no shared .grad
    args = {k: to_kernel_device(v) for k, v in batch.items() if k != "logits"}
    loss, metrics = grpo.policy_loss_from_logits(logits=logits, rl=RL, kernels=kernels, temperature=TEMPERATURE,
                                                 **args, **kw)
    loss.backward()
    return to_cpu((loss.detach(), metrics, logits.grad))


def test_policy_loss_from_logits_is_the_same_on_both_sides_of_the_switch() -> None:
    batch = loss_batch(int.from_bytes(os.urandom(4), "little"))
    before = LAUNCHES.copy()
    off = run_loss(batch, OFF, batch["logits"])
    assert LAUNCHES == before, "kernels.enabled: false must not launch a kernel"
    on = run_loss(batch, ON, batch["logits"])
    assert LAUNCHES["tis_logprob.shard_stats"] == before["tis_logprob.shard_stats"] + 1
    assert LAUNCHES["tis_logprob.logits_grad"] == before["tis_logprob.logits_grad"] + 1
    torch.testing.assert_close(on[0], off[0], rtol=1e-5, atol=1e-6)
    assert on[1].keys() == off[1].keys() and {"entropy", "kl_ref", "tis_ratio_mean"} <= on[1].keys()
    for key in on[1]:
        torch.testing.assert_close(on[1][key], off[1][key], rtol=1e-5, atol=1e-6, msg=key)
    torch.testing.assert_close(on[2], off[2], rtol=1e-4, atol=1e-7)


def test_sample_advantages_is_the_same_on_both_sides_of_the_switch() -> None:
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    rewards = torch.randn(40, generator=g)
    roles = torch.where(torch.arange(40) < 32, AGENT, DESIGNER)
    groups, skills = torch.arange(40) // 8, torch.randint(0, 3, (40,), generator=g)
    mask = torch.rand(40, 9, generator=g) > 0.4
    before = LAUNCHES["grpo_advantage.forward"]
    rewards, groups, roles, skills, mask = to_kernel_device((rewards, groups, roles, skills, mask))
    off = to_cpu(grpo.sample_advantages(rewards, groups, roles, skills, 4.0, RLConfig(), OFF, loss_mask=mask))
    assert LAUNCHES["grpo_advantage.forward"] == before
    on = to_cpu(grpo.sample_advantages(rewards, groups, roles, skills, 4.0, RLConfig(), ON, loss_mask=mask))
    assert LAUNCHES["grpo_advantage.forward"] == before + 1
    torch.testing.assert_close(on.samples, off.samples, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(on.tokens, off.tokens, rtol=1e-6, atol=1e-6)


def test_the_switch_is_a_config_key(tmp_path: Path) -> None:
    assert load_config(EXAMPLES / "tiny_cpu.yaml").kernels.enabled is False
    assert load_config(EXAMPLES / "tiny_cpu.yaml", ["kernels.enabled=true"]).kernels.enabled is True
    assert load_config(EXAMPLES / "qwen3_30b_a3b_games.yaml").kernels.enabled is True


def _tp_rank(rank: int, world: int, init: str, seed: int, enabled: bool, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        batch = loss_batch(seed)
        shard = VOCAB // world
        logits = batch["logits"][..., rank * shard:(rank + 1) * shard]
        before = LAUNCHES["tis_logprob.shard_stats"]
        loss, metrics, grad = run_loss(batch, KernelsConfig(enabled=enabled), logits, tp_group=dist.group.WORLD)
        torch.save({"loss": loss, "metrics": metrics, "grad": grad,
                    "launches": LAUNCHES["tis_logprob.shard_stats"] - before}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.parametrize("enabled", [True, False], ids=["kernels", "reference"])
def test_tensor_parallel_vocab_split_over_gloo_matches_one_process(tmp_path: Path, enabled: bool) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    out = str(tmp_path / "rank")
    mp.spawn(_tp_rank, args=(2, f"file://{tmp_path / 'store'}", seed, enabled, out), nprocs=2, join=True)
    batch = loss_batch(seed)
    loss, metrics, grad = run_loss(batch, KernelsConfig(enabled=enabled), batch["logits"])
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    for r in ranks:
        assert r["launches"] == (1 if enabled else 0)
        torch.testing.assert_close(r["loss"], loss, rtol=1e-5, atol=1e-6, msg=f"seed {seed}")
        for key, value in metrics.items():
            torch.testing.assert_close(r["metrics"][key], value, rtol=1e-5, atol=1e-6, msg=f"{key}, seed {seed}")
    torch.testing.assert_close(torch.cat([r["grad"] for r in ranks], dim=-1), grad, rtol=1e-4, atol=1e-7,
                               msg=f"seed {seed}")
