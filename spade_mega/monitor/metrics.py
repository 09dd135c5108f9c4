"""``MetricsLogger``: one call per step from every rank; the writing rank sends each record to its sinks.

Sinks (each switched by the ``logging`` config): ``metrics.jsonl`` in the run directory (flushed after every record,
so a crash loses at most the record being written), TensorBoard event files under ``run_dir/tensorboard`` and a
Weights & Biases run (``logging.wandb``, see wandb_sink.py).

Resume: a run continued from the checkpoint of step S keeps the records up to S. Records after S (written by the
interrupted run after its last checkpoint) and lines that do not parse are moved, verbatim, to a side file
``metrics.aside-<k>.jsonl``, and TensorBoard is told to hide events from step S+1 on (``purge_step``), so neither shows
two interleaved curves. A new run (no ``resume_step``) in a directory that holds metrics sets all of them aside.

One writer per run directory: the writing rank holds an advisory lock (``flock``) on the directory while its logger is
open, so a second launch of the same run refuses to start instead of setting aside (replacing) the file the first is
still appending to. Where the file system refuses ``flock``, the run goes on unlocked, said in the log.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import sys
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import Mapping, Optional, Protocol

from spade_mega.config.schema import LoggingConfig
from spade_mega.monitor.gpu import GpuStats
from spade_mega.monitor.records import METRICS_FILE, MetricError, check_name, encode_record, scan, to_number
from spade_mega.monitor.wandb_sink import WandbSink, wandb_wanted

log = logging.getLogger("spade_mega.monitor")
TENSORBOARD_DIR = "tensorboard"


def current_rank() -> int:
    """This process's global rank: torch.distributed's when it is initialised, else ``$RANK``, else 0."""
    dist = sys.modules.get("torch.distributed")  # never import torch just to learn that it was not started
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0"))


class Sink(Protocol):
    def write(self, step: int, wall_time: float, metrics: Mapping[str, float | int]) -> None: ...

    def close(self, failed: bool = False) -> None: ...  # failed: the run ends by an error (W&B marks its run failed)


def _aside_path(path: Path) -> Path:
    k = 1
    while (target := path.with_name(f"{path.stem}.aside-{k}{path.suffix}")).exists():
        k += 1
    return target


def _lock_run_dir(run_dir: Path) -> Optional[int]:
    """An exclusive ``flock`` on the run directory (released when the fd closes or the process dies, even by kill
    -9); None where the file system has no ``flock``."""
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise MetricError(f"{run_dir}: another process is logging this run's metrics (the same run launched "
                              "twice, or a job requeued while the old one still runs); stop it first, or give "
                              "this run another run.name") from None
        log.info("%s: cannot lock the run directory (%s); a second launch of this run would not be detected",
                 run_dir, exc)
        return None
    return fd


class JsonlSink:
    """Appends one line per record to ``metrics.jsonl``, flushing each."""

    def __init__(self, path: Path, resume_step: Optional[int]) -> None:
        self.path = path
        self.last_step: Optional[int] = None
        if path.exists():
            self._set_aside(resume_step)
        self._file = open(path, "a", encoding="utf-8")

    def _set_aside(self, resume_step: Optional[int]) -> None:
        keep, aside = [], []
        for line in scan(self.path):
            fits = line.record is not None and resume_step is not None and line.record.step <= resume_step
            (keep if fits else aside).append(line)
        if keep:
            self.last_step = max(line.record.step for line in keep)  # type: ignore[union-attr]
        if not aside:
            if not self.path.read_bytes().endswith(b"\n") and keep:  # a whole last record, only its newline lost
                with open(self.path, "ab") as f:
                    f.write(b"\n")
            return
        # the side file is complete before the main file loses anything: a crash in between duplicates, never loses
        target = _aside_path(self.path)
        _write_lines(target, [line.raw for line in aside])
        tmp = self.path.with_name(self.path.name + ".tmp")
        _write_lines(tmp, [line.raw for line in keep])
        tmp.replace(self.path)
        why = "a new run" if resume_step is None else f"resuming from step {resume_step}"
        log.info("%s: %s; %d later or unreadable record(s) moved to %s", self.path, why, len(aside), target.name)

    def write(self, step: int, wall_time: float, metrics: Mapping[str, float | int]) -> None:
        self._file.write(encode_record(step, wall_time, metrics) + "\n")
        self._file.flush()

    def close(self, failed: bool = False) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()


def _write_lines(path: Path, lines: list[bytes]) -> None:
    with open(path, "wb") as f:
        f.write(b"".join(raw.rstrip(b"\n") + b"\n" for raw in lines))
        f.flush()
        os.fsync(f.fileno())


class TensorBoardSink:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter``, flushed after each record."""

    def __init__(self, log_dir: Path, resume_step: Optional[int]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        earlier = log_dir.is_dir() and any(log_dir.glob("events.out.tfevents.*"))
        purge_step = (0 if resume_step is None else resume_step + 1) if earlier else None
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step, flush_secs=30)

    def write(self, step: int, wall_time: float, metrics: Mapping[str, float | int]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step, walltime=wall_time)
        self._writer.flush()

    def close(self, failed: bool = False) -> None:
        self._writer.close()


class MetricsLogger:
    """Logs metrics of a run from every rank; only ``writer_rank`` (default 0) writes, the others only check.

    ``log(step, metrics)`` writes one record; ``commit=False`` gathers metrics of a step from several calls into one
    record, written by the next committing call (or by a call for another step, or by ``close``). ``prefix`` names
    the group of unprefixed metrics (``prefix="train"``: ``loss`` becomes ``train/loss``). Steps may repeat but never
    go back: that would draw a second curve over the first (resume from a checkpoint with ``resume_step`` instead).
    With ``logging.gpu_stats``, every record also carries the node's ``gpu/<i>/...`` stats. ``run_config`` (the
    resolved config as a dict) is attached to the W&B run.
    """

    def __init__(self, run_dir: str | Path, cfg: Optional[LoggingConfig] = None, *,
                 resume_step: Optional[int] = None, rank: Optional[int] = None, writer_rank: int = 0,
                 run_config: Optional[Mapping[str, object]] = None) -> None:
        cfg = cfg or LoggingConfig()
        if resume_step is not None and (type(resume_step) is not int or resume_step < 0):
            raise MetricError(f"resume_step must be a checkpoint's step (an int >= 0), got {resume_step!r}")
        self.run_dir = Path(run_dir)
        self.active = (current_rank() if rank is None else rank) == writer_rank
        self._sinks: list[Sink] = []
        self._gpu: Optional[GpuStats] = None
        self._last_step: Optional[int] = None
        self._pending_step: Optional[int] = None
        self._pending: dict[str, float | int] = {}
        self._unlock: Optional[weakref.finalize] = None
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        lock = _lock_run_dir(self.run_dir)
        self._unlock = weakref.finalize(self, os.close, lock) if lock is not None else None
        try:
            if cfg.jsonl:
                jsonl = JsonlSink(self.run_dir / METRICS_FILE, resume_step)
                self._last_step = jsonl.last_step
                self._sinks.append(jsonl)
            if cfg.tensorboard:
                self._sinks.append(TensorBoardSink(self.run_dir / TENSORBOARD_DIR, resume_step))
            if wandb_wanted(cfg.wandb):
                self._sinks.append(WandbSink(self.run_dir, cfg.wandb, resume_step, run_config))
        except BaseException:
            self.close()  # a sink that failed to start leaves the directory unlocked for the next try
            raise
        if cfg.gpu_stats:
            self._gpu = GpuStats()

    def log(self, step: int, metrics: Mapping[str, object], *, prefix: str = "", commit: bool = True) -> None:
        """Every rank checks the step, names and values (a bad metric fails all ranks alike, rather than rank 0
        alone while the others wait in their next collective); only the writing rank writes."""
        if type(step) is not int or step < 0:
            raise MetricError(f"step must be an int >= 0, got {step!r}")
        floor = self._last_step if self._pending_step is None else self._pending_step
        if floor is not None and step < floor:
            raise MetricError(f"step {step} is before step {floor}, already logged; steps never go back "
                              "(resuming from a checkpoint? pass its step as resume_step)")
        values = {}
        for key, value in metrics.items():
            name = check_name(f"{prefix}/{key}" if prefix else key)
            values[name] = to_number(name, value)
        if not self.active:
            self._last_step = step
            return
        if self._pending_step is not None and step != self._pending_step:
            self.commit()
        self._pending_step = step
        self._pending.update(values)
        if commit:
            self.commit()

    def commit(self) -> None:
        """Write the gathered metrics of the pending step as one record (nothing if none are pending)."""
        if self._pending_step is None:
            return
        step, metrics = self._pending_step, self._pending
        self._pending_step, self._pending = None, {}
        if self._gpu is not None:
            metrics.update(self._gpu.sample())
        wall_time = time.time()
        for sink in self._sinks:
            sink.write(step, wall_time, metrics)
        self._last_step = step

    def close(self, failed: bool = False) -> None:
        """Write what is pending and close the sinks; ``failed`` (the ``with`` block raised) tells W&B the run failed,
        which it would otherwise show as finished."""
        try:
            self.commit()
        finally:
            for sink in self._sinks:
                sink.close(failed)
            self._sinks = []
            if self._gpu is not None:
                self._gpu.close()
            if self._unlock is not None:
                self._unlock()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close(failed=exc_type is not None)
