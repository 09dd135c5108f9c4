"""Per-request sampling parameters from the rollout config and the caller's seeds."""

from __future__ import annotations

import hashlib
from typing import Optional

from spade_mega.config.schema import RolloutConfig
from spade_mega.inference.base import SamplingParams


def derived_seed(seed: Optional[int], turn: int) -> Optional[int]:
    """The sampling seed of one turn: distinct per (seed, turn), stable across runs and Python versions, and below
    2**32 so every engine accepts it (numpy-style generators stop there)."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def sampling(cfg: RolloutConfig, max_new_tokens: int, *, hinted: bool, seed: Optional[int],
             stop_ids: tuple[int, ...]) -> SamplingParams:
    """Hint plays sample at ``rollout.hint_temperature``, everything else at ``rollout.temperature``."""
    return SamplingParams(max_new_tokens=max_new_tokens,
                          temperature=cfg.hint_temperature if hinted else cfg.temperature,
                          top_p=cfg.top_p, seed=seed, stop_token_ids=stop_ids)
