"""The keys and values of recently finished sequences, so that the next turn of a conversation prefills only its new
tokens.

An agent episode's turn ``t + 1`` prompts with turn ``t``'s prompt, its completion and the new observation; without
reuse the engine prefills the whole conversation at every turn (the CPU demo: ~700k prompt tokens for ~24k generated).
:class:`PrefixCache` keeps, per finished sequence, the per-layer keys and values of its tokens (rotary positions
0..n-1 baked in, so they are valid for any prompt that starts with the same ids) and finds, for a new prompt, the
cached sequence sharing the longest prefix with it, also when the prompt diverges part way (a shared system prompt).

Lookup goes through a chain hash over blocks of ``block`` tokens (block ``k``'s hash covers every token before its
end), so a prompt is matched against all entries in time linear in its length; the candidates found are then compared
token by token, which keeps a hash collision from ever reusing the wrong keys. The cache is bounded by bytes and
evicts the least recently used entries; entries are only valid for the weights that computed them, so the engine
clears it on every weight update.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]  # keys, values of one layer: [kv heads, tokens, head dim]


@dataclass
class CachedSequence:
    """One finished sequence: its token ids and each layer's keys and values for them."""

    key: int
    ids: np.ndarray  # int64 [tokens]
    layers: list[LayerKV]
    nbytes: int
    hashes: list[int] = field(default_factory=list)  # chain hash at the end of each whole block


@dataclass
class PrefixCacheStats:
    """What the cache saved: ``reused_tokens`` of ``prompt_tokens`` came from it instead of a prefill, of which
    ``shared_tokens`` were forwarded into it by the same call (a start its prompts share, forwarded once): the prefill
    saved is ``reused_tokens - shared_tokens``."""

    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    shared_tokens: int = 0
    evictions: int = 0


class PrefixCache:
    """Finished sequences' keys and values within ``budget_bytes``, least recently used first out."""

    def __init__(self, budget_bytes: int, *, block: int = 16) -> None:
        if budget_bytes < 1 or block < 1:
            raise ValueError(f"PrefixCache needs budget_bytes >= 1 and block >= 1, got {budget_bytes}, {block}")
        self.budget_bytes, self.block = budget_bytes, block
        self._entries: OrderedDict[int, CachedSequence] = OrderedDict()  # oldest use first
        self._index: dict[int, set[int]] = {}  # chain hash -> entries holding that prefix
        self._next_key = 0
        self.nbytes = 0
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def _chain(self, ids: Sequence[int]) -> list[int]:
        """The chain hash at the end of each whole block of ``ids``."""
        hashes, h = [], 0
        for end in range(self.block, len(ids) + 1, self.block):
            h = hash((h, tuple(ids[end - self.block:end])))
            hashes.append(h)
        return hashes

    def match(self, prompt: Sequence[int]) -> tuple[Optional[CachedSequence], int]:
        """The entry sharing the longest prefix with ``prompt`` (at least one block) and that prefix's length, at
        most ``len(prompt) - 1`` (the last prompt token is always forwarded: its logits start the completion);
        ``(None, 0)`` when none does. A hit counts as a use for the eviction order."""
        found, n = self.peek(prompt)
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(prompt)
        if found is not None:
            self._entries.move_to_end(found.key)
            self.stats.hits += 1
            self.stats.reused_tokens += n
        return found, n

    def peek(self, prompt: Sequence[int]) -> tuple[Optional[CachedSequence], int]:
        """What :meth:`match` finds, without counting it as a use."""
        chain = self._chain(prompt[:len(prompt) - 1])
        for level in range(len(chain) - 1, -1, -1):
            keys = self._index.get(chain[level])
            if not keys:
                continue
            ids = np.asarray(prompt[:len(prompt) - 1], dtype=np.int64)
            found, best = None, 0
            for key in keys:  # exact comparison: a hash collision must never reuse another sequence's keys
                n = common_prefix(ids, self._entries[key].ids)
                if n > best:
                    found, best = self._entries[key], n
            if found is None or best < self.block:
                return None, 0
            return found, best
        return None, 0

    def store(self, ids: Sequence[int], layers: list[LayerKV], *, replaces: Optional[CachedSequence] = None) -> None:
        """Keep ``layers`` (the keys and values of ``ids``, owned by the cache from now on), evicting the least
        recently used entries to stay within the budget. ``replaces`` (the entry this sequence's prompt reused) is
        dropped when it is a prefix of ``ids``: every lookup it could serve, the new entry serves as well. A sequence
        shorter than a block, or larger than the whole budget, is not kept."""
        if any(k.shape[1] != len(ids) or v.shape[1] != len(ids) for k, v in layers):
            raise ValueError(f"PrefixCache.store: keys and values for {[k.shape[1] for k, _ in layers]} tokens given "
                             f"for a sequence of {len(ids)}")
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if not self.keeps(len(ids), nbytes):
            return
        array = np.asarray(ids, dtype=np.int64)
        if replaces is not None and len(replaces.ids) <= len(array) and \
                common_prefix(array, replaces.ids) == len(replaces.ids):
            self._remove(replaces.key)
        while self.nbytes + nbytes > self.budget_bytes:
            self._remove(next(iter(self._entries)))
            self.stats.evictions += 1
        entry = CachedSequence(self._next_key, array, layers, nbytes, self._chain(ids))
        self._next_key += 1
        self._entries[entry.key] = entry
        for h in entry.hashes:
            self._index.setdefault(h, set()).add(entry.key)
        self.nbytes += nbytes

    def keeps(self, tokens: int, nbytes: int) -> bool:
        """Whether :meth:`store` would keep a sequence of ``tokens`` tokens whose keys and values take ``nbytes``
        (asked before copying them out of a batch: a long answer's can be gigabytes)."""
        return tokens >= self.block and nbytes <= self.budget_bytes

    def _remove(self, key: int) -> None:
        if key not in self._entries:  # already evicted
            return
        entry = self._entries.pop(key)
        for h in entry.hashes:
            holders = self._index[h]
            holders.discard(key)
            if not holders:
                del self._index[h]
        self.nbytes -= entry.nbytes

    def clear(self) -> None:
        """Drop every entry (new weights make every cached key and value stale)."""
        self._entries.clear()
        self._index.clear()
        self.nbytes = 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` share from their start."""
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
