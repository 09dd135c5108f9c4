"""Console logging of a run from ``logging.level``: the writing rank at that level, the others only warnings."""

from __future__ import annotations

import logging
import sys
from typing import Optional

from spade_mega.config.schema import LoggingConfig
from spade_mega.monitor.metrics import current_rank


def setup_logging(cfg: LoggingConfig, *, rank: Optional[int] = None, writer_rank: int = 0) -> logging.Logger:
    """Configure the ``spade_mega`` logger (idempotent: calling it again replaces its handler, never adds one)."""
    rank = current_rank() if rank is None else rank
    logger = logging.getLogger("spade_mega")
    logger.setLevel(getattr(logging, cfg.level.upper()) if rank == writer_rank else logging.WARNING)
    for handler in [h for h in logger.handlers if getattr(h, "_spade_console", False)]:
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s",
                                           "%H:%M:%S"))
    handler._spade_console = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    return logger
