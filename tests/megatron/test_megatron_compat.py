"""The CPU compatibility shims: every one is still needed by the pinned megatron-core, and each patched behaviour is
right. A failure after upgrading megatron-core or torch tells which shim to delete or fix (docs/megatron.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from megatron_launch import worker_command, worker_env

from spade_mega.megatron import compat

pytestmark = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the shims are for CUDA-less hosts")

PINNED = next(line.split("==")[1].strip() for line in
              (Path(__file__).resolve().parents[2] / "constraints/cpu.txt").read_text().splitlines()
              if line.startswith("megatron-core=="))


def run_compat(*args: str) -> dict:
    proc = subprocess.run(worker_command(1, "compat", Path("."), *args), env=worker_env(), capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def installed() -> dict:
    return run_compat()


@pytest.fixture(scope="module")
def installed_without_triton() -> dict:
    return run_compat("--no-triton")


def test_runs_against_the_pinned_megatron_core(installed: dict) -> None:
    assert installed["version"].split("+")[0] == PINNED


@pytest.mark.parametrize("shim", [s.name for s in compat.SHIMS if s.name != "paged_stash"])
def test_every_shim_is_still_needed(installed: dict, shim: str) -> None:
    assert shim in installed["applied"], (
        f"shim '{shim}' found no upstream condition in megatron-core {installed['version']}: the upgrade fixed it; "
        "delete the shim (see docs/megatron.md)")


def test_paged_stash_shim_is_needed_without_triton(installed_without_triton: dict) -> None:
    applied = installed_without_triton["applied"]
    assert "paged_stash" in applied, "megatron-core's schedules no longer import triton: delete the paged_stash shim"
    assert installed_without_triton["checks"]["paged_stash"], "the stand-in kernels must refuse to run"
    assert set(applied) == {s.name for s in compat.SHIMS + compat.FIXES}


@pytest.mark.parametrize("fix", [s.name for s in compat.FIXES])
def test_every_upstream_fix_is_still_needed(installed: dict, fix: str) -> None:
    assert fix in installed["applied"], (
        f"fix '{fix}' found no upstream bug in megatron-core {installed['version']}: the upgrade fixed it; delete the "
        "fix (see docs/megatron.md)")


@pytest.mark.parametrize("shim", ["rng_tracker", "cuda_runtime", "device_literals", "type_names", "torch_norm_sp",
                                  "alltoall_splits", "tied_embeddings"])
def test_patched_behaviour_is_right(installed: dict, shim: str) -> None:
    # torch_adam and uneven_collectives are checked end to end: resumed runs (Adam's step) and TP2xEP2 numerics in
    # test_megatron_parallel.py, as is tied_embeddings (its stage sync, by a tied PP2 run against one process); the
    # aux_loss_all_padding fix by an all-padding micro-batch in test_megatron_padding.py
    assert installed["checks"][shim], f"shim '{shim}' no longer gives the behaviour it promises"


def test_shim_evidence_names_the_upstream_condition(installed: dict) -> None:
    for name, evidence in installed["applied"].items():
        assert isinstance(evidence, str) and len(evidence) > 10, name
    assert "torch.cuda" in installed["applied"]["cuda_runtime"]


def test_importing_the_package_patches_nothing() -> None:
    code = "import sys, spade_mega.megatron as m; from spade_mega.megatron import compat; " \
           "print('megatron.core' in sys.modules, compat.installed())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=worker_env())
    assert out.stdout.split() == ["False", "{}"], out.stderr[-2000:]


@pytest.mark.multiproc
def test_gloo_still_rejects_uneven_all_gather(tmp_path: Path) -> None:
    """The reason for the uneven_collectives shim is torch's gloo backend; if it learns uneven all_gather the shim
    can go."""
    script = tmp_path / "uneven.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        parts = [torch.empty(n) for n in (1, 2)]
        try:
            dist.all_gather(parts, torch.ones(rank + 1))
            print("ACCEPTED")
        except RuntimeError as exc:
            print("REJECTED", str(exc).splitlines()[0])
        dist.destroy_process_group()
    """))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script)], capture_output=True, text=True, timeout=120, env=worker_env())
    assert "REJECTED" in proc.stdout and "ACCEPTED" not in proc.stdout, (
        f"gloo now gathers uneven tensors: the uneven_collectives shim can be deleted\n{proc.stdout}{proc.stderr[-2000:]}")



def test_megatron_cores_deprecated_calls_are_quiet_and_other_warnings_are_not(tmp_path: Path) -> None:
    """A run printed torch's deprecation of the collectives megatron-core's distributed optimizer calls at every step;
    after install() those notices are gone, while our own FutureWarnings still show."""
    code = textwrap.dedent("""
        import logging, os, warnings, torch, torch.distributed as dist
        from spade_mega.megatron import compat
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
        dist.init_process_group("gloo", rank=0, world_size=1)
        compat.install()
        out = torch.empty(2)
        dist.all_gather_into_tensor(out, torch.ones(2))
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2))
        logging.basicConfig()
        logging.getLogger("megatron.core.dist_checkpointing.strategies.torch").warning("MCore's async save is deprecated")
        warnings.warn("ours", FutureWarning)
        dist.destroy_process_group()
    """)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(worker_env(), PORT=str(port))
    proc = subprocess.run([sys.executable, "-W", "always::FutureWarning", "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "deprecated" not in proc.stderr, proc.stderr[-2000:]
    assert "FutureWarning: ours" in proc.stderr
