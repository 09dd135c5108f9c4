"""Padding is invisible to the MoE routers: a micro-batch padded to a longer row (sequence parallelism, the
interleaved schedule) has the load-balancing loss and the gradients of its real tokens alone, in one process, under
EP2 and under PP2 x TP2+SP (whose second stage is given its sequence-parallel slice of the padding mask); a micro-batch
that is all padding (a short data-parallel rank's filler) adds a zero loss and zero gradients, not NaN."""

from __future__ import annotations

from pathlib import Path

import pytest
from megatron_launch import read_json, run_worker

LAYOUTS = {
    "one": (1, []),
    "ep2": (2, ["parallel.expert=2"]),
    "pp2_tp2_sp": (4, ["parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true"]),
}
RTOL = 1e-5


@pytest.mark.parametrize("layout", [pytest.param(name, marks=[pytest.mark.multiproc] if nproc > 1 else [])
                                    for name, (nproc, _) in LAYOUTS.items()])
def test_padding_changes_neither_the_load_balancing_loss_nor_the_gradients(tmp_path: Path, layout: str) -> None:
    nproc, overrides = LAYOUTS[layout]
    run_worker(nproc, "padding", tmp_path, "--tag", layout, *overrides)
    got = read_json(tmp_path / f"{layout}.json")
    aux = got["aux"]
    # the comparison has power: counted as tokens, the padding would change the loss and the router's gradient
    assert abs(aux["unmarked"] - aux["plain"]) > 1e-3 * aux["plain"] and got["unmarked_router_grad_err"] > 1e-2
    assert aux["padded"] == pytest.approx(aux["plain"], rel=RTOL)
    assert got["router_grad_err"] < RTOL, "router weight gradients of the padded row differ from the unpadded row's"
    assert got["grad_err"] < RTOL, "gradients of the padded row differ from the unpadded row's"
    assert got["empty_grad_not_finite"] == 0, "an all-padding micro-batch gave non-finite gradients"
    assert aux["empty"] == 0.0 and got["empty_grad_max"] == 0.0
