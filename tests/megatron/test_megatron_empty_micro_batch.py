"""An all-padding micro-batch leaves the MoE load-balancing loss alone. The interleaved schedule rounds a rank's
micro-batch count up to a multiple of PP, and a data-parallel rank with the smaller share runs empty micro-batches
to keep the ranks in step; Megatron averages the router loss (its gradient and the logged value) over every
micro-batch it runs, so each empty one diluted it (3 real + 1 empty: 3/4 of the loss). Five samples, each a
micro-batch of its own in every layout, trained in one process and in two layouts that add one empty micro-batch:
EP2 over two data-parallel ranks (3 + 2 samples), PP2 with two virtual stages (5 micro-batches rounded to 6), and the
same with each row split over two CP ranks (found off in review against a reference packing other rows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_launch import read_json, run_worker

pytestmark = pytest.mark.multiproc

# four layers: the interleaved schedule needs more layers than stages; a load-balancing coefficient large enough
# that the router loss's share of the update is well above the comparison's tolerance
COMMON = ["--num-samples", "5", "model.num_layers=4", "model.moe_aux_loss_coeff=0.1"]
LAYOUTS = {
    "ep2_uneven": (2, ["parallel.expert=2"], 3),
    "pp2_vpp2": (2, ["parallel.pipeline=2", "parallel.virtual_pipeline=2"], 6),
    # a row of two CP ranks holds 2 x 9 tokens: still one sample a micro-batch, as in one process
    "cp2_pp2_vpp2": (4, ["parallel.context=2", "parallel.pipeline=2", "parallel.virtual_pipeline=2",
                         "parallel.max_tokens_per_gpu=9"], 6),
}
RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("empty_micro_batch")
    run_worker(1, "reference", out, *COMMON)
    for tag, (nproc, overrides, _) in LAYOUTS.items():
        run_worker(nproc, "layout", out, "--tag", tag, *COMMON, *overrides)
    run_worker(1, "weights", out, *COMMON, "--dump", "init", "reference", *LAYOUTS)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_empty_micro_batch_leaves_the_load_balancing_loss_and_the_update_unchanged(runs: Path, layout: str) -> None:
    want = read_json(runs / "reference.json")["step1"]
    got = read_json(runs / f"{layout}.json")["step1"]
    # micro-batches per data-parallel rank: one of them is all padding (5 samples, 1 per micro-batch)
    assert (want["micro_batches"], got["micro_batches"]) == (5, LAYOUTS[layout][2])
    assert want["moe_load_balancing_loss"] > 0
    assert got["moe_load_balancing_loss"] == pytest.approx(want["moe_load_balancing_loss"], rel=RTOL)
    assert got["loss"] == pytest.approx(want["loss"], rel=RTOL)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL)
    initial = torch.load(runs / "init_weights.pt")
    reference = torch.load(runs / "reference_weights.pt")
    weights = torch.load(runs / f"{layout}_weights.pt")
    assert weights.keys() == reference.keys()
    for name, w in reference.items():
        update = w - initial[name]
        assert update.norm() > 0, f"{name} did not move: the comparison would prove nothing"
        err = float((weights[name] - initial[name] - update).norm() / update.norm())
        assert err < 1e-3, f"{layout}: the update of {name} differs by {err:.2e} of its size from one process"
        assert float((weights[name] - w).norm() / w.norm()) < RTOL, name
