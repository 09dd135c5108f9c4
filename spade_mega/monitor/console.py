"""Console logging of a run from ``logging.level``: the writing rank at that level, the others only warnings."""

from __future__ import annotations

import logging
import sys
from typing import Optional

from spade_mega.config.schema import LoggingConfig
from spade_mega.monitor.metrics import current_rank


class _StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is at each record: a progress bar redirects it while it shows, printing log
    lines above itself (a stream kept from setup time would write past the bar)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # type: ignore[no-untyped-def]
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def setup_logging(cfg: LoggingConfig, *, rank: Optional[int] = None, writer_rank: int = 0) -> logging.Logger:
    """Configure the ``spade_mega`` logger (idempotent: calling it again replaces its handler, never adds one)."""
    rank = current_rank() if rank is None else rank
    logger = logging.getLogger("spade_mega")
    logger.setLevel(getattr(logging, cfg.level.upper()) if rank == writer_rank else logging.WARNING)
    for handler in [h for h in logger.handlers if getattr(h, "_spade_console", False)]:
        logger.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s",
                                           "%H:%M:%S"))
    handler._spade_console = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    return logger
