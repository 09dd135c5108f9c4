"""Checkpoints are atomic: a save killed midway leaves no checkpoint that looks complete, loading refuses what is
incomplete, and the next run resumes from the newest complete one and cleans up."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from megatron_launch import worker_command, worker_env

from spade_mega.megatron import CheckpointError, find_latest
from spade_mega.megatron.checkpoint import MANIFEST, is_complete, read_manifest


def kill_second_save(out: Path) -> list[Path]:
    """Run killsave and SIGKILL its process group once the second save has started writing; the partial folders."""
    proc = subprocess.Popen(worker_command(1, "killsave", out), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=worker_env(), start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("SAVING"):
                break
        deadline = time.monotonic() + 120
        partial: list[Path] = []
        while time.monotonic() < deadline and proc.poll() is None:
            partial = [p for p in (out / "ckpt").glob(".step_00000001.partial-*") if any(p.iterdir())]
            if partial:
                break
            time.sleep(0.002)
        assert partial, "the second save never started writing"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return partial


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    out = tmp_path_factory.mktemp("megatron_killsave")
    return out, kill_second_save(out)


def test_killed_save_leaves_no_complete_looking_checkpoint(crashed: tuple[Path, list[Path]]) -> None:
    out, partial = crashed
    root = out / "ckpt"
    assert not (root / "step_00000001").exists()
    assert find_latest(root) == root / "step_00000000"
    assert all(p.exists() and not is_complete(p) and not (p / MANIFEST).exists() for p in partial)
    with pytest.raises(CheckpointError, match="interrupted"):
        read_manifest(partial[0])


def test_next_run_resumes_from_the_newest_complete_checkpoint_and_cleans_up(
        crashed: tuple[Path, list[Path]]) -> None:
    out, partial = crashed
    proc = subprocess.run(worker_command(1, "killsave", out), capture_output=True, text=True, env=worker_env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED 0" in proc.stdout and "SAVED" in proc.stdout
    root = out / "ckpt"
    assert not any(p.exists() for p in partial) and not list(root.glob(".*"))
    assert find_latest(root) == root / "step_00000001"
    manifest = read_manifest(root / "step_00000001")
    assert manifest["step"] == 1 and manifest["optimizer_state"] and manifest["world_size"] == 1
    assert not read_manifest(root / "step_00000000")["optimizer_state"]  # before the first update: model only


def test_incomplete_or_foreign_checkpoints_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        read_manifest(tmp_path / "step_00000003")
    fake = tmp_path / "step_00000003"
    fake.mkdir()
    with pytest.raises(CheckpointError, match="interrupted"):
        read_manifest(fake)
    (fake / MANIFEST).write_text(json.dumps({"format": 99, "step": 3}))
    with pytest.raises(CheckpointError, match="format 99"):
        read_manifest(fake)
    (fake / MANIFEST).write_text("[1, 3]")
    with pytest.raises(CheckpointError, match="must hold a JSON object"):
        read_manifest(fake)
    # the folder name orders checkpoints for resuming: a manifest of another step (a renamed copy) or none is refused
    for manifest in ({"format": 1, "step": 7}, {"format": 1}):
        (fake / MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match="does not match the folder"):
            read_manifest(fake)
    assert find_latest(tmp_path / "missing") is None


def test_checkpoint_of_another_architecture_is_refused(crashed: tuple[Path, list[Path]]) -> None:
    out, _ = crashed
    proc = subprocess.run(worker_command(1, "resume", out, "--load", str(out / "ckpt" / "step_00000000"),
                                         "model.num_experts=8", "model.qk_layernorm=false"),
                          capture_output=True, text=True, env=worker_env(), timeout=300)
    assert proc.returncode != 0
    assert "another model architecture" in proc.stderr and "num_experts" in proc.stderr
    # without q/k norms the model asks for fewer tensors than were saved: it would load, silently dropping them
    assert "qk_layernorm" in proc.stderr


def test_a_damaged_checkpoint_is_refused_with_a_checkpoint_error(crashed: tuple[Path, list[Path]],
                                                                  tmp_path: Path) -> None:
    """A complete-looking checkpoint whose data file was cut short (a copy interrupted, a full disk): one
    CheckpointError naming the folder and the failure, not torch's CheckpointException (a BaseException that no
    ``except Exception`` catches) with a page of traceback."""
    out, _ = crashed
    damaged = tmp_path / "step_00000000"
    shutil.copytree(out / "ckpt" / "step_00000000", damaged)
    for data in damaged.glob("*.distcp"):
        data.write_bytes(data.read_bytes()[:100])
    proc = subprocess.run(worker_command(1, "resume", out, "--load", str(damaged)),
                          capture_output=True, text=True, env=worker_env(), timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "spade_mega.megatron.checkpoint.CheckpointError: " in last and str(damaged) in last, last
    assert "cannot be loaded" in last and "CheckpointException" not in last


def test_a_replaced_checkpoint_comes_back_if_its_replacement_never_arrived(tmp_path: Path) -> None:
    from spade_mega.megatron.checkpoint import _recover

    set_aside = tmp_path / ".step_00000002.replaced-abc"
    set_aside.mkdir()
    (set_aside / MANIFEST).write_text(json.dumps({"format": 1, "step": 2}))
    (tmp_path / ".step_00000003.partial-def").mkdir()
    _recover(tmp_path)
    assert find_latest(tmp_path) == tmp_path / "step_00000002" and not list(tmp_path.glob(".*"))


def test_keeping_the_newest_checkpoints_never_deletes_the_one_just_saved(tmp_path: Path) -> None:
    """A run continued from step 2 saves step 3 while step 10 of the abandoned run is still there: with keep=1 the
    checkpoint just written stays (deleting it would lose the run's only state)."""
    from spade_mega.megatron.checkpoint import _prune, step_dir

    for step in (1, 2, 3, 10):
        step_dir(tmp_path, step).mkdir()
        (step_dir(tmp_path, step) / MANIFEST).write_text("{}")
    _prune(tmp_path, 1, step_dir(tmp_path, 3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000010"]
    _prune(tmp_path, 1, step_dir(tmp_path, 10))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000010"]


def test_a_save_that_cannot_write_is_a_checkpoint_error(tmp_path: Path) -> None:
    """The checkpoint root is an existing file: one CheckpointError naming it (raised on every rank, where a failure
    on rank 0 alone used to leave the others waiting in the next collective), not a raw FileExistsError."""
    (tmp_path / "init").write_text("not a folder")
    proc = subprocess.run(worker_command(1, "reference", tmp_path), capture_output=True, text=True,
                          env=worker_env(), timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "spade_mega.megatron.checkpoint.CheckpointError: " in last and str(tmp_path / "init") in last, last
    assert (tmp_path / "init").read_text() == "not a folder"


def test_a_root_is_resolved_to_its_newest_complete_checkpoint_even_when_hidden(tmp_path: Path) -> None:
    from spade_mega.megatron.checkpoint import resolve_checkpoint, step_dir

    root = tmp_path / ".checkpoints"  # a hidden root is a root, not a save in progress
    for step in (2, 10):
        step_dir(root, step).mkdir(parents=True)
        (step_dir(root, step) / MANIFEST).write_text("{}")
    step_dir(root, 11).mkdir()  # no manifest: incomplete
    partial = root / ".step_00000012.partial-abc"
    partial.mkdir()
    assert resolve_checkpoint(root) == step_dir(root, 10)
    assert resolve_checkpoint(step_dir(root, 2)) == step_dir(root, 2)
    assert resolve_checkpoint(partial) == partial  # named explicitly: read_manifest refuses it as interrupted
    (tmp_path / "runs").mkdir()
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        resolve_checkpoint(tmp_path / "runs")


def test_non_distributed_optimizer_resumes_in_its_layout_and_a_changed_optimizer_kind_is_named(
        tmp_path: Path, reference_run) -> None:
    """optimizer.distributed: false trains; its checkpoint resumes with the uninterrupted run's losses (it failed with
    KeyError 'param_state'). Its optimizer state is Megatron's per-layout format, so loading it with the distributed
    optimizer is refused naming optimizer.distributed, before anything is loaded."""
    from megatron_launch import read_json, run_worker

    plain = "optimizer.distributed=false"
    reference_run(tmp_path)
    run_worker(1, "layout", tmp_path, "--tag", "plain", "--continue-run", plain)
    run_worker(1, "resume", tmp_path, "--tag", "resumed", "--load", str(tmp_path / "plain"), plain)
    uninterrupted, resumed = read_json(tmp_path / "plain.json"), read_json(tmp_path / "resumed.json")
    assert resumed["loaded_step"] == 1
    for step in ("step2", "step3"):
        assert resumed[step]["loss"] == pytest.approx(uninterrupted[step]["loss"], rel=1e-6), step
    proc = subprocess.run(worker_command(1, "resume", tmp_path, "--tag", "other", "--load", str(tmp_path / "plain")),
                          capture_output=True, text=True, env=worker_env(), timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and "CheckpointError" in last and "optimizer.distributed" in last, last


@pytest.fixture(scope="module", params=["true", "false"], ids=["distributed", "non_distributed"])
def rescheduled(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """The schedule scenario's results and its log (a checkpoint resumed under other optimizer settings), with each
    kind of optimizer: the non-distributed one's parameter groups are matched by Megatron's identifiers, which hold
    the learning rate and weight decay, so a changed optimizer.lr once failed its resume as 'damaged files'."""
    from megatron_launch import read_json

    out = tmp_path_factory.mktemp("megatron_schedule")
    proc = subprocess.run(worker_command(1, "schedule", out, f"optimizer.distributed={request.param}"),
                          capture_output=True, text=True, env=worker_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_json(out / "schedule.json"), proc.stderr


def test_a_resumed_run_follows_its_configured_learning_rate_schedule(rescheduled: tuple[dict, str]) -> None:
    """A run extended from 4 to 12 steps (and given another schedule and learning rate) continues on its own
    schedule from the checkpoint's step, and says what changed. Megatron's default kept the checkpoint's horizon and
    decay style (but the config's learning rate): the extended run decayed to min_lr at step 4 and stopped learning.
    Loading again after a step (a rollback) puts the schedule back at the checkpoint's step: loading added the
    checkpoint's step count to the trainer's own."""
    got, log = rescheduled
    assert (got["num_steps"], got["lr_decay_steps"], got["lr_decay_style"]) == (2, 12, "linear")
    assert got["lr"] == pytest.approx(5e-5 * (1 - 2 / 12), rel=1e-9)  # linear decay over 12 steps, at step 2
    assert "lr_decay_steps 4 -> 12" in log and "optimizer.lr_schedule 'cosine' -> 'linear'" in log


def test_a_resumed_run_trains_with_its_configured_adam_hyper_parameters(rescheduled: tuple[dict, str]) -> None:
    """Adam's betas, eps and weight decay are the config's after a resume, and the log names each one that differs
    from the checkpoint's: they came back from the checkpoint's parameter groups, silently, so a user who changed
    optimizer.* and resumed trained with the old values."""
    got, log = rescheduled
    groups = got["groups"]
    assert groups and all(g["betas"] == [0.8, 0.95] and g["eps"] == 1e-6 for g in groups), groups
    assert {g["weight_decay"] for g in groups} == {0.05 * g["wd_mult"] for g in groups}
    assert any(g["wd_mult"] > 0 for g in groups)
    for change in ("optimizer.adam_beta1 0.9 -> 0.8", "optimizer.adam_beta2 0.98 -> 0.95",
                   "optimizer.adam_eps 1e-08 -> 1e-06", "optimizer.weight_decay 0.0 -> 0.05",
                   "optimizer.lr 0.0001 -> 5e-05"):
        assert change in log, (change, log[-3000:])


def test_a_file_or_a_manifest_without_an_architecture_is_named(tmp_path: Path) -> None:
    """A path to a file (a single-file checkpoint of another framework) is not 'no such folder'; a manifest whose
    architecture is not an object is a CheckpointError, not an AttributeError from comparing it."""
    from spade_mega.megatron.checkpoint import resolve_checkpoint

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint folder"):
        read_manifest(resolve_checkpoint(weights))
    assert weights.read_bytes() == b"\0" * 16
    step = tmp_path / "step_00000004"
    step.mkdir()
    for architecture in ("qwen3", None, [1, 2]):
        (step / MANIFEST).write_text(json.dumps({"format": 1, "step": 4, "architecture": architecture}))
        with pytest.raises(CheckpointError, match="no model architecture"):
            read_manifest(step)


def test_a_save_killed_while_pruning_leaves_no_damaged_checkpoint_that_looks_complete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """keep=N deletes old checkpoints; killed midway through deleting one (its data gone, its manifest not yet), the
    folder must not stay a step_<N> folder with a manifest, which loading would take for a complete checkpoint."""
    from spade_mega.megatron import checkpoint
    from spade_mega.megatron.checkpoint import _prune, _recover, step_dir

    for step in (1, 2):
        step_dir(tmp_path, step).mkdir()
        (step_dir(tmp_path, step) / "__0_0.distcp").write_bytes(b"weights")
        (step_dir(tmp_path, step) / MANIFEST).write_text(json.dumps({"format": 1, "step": step}))

    def killed_after_the_data(path: Path, ignore_errors: bool = False) -> None:
        for data in Path(path).glob("*.distcp"):
            data.unlink()
        raise KeyboardInterrupt  # stands for the SIGKILL: nothing after this runs

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_after_the_data)
    with pytest.raises(KeyboardInterrupt):
        _prune(tmp_path, 1, step_dir(tmp_path, 2))
    monkeypatch.undo()
    complete = [p.name for p in tmp_path.iterdir() if is_complete(p)]
    assert complete == ["step_00000002"]
    assert (step_dir(tmp_path, 2) / "__0_0.distcp").read_bytes() == b"weights"
    _recover(tmp_path)  # the next save finishes the deletion
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]


@pytest.mark.parametrize("keep", [0, -1])
def test_keeping_fewer_than_one_checkpoint_is_refused_before_anything_is_written(tmp_path: Path, keep: int) -> None:
    """keep=0 kept every checkpoint (a full disk later), though it reads as 'keep none': refused, nothing written
    (the check comes before the trainer is touched, so none is needed here)."""
    from spade_mega.megatron.checkpoint import save_checkpoint

    with pytest.raises(CheckpointError, match=f"keep must be >= 1.*got {keep}"):
        save_checkpoint(None, tmp_path / "ckpt", keep=keep)  # type: ignore[arg-type]
    assert not (tmp_path / "ckpt").exists()


def test_a_script_without_a_main_guard_can_save(tmp_path: Path) -> None:
    """Megatron's writer started a multiprocessing Manager by 'spawn' on a process's first save, which re-imports the
    main module: a training script with its code at top level ran again in it, and the save failed with a bare
    EOFError (one process) or hung for ever (under torchrun, the re-run joined the job). Saves now need no helper
    process."""
    script = tmp_path / "train_unguarded.py"
    script.write_text(f"""import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from megatron_worker import config
from spade_mega.megatron import Trainer

print("SAVED", Trainer(config([])).save({str(tmp_path / "ckpt")!r}), flush=True)
""")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=worker_env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert find_latest(tmp_path / "ckpt") == tmp_path / "ckpt" / "step_00000000"
    assert proc.stdout.count("SAVED") == 1  # the script ran once


def test_a_save_never_deletes_a_step_folder_it_did_not_write(tmp_path: Path) -> None:
    """A step_<N> folder without a manifest (a copy still arriving, another tool's output) is not a checkpoint this
    code wrote; a save of step N used to set it aside and delete it. Refused, naming it, before anything is written."""
    foreign = tmp_path / "init" / "step_00000000"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    proc = subprocess.run(worker_command(1, "reference", tmp_path), capture_output=True, text=True,
                          env=worker_env(), timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "CheckpointError: " in last and str(foreign) in last and "not a complete checkpoint" in last, last
    assert (foreign / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (tmp_path / "init").iterdir()) == ["step_00000000"]  # no partial folder either
