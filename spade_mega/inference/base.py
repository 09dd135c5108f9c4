"""The one interface every inference engine implements (hf in-process, vLLM server, SGLang server).

Engines speak token ids, not text: the rollout renders prompts with the run's tokenizer and keeps the exact ids the
trainer will see, so the behaviour log-probs an engine returns line up token for token with the trainer's. Weights
arrive under Hugging Face names (``model.layers.0.self_attn.q_proj.weight``), full (unsharded) tensors, in buckets
that the bridge streams; the engine never sees Megatron's layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Iterator, Literal, Mapping, Optional, Protocol, Sequence, runtime_checkable

import torch

from spade_mega.errors import SpadeError


class EngineError(SpadeError):
    """An engine cannot start, cannot serve a request, or refused a weight update."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion. ``temperature`` 0 is greedy; the returned log-probs are always those of the
    temperature-scaled distribution (greedy: temperature 1) before top-p truncation, which is what the trainer
    recomputes for truncated importance sampling."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    # the same seed, prompt and weights give the same completion; in bfloat16 only in the same batch (its kernels
    # are not batch-invariant, so the logits move with the batch a request is decoded in)
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()  # besides the engine's end-of-sequence token

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise EngineError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf:  # NaN too: it would surface as NaN logits, blaming the weights
            raise EngineError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise EngineError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams


@dataclass(frozen=True)
class Generation:
    """One completion. ``logprobs[i]`` is the behaviour log-prob of ``output_ids[i]``; ``finish_reason`` is "stop"
    when an end-of-sequence or stop token ended it (that token is included in ``output_ids``), "length" when it ran
    into ``max_new_tokens``. ``weight_version`` is the version of the weights that produced it."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: Literal["stop", "length"]
    weight_version: int


@dataclass(frozen=True)
class WeightStream:
    """Buckets of weights (Hugging Face names, full tensors) with every name and shape they will hold, in order,
    known before the first bucket is read: an engine that sends as it reads (over a process group) checks the whole
    update against its model before it sends anything. The bridge's export gives one."""

    manifest: tuple[tuple[str, tuple[int, ...]], ...]
    buckets: Iterable[Mapping[str, torch.Tensor]]

    def __iter__(self) -> Iterator[Mapping[str, torch.Tensor]]:
        return iter(self.buckets)


@runtime_checkable
class Engine(Protocol):
    """What the rollout and the bridge use of an engine."""

    @property
    def weight_version(self) -> int:
        """The version of the weights now served (0 until the first update)."""
        ...

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Completions of ``requests``, in order. Engines batch internally; callers pass all they have."""
        ...

    def update_weights(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> None:
        """Load new weights, bucket by bucket (Hugging Face names, full tensors), then serve ``version``. A name the
        model does not have, or a shape that differs, raises :class:`EngineError` before anything is served."""
        ...

    def close(self) -> None:
        """Release the engine (stop its server, free its memory). Idempotent."""
        ...


MemoryTag = Literal["weights", "kv_cache"]
MEMORY_TAGS: tuple[MemoryTag, ...] = ("weights", "kv_cache")  # the order a released engine takes them back in


@runtime_checkable
class MemoryReleasing(Protocol):
    """What an engine whose servers share the trainer's GPUs (``launch.engine_placement`` colocated) adds: it hands
    their GPU memory back while the trainer steps, and takes it back tag by tag around the weight sync (weights,
    the reload, then the KV cache: the reload needs the weights' memory, not yet the cache's). The in-process hf
    engine has no such part: it is the trainer's own process (on GPU, its memory is the trainer's to manage).

    ``releases_memory`` says whether this run uses it (``inference.release_memory``); an engine that does refuses
    to generate or reload while memory it needs is released."""

    releases_memory: bool

    def release_memory(self) -> None:
        """Free the weights' and the KV cache's GPU memory; their contents are gone (the next update reloads every
        weight, the cache refills)."""
        ...

    def resume_memory(self, tag: MemoryTag) -> None:
        """Take back the GPU memory of ``tag`` released by :meth:`release_memory` (nothing if it was not)."""
        ...


@runtime_checkable
class PrefixCaching(Protocol):
    """What an engine that keeps a prefix cache of its own in this process adds (the hf engine): emptying it. A
    caller whose results must not depend on earlier calls (the loop, around every rollout: a resumed run starts with
    an empty cache) asks for it; server engines keep theirs in the server, which promises no bitwise replay."""

    def clear_prefix_cache(self) -> None:
        """Forget every cached sequence (nothing if the engine caches none)."""
        ...
