"""Every collective of a GPU run runs on a backend that serves its tensors' device. NCCL serves CUDA tensors only, and
the trainer reduces host tensors too (each step's metric sums, the loop's and the checkpoints' object collectives):
with the default group started as plain "nccl", a GPU run failed at its first log-prob pass ("No backend type
associated with device type cpu"). The default group is a device-to-backend map instead (parallel.backend_for).

On CPU every tensor is a host tensor and every group is gloo, so the check judges each collective of a real trainer's
work (2 ranks, EP2 x DP2: log-probs with routing replay, a GSPO step with a KL reference on the distributed
optimizer, the loop's rank-0 broadcast and stop agreement, a checkpoint) against the map its group would have on a
GPU machine: the map parallel.backend_for gives there for the groups that inherit the default's (all of them on CPU,
where Megatron's own gloo groups read the same; judging those by the map too is the stricter reading). Plain "nccl"
there fails it at the first host tensor. With a GPU (the ``gpu`` test, in tools/bench/gpu.sh's ``trainer`` stage) the
same work runs on CUDA and is judged by the groups' real maps, and the log-prob table is reduced on the device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.distributed_c10d import BackendConfig

from spade_mega.megatron.parallel import LaunchError, backend_for, cuda_device

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("nccl_devices_worker.py")


def backends(config: str) -> dict[str, str]:
    return {device: str(backend) for device, backend in BackendConfig(config).get_device_backend_map().items()}


def test_the_default_group_on_a_cuda_machine_sends_host_tensors_to_gloo_and_device_tensors_to_nccl() -> None:
    assert backends(backend_for(cuda=True)) == {"cpu": "gloo", "cuda": "nccl"}
    assert backends(backend_for(cuda=False))["cpu"] == "gloo"
    assert backends("nccl") == {"cuda": "nccl"}  # what the check below catches: no backend for host tensors


@pytest.mark.parametrize("environ, visible, device", [
    ({"LOCAL_RANK": "3"}, 8, 3),
    ({"SLURM_LOCALID": "2"}, 4, 2),                      # srun tasks exporting RANK themselves, no LOCAL_RANK
    ({"LOCAL_RANK": "1", "SLURM_LOCALID": "5"}, 8, 1),   # torchrun's own local rank wins
    ({"LOCAL_RANK": "5"}, 1, 0),                         # one GPU visible per rank (srun --gpus-per-task)
    ({}, 8, 0),
])
def test_each_rank_takes_its_local_gpu(environ: dict[str, str], visible: int, device: int) -> None:
    assert cuda_device(environ, visible) == device


@pytest.mark.parametrize("environ, words", [
    ({"LOCAL_RANK": "4", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, ["LOCAL_RANK=4", "sees 4 GPUs", "0,1,2,3", "at most 4"]),
    ({"SLURM_LOCALID": "x"}, ["SLURM_LOCALID='x'", "not a local rank"]),
])
def test_a_local_rank_without_its_gpu_is_a_launch_error(environ: dict[str, str], words: list[str]) -> None:
    with pytest.raises(LaunchError) as err:
        cuda_device(environ, 4)
    assert all(word in str(err.value) for word in words), str(err.value)


def test_a_gpu_rank_takes_its_gpu_then_starts_the_default_group_as_the_map(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a GPU run's init_distributed does, on this CPU machine: only torch's CUDA and process-group calls are
    stood in for (none can run here), so the CPU checks above see init_distributed stop using the map or the rank's
    GPU, or take the GPU after the group started (NCCL binds a rank to the device current when it first runs)."""
    from spade_mega.megatron import parallel

    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel.dist, "get_world_size", lambda: 8)
    monkeypatch.setattr(parallel.dist, "init_process_group",
                        lambda backend, **kwargs: calls.append(("init_process_group", str(backend))))
    monkeypatch.setattr(parallel.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(parallel.torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(parallel.torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    for key in ("SLURM_LOCALID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert parallel.init_distributed() == 8
    assert calls == [("set_device", 5), ("init_process_group", "cpu:gloo,cuda:nccl")]


@pytest.mark.parametrize("config, ok", [("cuda:nccl", False), ("cpu:gloo,cuda:nccl", True),
                                        ("cpu:gloo,cuda:gloo", True)])
def test_a_default_group_started_elsewhere_must_serve_host_tensors(monkeypatch: pytest.MonkeyPatch, config: str,
                                                                   ok: bool) -> None:
    """A user's script that started the default group itself as plain "nccl" (common in verl/slime-style drivers)
    would fail at the first log-prob pass with torch's "No backend type associated with device type cpu": refused
    up front, naming the map. torch's reading of the running group is stood in for (no NCCL here)."""
    from spade_mega.megatron import parallel

    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(parallel.dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(parallel.dist, "get_backend_config", lambda group=None: config)
    if ok:
        assert parallel.init_distributed() == 4
    else:
        with pytest.raises(LaunchError) as err:
            parallel.init_distributed()
        assert "'cuda:nccl'" in str(err.value) and "cpu:gloo,cuda:nccl" in str(err.value), str(err.value)


def run_worker(tmp_path: Path, nproc: int, *overrides: str, cuda: bool) -> dict[str, Any]:
    out = tmp_path / "records.json"
    launcher = [sys.executable] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU run on any machine
    proc = subprocess.run([*launcher, str(WORKER), "--out", str(out), *overrides], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


def misrouted(result: dict[str, Any], gpu_default: str = backend_for(cuda=True)) -> list[str]:
    """The collectives whose tensors' device the group's backend map on a GPU machine does not serve, or serves by
    another backend than gloo for host tensors. From a CPU run, a group inheriting the default's map is judged by
    ``gpu_default``, the default group's backend on a GPU machine."""
    bad = []
    for r in result["records"]:
        config = r["config"] if result["cuda"] or not r["inherits"] else gpu_default
        served = backends(config)
        for device in r["devices"]:
            if device not in served or (device == "cpu" and served["cpu"] != "gloo"):
                bad.append(f"{r['phase']}: {r['op']} of {device} tensors at {r['caller']}, on a group of {config}")
    return bad


def callers(result: dict[str, Any], phase: str) -> set[str]:
    return {r["caller"].rsplit(" ", 1)[1] for r in result["records"] if r["phase"] == phase}


@pytest.mark.multiproc
@pytest.mark.slow
def test_every_collective_of_a_trainer_runs_where_a_gpu_runs_backend_map_serves_its_tensors(tmp_path: Path) -> None:
    result = run_worker(tmp_path, 2, "parallel.expert=2", cuda=False)
    assert result["finite"] and not result["stopped"] and result["shared"] == {"samples": 4}
    # the default group was started from backend_for (what a GPU run then starts from backend_for(cuda=True))
    assert result["default_config"] == result["backend_for_here"]
    assert misrouted(result) == []
    # what was judged: the trainer's and the loop's own reductions, and Megatron's on its groups, ...
    assert {"_forward_collect", "recording"} <= callers(result, "logprobs")
    assert {"_forward_collect", "train_step", "_elements_finite", "start_grad_sync", "start_param_sync",
            "forward"} <= callers(result, "train_step")
    assert {"_from_rank0", "agreed"} <= callers(result, "loop")
    assert {"_on_rank0", "_first_failure", "complete"} <= callers(result, "save")
    assert any(not r["default"] and r["inherits"] for r in result["records"])  # Megatron's subgroups
    # ... each of which a default group of plain "nccl" would have refused
    assert len(misrouted(result, gpu_default="nccl")) == len(result["records"])


@pytest.mark.gpu
def test_a_trainer_steps_on_a_gpu_with_every_collective_on_a_backend_for_its_device(tmp_path: Path) -> None:
    result = run_worker(tmp_path, 1, cuda=True)
    assert result["cuda"] and result["device"].startswith("cuda") and result["finite"], result["metrics"]
    assert backends(result["default_config"]) == {"cpu": "gloo", "cuda": "nccl"}
    assert misrouted(result) == []
    # the rollout's log-prob table, the largest reduction of the pass, is reduced on the device (NCCL)
    table = [r for r in result["records"] if r["phase"] == "logprobs" and r["caller"].endswith("_forward_collect")]
    assert table and all(r["devices"] == ["cuda"] for r in table), table
