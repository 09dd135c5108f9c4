"""Fingerprints for duplicate detection and similarity: shingles, MinHash signatures, normalised program ASTs.

One mechanism serves three users: the corpus (near-duplicate documents), the environment memory (near-duplicate
programs at millions of rows, through LSH band keys) and the diversity metrics (a similarity kernel over programs).
Everything here is deterministic across processes (crc32 / blake2b, never Python's salted ``hash``), because
duplicate decisions must not change when a run resumes.
"""

from __future__ import annotations

import ast
import hashlib
import re
import warnings
import zlib
from dataclasses import dataclass

import numpy as np

_WORD = re.compile(r"\w+|[^\w\s]", re.UNICODE)
# Names the environment contract fixes: renaming them would hide the structure that matters.
_CONTRACT_NAMES = frozenset({"self", "reset", "step", "max_turns", "seed", "action", "__init__"})


def tokens(text: str) -> list[str]:
    """Words and punctuation, lower-cased."""
    return _WORD.findall(text.lower())


def shingles(toks: list[str], k: int = 5) -> np.ndarray:
    """The set of k-token shingles as sorted unique uint32 hashes (crc32); a text shorter than k is one shingle."""
    if not toks:
        return np.empty(0, dtype=np.uint32)
    if len(toks) < k:
        grams = [" ".join(toks)]
    else:
        grams = [" ".join(toks[i:i + k]) for i in range(len(toks) - k + 1)]
    return np.unique(np.fromiter((zlib.crc32(g.encode("utf-8")) for g in grams), dtype=np.uint32, count=len(grams)))


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard similarity of two shingle sets (1.0 for two empty sets)."""
    if a.size == 0 and b.size == 0:
        return 1.0
    inter = np.intersect1d(a, b, assume_unique=True).size
    return inter / (a.size + b.size - inter)


class MinHasher:
    """MinHash signatures (``num_perm`` multiply-shift hashes: the high 32 bits of a*x + b mod 2^64) and LSH band keys.

    The estimated similarity (fraction of equal signature slots) is an average of equality kernels, hence a valid
    positive semi-definite kernel as well as an unbiased Jaccard estimate.
    """

    def __init__(self, num_perm: int = 64, bands: int = 8, seed: int = 1) -> None:
        if num_perm % bands:
            raise ValueError(f"bands ({bands}) must divide num_perm ({num_perm})")
        rng = np.random.default_rng(seed)
        self.num_perm, self.bands = num_perm, bands
        self._a = rng.integers(0, 1 << 63, size=num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)  # odd
        self._b = rng.integers(0, 1 << 63, size=num_perm, dtype=np.uint64)

    def signature(self, hashes: np.ndarray) -> np.ndarray:
        if hashes.size == 0:
            return np.full(self.num_perm, np.iinfo(np.uint32).max, dtype=np.uint32)
        with np.errstate(over="ignore"):  # wrapping mod 2^64 is the point
            mixed = self._a[:, None] * hashes.astype(np.uint64)[None, :] + self._b[:, None]
        return (mixed >> np.uint64(32)).min(axis=1).astype(np.uint32)

    @staticmethod
    def similarity(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.mean(a == b))

    def band_keys(self, signature: np.ndarray) -> list[int]:
        """One signed 64-bit key per band (SQLite INTEGER): equal keys mark candidate near-duplicates."""
        rows = self.num_perm // self.bands
        keys = []
        for band in range(self.bands):
            digest = hashlib.blake2b(signature[band * rows:(band + 1) * rows].tobytes(), digest_size=8,
                                     person=band.to_bytes(2, "little")).digest()
            keys.append(int.from_bytes(digest, "little", signed=True))
        return keys


def _canonicalise(tree: ast.Module) -> ast.Module:
    """Rename every identifier the program defines to v0, v1, ... (order of first definition), drop docstrings and
    annotations, in place; one pass of ``ast.walk`` (a NodeTransformer is several times slower)."""
    names = {name: f"v{i}" for i, name in enumerate(_defined_names(tree))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            node.id = names.get(node.id, node.id)
        elif isinstance(node, ast.Attribute):
            node.attr = names.get(node.attr, node.attr)
        elif isinstance(node, ast.arg):
            node.arg, node.annotation = names.get(node.arg, node.arg), None
        elif isinstance(node, ast.AnnAssign):
            node.annotation = ast.Constant(None)
        elif isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
            if not isinstance(node, ast.Module):
                node.name = names.get(node.name, node.name)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                node.returns = None
    return tree


def _defined_names(tree: ast.AST) -> list[str]:
    seen: dict[str, None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            name = node.id
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            name = node.attr
        elif isinstance(node, ast.arg):
            name = node.arg
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = node.name
        else:
            continue
        if name not in _CONTRACT_NAMES:
            seen.setdefault(name, None)
    return list(seen)


@dataclass(frozen=True)
class ProgramFingerprint:
    """``ast_hash``: equal for programs that differ only in names, comments, docstrings, annotations or layout
    (None when the source does not parse); ``shingles``: token 5-grams of the normalised program for similarity."""

    ast_hash: str | None
    shingles: np.ndarray


def program_fingerprint(source: str) -> ProgramFingerprint:
    """Fingerprint a program's *text* (``ast.parse`` only: nothing is executed)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(source)
        normalised = ast.unparse(_canonicalise(tree))  # a canonical rendering: equal trees, equal text
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return ProgramFingerprint(None, shingles(tokens(source)))
    return ProgramFingerprint(hashlib.sha256(normalised.encode("utf-8")).hexdigest(), shingles(tokens(normalised)))
