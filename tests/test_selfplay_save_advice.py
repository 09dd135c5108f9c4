"""A save that fails stops the run with an error saying what to do for its cause, on every rank: the advice of
SelfPlay._saving (what the run keeps, what to fix, the checkpoint a rerun resumes from)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spade_mega.config.loader import load_config
from spade_mega.megatron.checkpoint import CheckpointError
from spade_mega.monitor import MetricsLogger
from spade_mega.selfplay.loop import SelfPlay

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"

FULL_DISK = "cannot write the loop state of this checkpoint ([Errno 28] No space left on device)"
# the causes that free disk space does not cure: the background writer killed by the OOM killer (checkpoint.py's
# _writer_failure), a rank's staging of its tensors in host memory refused (the planning's agreed failure)
OUT_OF_MEMORY = {
    "writer_killed": "step_000002: the background write of this checkpoint failed (rank 1: its background writer "
                     "(pid 4242) was killed by SIGKILL: the kernel's OOM killer, unless someone sent it (see "
                     "dmesg)); the previous checkpoint stays the newest",
    "staging": "step_000002: preparing this checkpoint's files failed (rank 1: MemoryError: ); nothing was written, "
               "no earlier checkpoint was removed",
}


def _saving_fails_with(tmp_path: Path, failure: str) -> tuple[str, Path]:
    """The error of a save failing with ``failure`` at rollout 2 of a new run, and the run's checkpoint folder."""
    loop = SelfPlay(load_config(TINY, [f"run.output_dir={tmp_path}"]))
    metrics = MetricsLogger(loop.run_dir, loop.cfg.logging)
    try:
        with pytest.raises(CheckpointError) as failed:
            with loop._saving(metrics, 2, {"train/loss": 1.0}):
                raise CheckpointError(failure)
    finally:
        metrics.close()
    return str(failed.value), loop.store.root


@pytest.mark.parametrize("cause", sorted(OUT_OF_MEMORY))
def test_a_save_that_ran_out_of_host_memory_says_to_free_memory_not_disk_space(tmp_path: Path, cause: str) -> None:
    message, _ = _saving_fails_with(tmp_path, OUT_OF_MEMORY[cause])
    assert "Free space" not in message and "writable" not in message, message
    assert "host memory" in message and "selfplay.async_save" in message, message
    assert "run the same command again: it starts over (no checkpoint completed)" in message, message


def test_a_save_that_filled_the_disk_says_to_free_space(tmp_path: Path) -> None:
    message, root = _saving_fails_with(tmp_path, FULL_DISK)
    assert f"Free space on {root} (or make it writable) and run the same command again: it starts over" in message, \
        message
    assert "host memory" not in message, message


SAVE_ON_TWO_RANKS = """
import datetime, sys
import torch.distributed as dist
rank, init, config, out, failure = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
from spade_mega.config.loader import load_config
from spade_mega.megatron.checkpoint import CheckpointError
from spade_mega.monitor import MetricsLogger
from spade_mega.selfplay import loop

cfg = load_config(config, [f"run.output_dir={out}"])
run = loop.SelfPlay(cfg)
metrics = MetricsLogger(run.run_dir, cfg.logging)


def write_loop_state():  # rank 0's part of the save (the loop state) fails
    raise CheckpointError(failure)


try:
    with run._saving(metrics, 1, {}):
        loop._from_rank0(write_loop_state, share=False)
except CheckpointError as exc:
    print(f"{type(exc).__name__}: {exc}", flush=True)
    from spade_mega.megatron import parallel
    parallel.shutdown()  # as the CLI leaves: gloo's teardown at exit can abort a rank whose peer has gone
    sys.exit(2)
"""


@pytest.mark.multiproc
def test_every_rank_of_a_save_whose_loop_state_cannot_be_written_says_how_to_go_on(tmp_path: Path) -> None:
    """The loop state is rank 0's alone to write; the other ranks learn of its failure through _from_rank0. They
    stop with the same advice (free space, then the same command resumes from ...), not a bare 'rank 0 failed'."""
    from spade_mega.inference.server import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    ranks = [subprocess.Popen([sys.executable, "-c", SAVE_ON_TWO_RANKS, str(rank), init, str(TINY), str(tmp_path),
                               FULL_DISK], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                              env=env)
             for rank in (0, 1)]
    outputs = [proc.communicate(timeout=180)[0] for proc in ranks]
    assert [proc.returncode for proc in ranks] == [2, 2], outputs
    advice = "(or make it writable) and run the same command again: it starts over (no checkpoint completed)"
    assert FULL_DISK in outputs[0] and advice in outputs[0], outputs[0]
    assert f"rank 0 failed, so rank 1 stops too: CheckpointError: {FULL_DISK}" in outputs[1], outputs[1]
    assert advice in outputs[1], outputs[1]
