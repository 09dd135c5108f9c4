"""Diversity and curriculum metrics: is the designer still inventing, and are its environments learnable?

- Vendi score (Friedman & Dieng): exp of the Shannon entropy of the eigenvalues of K/n, for a similarity kernel K
  with unit diagonal. n identical items score 1, n mutually orthogonal items score n; Vendi/n is in (0, 1]. SPADE
  reports Vendi/n 0.68 with corpus grounding and 0.04 without. Our kernel on programs is the exact Jaccard
  similarity of normalised-program token 5-gram sets (a positive semi-definite kernel), so renamed copies count as
  copies.
- Duplicate rate: programs whose normalised AST, or whose similarity to an earlier program, makes them a copy.
- Learnable fraction: agent win rate strictly between 0 and 1; positive-regret fraction: the hint helps.
- Difficulty buckets of the agent's (no-hint) win rate: easy > 0.8, hard < 0.2, medium otherwise.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from spade_mega.curriculum.fingerprint import ProgramFingerprint, jaccard, program_fingerprint

EASY_ABOVE = 0.8
HARD_BELOW = 0.2


def vendi_score(kernel: np.ndarray) -> float:
    """Vendi score of a symmetric similarity matrix with ones on the diagonal (order 1: Shannon entropy)."""
    k = np.asarray(kernel, dtype=np.float64)
    n = k.shape[0]
    if k.ndim != 2 or k.shape[1] != n:
        raise ValueError(f"kernel must be a square matrix, got shape {k.shape}")
    if n == 0:
        return 0.0
    eig = np.clip(np.linalg.eigvalsh(k / n), 0.0, None)
    eig = eig[eig > 1e-12]
    return float(np.exp(-np.sum(eig * np.log(eig))))


def program_kernel(programs: Sequence[str | ProgramFingerprint]) -> np.ndarray:
    """Pairwise Jaccard similarity of programs (sources or precomputed fingerprints)."""
    fps = [p if isinstance(p, ProgramFingerprint) else program_fingerprint(p) for p in programs]
    n = len(fps)
    k = np.eye(n)
    for i in range(n):
        for j in range(i + 1, n):
            k[i, j] = k[j, i] = jaccard(fps[i].shingles, fps[j].shingles)
    return k


def duplicate_rate(programs: Sequence[str | ProgramFingerprint], threshold: float = 0.9) -> float:
    """Fraction of programs that copy an earlier one in the sequence (same normalised AST or similarity >= threshold)."""
    fps = [p if isinstance(p, ProgramFingerprint) else program_fingerprint(p) for p in programs]
    if not fps:
        return 0.0
    copies = 0
    for i, fp in enumerate(fps):
        if any((fp.ast_hash is not None and fp.ast_hash == other.ast_hash)
               or jaccard(fp.shingles, other.shingles) >= threshold for other in fps[:i]):
            copies += 1
    return copies / len(fps)


def difficulty_bucket(win_rate: float) -> str:
    if win_rate > EASY_ABOVE:
        return "easy"
    return "hard" if win_rate < HARD_BELOW else "medium"


def diversity_metrics(programs: Sequence[str], threshold: float = 0.9) -> dict[str, float]:
    """Vendi score, Vendi/n and duplicate rate of one batch of programs."""
    fps = [program_fingerprint(p) for p in programs]
    vendi = vendi_score(program_kernel(fps))
    return {"vendi": vendi, "vendi_per_n": vendi / len(fps) if fps else 0.0,
            "duplicate_rate": duplicate_rate(fps, threshold)}


def curriculum_metrics(win_rates: Sequence[float], win_rates_hint: Sequence[float]) -> dict[str, float]:
    """Learnable and positive-regret fractions, and the difficulty buckets, of one batch of played environments."""
    if len(win_rates) != len(win_rates_hint):
        raise ValueError(f"{len(win_rates)} win rates but {len(win_rates_hint)} hint win rates")
    n = len(win_rates)
    if n == 0:
        return {"learnable_fraction": 0.0, "positive_regret_fraction": 0.0, "easy": 0.0, "medium": 0.0, "hard": 0.0}
    w, h = np.asarray(win_rates, dtype=np.float64), np.asarray(win_rates_hint, dtype=np.float64)
    buckets = [difficulty_bucket(x) for x in w]
    return {
        "learnable_fraction": float(np.mean((w > 0) & (w < 1))),
        "positive_regret_fraction": float(np.mean(h - w > 0)),
        **{b: buckets.count(b) / n for b in ("easy", "medium", "hard")},
    }
