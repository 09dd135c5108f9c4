"""MoE routing replay (rl.routing_replay): the old-policy pass records every MoE layer's experts per token, and the
train steps' forward and backward recompute use them, whatever rows the steps pack the samples into; EP2, TP2+SP (with
the fused log-prob kernels) and CP2 replay the same routing and take the same steps as one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_launch import read_json, run_worker

from spade_mega.config.errors import ConfigError
from spade_mega.config.loader import apply_overrides, build, to_dict
from spade_mega.config.schema import SpadeConfig
from spade_mega.megatron.batch import BatchError, TrainSample, pack, samples_from

WORKER = Path(__file__).with_name("routing_worker.py")
# a large learning rate: one step changes which experts the router picks for many tokens
LARGE_STEP = ["optimizer.lr=3e-3"]
LAYOUTS = {
    "ep2": (2, ["parallel.expert=2"]),
    "tp2_sp": (2, ["parallel.tensor=2", "parallel.sequence_parallel=true", "kernels.enabled=true"]),
    # two CP ranks share a row: half the budget keeps one sample a row (the load-balancing loss is per row)
    "cp2": (2, ["parallel.context=2", "parallel.max_tokens_per_gpu=9", "--pass-budget", "40"]),
    # a stage of one MoE layer each, full recompute: six micro-batches under 1F1B, so the first stage runs the forward
    # of micro-batch k + 1 before the backward recompute of k (which must replay k's experts, not the last forward's)
    "pp2": (2, ["parallel.pipeline=2", "parallel.recompute=full"]),
}
STAGE_LAYERS = {"pp2": slice(0, 1)}  # the MoE layers of rank 0, which writes the table, where it holds not all
COMPARED = ("loss", "pg_loss", "clip_frac", "approx_kl", "grad_norm", "moe_load_balancing_loss",
            "routing_replay_drift")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("routing_replay")
    run_worker(1, "replay", out, "--tag", "ref", "parallel.recompute=full", *LARGE_STEP, worker=WORKER)
    return out


def test_steps_replay_the_old_policy_routing_token_by_token(one_process: Path) -> None:
    """Forward and full recompute of both steps route every token of every row (samples repacked from one row of six
    into a row each, in a shuffled order) to the experts of the first pass, although after step 1 the router picks
    others for many tokens: without replay the steps' routing would differ."""
    got = read_json(one_process / "ref.json")
    assert got["order"] != sorted(got["order"]), "the steps must see the samples in another order"
    assert set(got["calls"]) == {"step1_forward", "step1_recompute", "step2_forward", "step2_recompute"}
    for name, agree in got["calls"].items():
        assert len(agree) == 2 * 6 and all(agree), f"{name}: rows routed otherwise than recorded: {agree}"
    first, moved = torch.load(one_process / "ref_routing.pt")
    changed = (first.sort(-1).values != moved.sort(-1).values).any(-1).float().mean()
    assert changed > 0.05, f"the step moved the router too little to test replay ({changed:.3f} of tokens x layers)"
    assert got["routing_dtype"] == "torch.uint8"  # 4 experts: one byte an index


def test_first_step_ratio_is_exactly_one_and_drift_is_reported(one_process: Path) -> None:
    got = read_json(one_process / "ref.json")
    assert got["step1"]["approx_kl"] == 0.0 and got["step1"]["clip_frac"] == 0.0
    assert got["step1"]["routing_replay_drift"] == 0.0
    # step 2's router disagrees with the replayed experts on a share of the (token, layer) pairs
    assert 0.05 < got["step2"]["routing_replay_drift"] < 1.0
    assert got["step2"]["approx_kl"] > 0


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_replay_like_one_process(one_process: Path, layout: str) -> None:
    """The record pass (six samples in one row split over data-parallel, sequence-parallel or context-parallel
    ranks, reduced over them) gives every rank the whole batch's routing (of its pipeline stage's layers); the
    replayed steps and the weights after them equal one process's."""
    nproc, overrides = LAYOUTS[layout]
    run_worker(nproc, "replay", one_process, "--tag", layout, "--load", str(one_process / "init"), *LARGE_STEP,
               *overrides, worker=WORKER)
    want, got = read_json(one_process / "ref.json"), read_json(one_process / f"{layout}.json")
    assert torch.equal(torch.load(one_process / f"{layout}_routing.pt"),
                       torch.load(one_process / "ref_routing.pt")[:, :, STAGE_LAYERS.get(layout, slice(None))])
    for step in ("step1", "step2"):
        for key in COMPARED:
            err = abs(got[step][key] - want[step][key]) / max(abs(want[step][key]), 1e-12)
            assert err < 1e-5 or abs(got[step][key] - want[step][key]) < 1e-9, \
                f"{layout} {step}: {key} = {got[step][key]!r}, one process {want[step][key]!r}"
    after, ref = torch.load(one_process / f"{layout}_after.pt"), torch.load(one_process / "ref_after.pt")
    assert float((after - ref).abs().max()) < 1e-4, f"{layout}: log-probs after the steps differ"


def _cfg(*overrides: str) -> SpadeConfig:
    return build(SpadeConfig, apply_overrides(to_dict(SpadeConfig()), list(overrides)))


def test_dense_model_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """By the config check, and by the trainer (which resolves a config.json's model) before it joins a process group
    or builds anything."""
    from spade_mega.megatron import Trainer, train

    def joined(*args: object) -> None:
        raise AssertionError("the trainer started torch.distributed before refusing the config")

    monkeypatch.setattr(train, "init_distributed", joined)
    dense = _cfg("rl.routing_replay=true", "model.num_experts=0")
    with pytest.raises(ConfigError, match=r"rl\.routing_replay.*mixture-of-experts"):
        dense.check()
    with pytest.raises(ConfigError, match=r"rl\.routing_replay.*mixture-of-experts"):
        Trainer(dense)
    _cfg("rl.routing_replay=true").check()


def test_samples_with_old_logprobs_but_no_routing_are_refused(one_process: Path) -> None:
    message = read_json(one_process / "ref.json")["unrouted"]
    assert "sample 0: old_logprobs given without routing while rl.routing_replay is on" in message
    assert "Trainer.old_policy" in message


def _sample(n: int, routing: object = None, index: int = 0) -> TrainSample:
    return TrainSample(torch.arange(n), torch.arange(n) > 0, torch.ones(n), index=index, routing=routing)


def test_a_rows_routing_is_gathered_token_aligned_from_its_samples() -> None:
    """A step's forward takes, for each position it routes (here a context-parallel shard of a row whose segments are
    padded), the experts its sample's own rows hold for that token (the input token, not shifted like the labels),
    -1 on padding (the router's own choice)."""
    from spade_mega.megatron import compat

    compat.install()
    from spade_mega.megatron.routing import gather_rows

    a = _sample(5, torch.arange(5 * 2 * 3).reshape(5, 2, 3).to(torch.uint8), index=0)
    b = _sample(3, 100 + torch.arange(3 * 2 * 3).reshape(3, 2, 3).to(torch.uint8), index=1)
    row = pack([a, b], token_budget=16, context=2, length_multiple=4).micro_batches[0][0]
    full = gather_rows([a.routing, b.routing], row.sample_ids[0], row.position_ids[0], slice(0, 2))
    assert full.shape == (row.length, 2, 3) and full.dtype == torch.long
    assert torch.equal(full[:5], a.routing.long()) and torch.equal(full[8:11], b.routing.long())  # a padded to 8
    padding = row.sample_ids[0] < 0
    assert padding.sum() == 3 + 1 and bool((full[padding] == -1).all())
    shard = row.context_shard(1, 2)
    assert torch.equal(gather_rows([a.routing, b.routing], shard.sample_ids[0], shard.position_ids[0], slice(0, 2)),
                       full[shard.row_index])
    assert torch.equal(gather_rows([a.routing, b.routing], row.sample_ids[0], row.position_ids[0], slice(1, 2)),
                       full[:, 1:])


def test_routing_must_fit_its_sample() -> None:
    with pytest.raises(BatchError, match=r"sample 0: routing must be integer expert indices \[tokens \(4\)"):
        _sample(4, torch.zeros(3, 2, 2, dtype=torch.long))
    with pytest.raises(BatchError, match="routing must be integer"):
        _sample(4, torch.zeros(4, 2, 2))
    routed = _sample(4, torch.zeros(4, 2, 2, dtype=torch.long))
    assert torch.equal(samples_from([routed])[0].routing, routed.routing)


def test_negative_expert_indices_are_refused() -> None:
    """A negative index names no expert: a step would have replayed the router's own choice for the token (-1 first,
    what a step's gathering gives padding) or failed inside the router's gather."""
    routing = torch.zeros(4, 2, 2, dtype=torch.int16)
    routing[2, 1, 0] = -1
    with pytest.raises(BatchError, match=r"sample 3: routing must be integer expert indices, each >= 0, got -1"):
        _sample(4, routing, index=3)


LOOP_SCRIPT = """
import json, sys
import torch
from spade_mega.config.loader import load_config
from spade_mega.megatron import Trainer
from spade_mega.selfplay.batch import Trajectory, train_samples
from spade_mega.selfplay.loop import SelfPlay

cfg = load_config(sys.argv[1], ["rl.routing_replay=true", "optimizer.lr=3e-3", "optimizer.warmup_steps=0",
                                "rollout.envs_per_rollout=1", "rollout.agent_trajectories_per_env=4",
                                "selfplay.global_batch_size=2", "rl.loss_aggregation=token-mean"])
loop = SelfPlay(cfg)
trainer = Trainer(cfg, total_steps=2)
g = torch.Generator().manual_seed(0)
trajectories = [Trajectory(torch.randint(0, 256, (24,), generator=g).tolist(), [0] * 8 + [1] * 16,
                           [0.0] * 8 + [-5.0] * 16, "agent", float(i % 2), "env0") for i in range(4)]
samples = train_samples(trajectories, torch.tensor([0.5, -0.5, 0.25, -0.25]))
step, drifts = trainer.train_step, []


def train_step(batch):
    result = step(batch)
    drifts.append(result.metrics["routing_replay_drift"])
    return result


trainer.train_step = train_step
metrics, _ = loop._train(trainer, samples, 1)
json.dump({"drifts": drifts, "train": metrics["train/routing_replay_drift"],
           "routed": [list(s.routing.shape) for s in samples]}, open(sys.argv[2], "w"))
"""


def test_the_loop_replays_the_routing_of_its_old_logprob_pass(tmp_path: Path) -> None:
    """SelfPlay._train records the routing in its old-log-prob pass (with the old log-probs alone every step would be
    refused) and reports the steps' drift as train/routing_replay_drift: 0 at the first step, not at the second,
    whose samples the first step's update reached."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "loop.json"
    proc = subprocess.run([sys.executable, "-c", LOOP_SCRIPT, str(root / "examples/configs/tiny_cpu.yaml"), str(out)],
                          capture_output=True, text=True, timeout=300, cwd=root,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["routed"] == [[24, 2, 2]] * 4  # tokens, both MoE layers, top-2
    assert len(got["drifts"]) == 2 and got["drifts"][0] == 0.0 < got["drifts"][1]
    assert got["train"] == pytest.approx(sum(got["drifts"]) / 2)
