"""Progress of long work (the steps of a run, the programs of a validation): a rich bar on a terminal, plain lines
otherwise.

The bar shows done/total, elapsed time, ETA and the latest value of a few chosen metrics. When ``logging.progress`` is
false or the stream is not a terminal (a SLURM log, a pipe), it prints one line every ``logging.log_interval`` units
and at the end instead, so logs stay readable. Only the writing rank (0 by default) prints.
"""

from __future__ import annotations

import math
import sys
import time
from types import TracebackType
from typing import Any, Mapping, Optional, Sequence, TextIO

from spade_mega.config.schema import LoggingConfig
from spade_mega.monitor.metrics import current_rank


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _value(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


class RunProgress:
    """``with RunProgress(total, "steps", cfg=cfg.logging, start=resume_step) as bar: bar.update(step, metrics)``.

    ``update(done, metrics)`` sets the count (a step number), ``advance(n, metrics)`` adds to it (programs
    validated); ``metrics`` may hold any names, those in ``fields`` (default ``logging.progress_metrics``) are shown
    with their latest value. ``start`` is where a resumed run begins: the ETA counts only what this process did.
    """

    def __init__(self, total: int, description: str = "steps", *, cfg: Optional[LoggingConfig] = None,
                 fields: Optional[Sequence[str]] = None, start: int = 0, stream: Optional[TextIO] = None,
                 rank: Optional[int] = None, writer_rank: int = 0) -> None:
        cfg = cfg or LoggingConfig()
        self.total, self.description, self.start = total, description, start
        self.done = start
        self.fields = list(cfg.progress_metrics if fields is None else fields)
        self.interval = cfg.log_interval
        self.active = (current_rank() if rank is None else rank) == writer_rank
        self._stream = stream if stream is not None else sys.stdout
        self._latest: dict[str, float] = {}
        self._began = time.monotonic()
        self._bar: Any = None
        self._task: Any = None
        if self.active and cfg.progress and self._stream.isatty():
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)
            from rich.table import Column

            # on a narrow terminal the metrics give way (cut with an ellipsis), never the count or the times
            shown = TextColumn("{task.fields[shown]}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis"))
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), shown,
                                 console=Console(file=self._stream), expand=True)
            self._task = self._bar.add_task(description, total=total, completed=start, shown="")
            self._bar.start()

    def _shown(self) -> str:
        return "  ".join(f"{name} {_value(self._latest[name])}" for name in self.fields if name in self._latest)

    def _eta(self) -> str:
        rate = (self.done - self.start) / max(time.monotonic() - self._began, 1e-9)
        return _duration((self.total - self.done) / rate) if rate > 0 else "?"

    def update(self, done: int, metrics: Optional[Mapping[str, Any]] = None) -> None:
        if not self.active:
            return
        previous, self.done = self.done, done
        for name in self.fields:
            if metrics is not None and name in metrics:
                self._latest[name] = float(metrics[name])
        if self._bar is not None:
            self._bar.update(self._task, completed=done, shown=self._shown())
        elif done // self.interval > previous // self.interval or (done >= self.total > previous):
            elapsed = _duration(time.monotonic() - self._began)
            percent = 100.0 * done / self.total if self.total else 100.0
            shown = self._shown()
            print(f"{self.description} {done}/{self.total} ({percent:.0f}%) | {elapsed} elapsed, eta {self._eta()}"
                  + (f" | {shown}" if shown else ""), file=self._stream, flush=True)

    def advance(self, n: int = 1, metrics: Optional[Mapping[str, Any]] = None) -> None:
        self.update(self.done + n, metrics)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> "RunProgress":
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close()
