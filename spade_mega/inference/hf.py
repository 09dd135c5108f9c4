"""The in-process Hugging Face engine: transformers' Qwen3 / Qwen3-MoE model driven by our own sampling loop.

It runs where the trainer runs (the CPU demo, rank 0), so it is lean: one model, a KV cache per batch, no server.
The sampling loop is ours rather than ``model.generate`` so that what is sampled and the log-probs returned are
exactly the distribution the trainer recomputes: ``log_softmax(logits / T)`` in float32, before top-p truncation.

Weights arrive in the Hugging Face *checkpoint* layout (what safetensors files, vLLM and SGLang use): one tensor per
expert projection, ``model.layers.L.mlp.experts.E.gate_proj.weight``. transformers >= 5 keeps the experts of a layer
fused (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]); the engine maps each checkpoint
name onto its slice of the fused parameter, so the bridge streams one format to every engine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer  # the engine runs transformers' models

from spade_mega.config.schema import ModelConfig, SpadeConfig
from spade_mega.inference.base import EngineError, Generation, GenerationRequest
from spade_mega.inference.prefix_cache import CachedSequence, LayerKV, PrefixCache, common_prefix
from spade_mega.megatron.providers import hf_config_dict, resolve_model_config

_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Entries of the [rows, 1, queries, columns] boolean mask of one prefill forward over cached prefixes: a longer
# suffix is forwarded in chunks of queries (SDPA on CPU copies the mask into a float one four times its size).
_MASK_ENTRIES = 1 << 24


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor lands: ``index`` of parameter ``param`` (``()`` = the whole parameter)."""

    param: str
    index: tuple


def resolve_device(device: str) -> torch.device:
    """``auto`` is CUDA when there is a GPU, else the CPU; ``cuda`` without a GPU is an error, not a silent CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise EngineError("inference.device is 'cuda' but torch sees no GPU; use 'auto' or 'cpu'")
    return torch.device(device)


def build_hf_model(model: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """transformers' model of ``model`` (random init), in eval mode: Qwen3MoeForCausalLM or Qwen3ForCausalLM.

    Built in ``dtype`` by transformers itself, which keeps the rotary frequencies float32 as Megatron does (a
    ``.to(bfloat16)`` rounded them, and the angles drifted with the position) and never holds a float32 copy.
    Attention is SDPA (torch's fused kernels; the engine hands it boolean masks)."""
    import transformers

    hf = hf_config_dict(model)
    hf.pop("torch_dtype")
    config_cls = transformers.Qwen3MoeConfig if hf["model_type"] == "qwen3_moe" else transformers.Qwen3Config
    with torch.device(device):
        net = transformers.AutoModelForCausalLM.from_config(config_cls(**hf), dtype=dtype, attn_implementation="sdpa")
    return net.eval().requires_grad_(False)


class HFEngine:
    """Batched sampling from a transformers model with a KV cache; weights pushed in by :meth:`update_weights`.

    ``eos_token_id`` ends a completion (the run tokenizer's ``<|im_end|>``), ``pad_token_id`` fills padding (never
    attended to). Requests are sorted by prompt length and run in chunks of ``max_batch_size``; a chunk's prompts are
    forwarded in buckets of ``prefill_tokens`` (padded) tokens at most (a longer prompt goes alone, whole), and its
    cache starts at twice the longest prompt and doubles when full (up to the prompt plus the most new tokens), with
    the rows still running: memory grows with batch x the tokens written, never with length squared nor with a
    ``max_new_tokens`` cap the completions do not reach. A request
    without a seed gets one from the engine's own generator (seeded by ``seed``), so a run is reproducible. Each
    request samples from its own generator, so in float32 its completion does not depend on the batch; in bfloat16
    the logits do, slightly (kernels are not batch-invariant), so a seeded sample can differ between batches.

    Finished sequences' keys and values stay in a :class:`PrefixCache` of ``prefix_cache_mb`` MiB (0: none), so a
    prompt that starts with one (the next turn of an agent episode: its prompt, completion and new observation)
    prefills only the tokens after it; a start that prompts of one call share (a GRPO group's first prompt) is
    forwarded once, into the cache. A weight update clears it: keys computed by other weights are stale."""

    def __init__(self, model: ModelConfig, *, eos_token_id: int, pad_token_id: Optional[int] = None,
                 device: str = "auto", dtype: str = "auto", max_batch_size: int = 64, seed: int = 0,
                 weights_path: Optional[str] = None, prefill_tokens: int = 16384,
                 prefix_cache_mb: float = 1024) -> None:
        for name, value in (("max_batch_size", max_batch_size), ("prefill_tokens", prefill_tokens)):
            if value < 1:
                raise EngineError(f"{name} must be >= 1, got {value}")
        if not 0 <= prefix_cache_mb < float("inf"):
            raise EngineError(f"prefix_cache_mb must be a finite number >= 0 (0: no prefix cache), got "
                              f"{prefix_cache_mb}")
        self.prefix_cache = PrefixCache(max(1, int(prefix_cache_mb * 2**20))) if prefix_cache_mb > 0 else None
        model = resolve_model_config(model)
        self.vocab_size = model.vocab_size
        self.max_positions = model.max_position_embeddings
        pad = eos_token_id if pad_token_id is None else pad_token_id
        for name, value in (("eos_token_id", eos_token_id), ("pad_token_id", pad)):
            if not 0 <= value < self.vocab_size:
                raise EngineError(f"{name} {value} is outside the model's vocabulary (model.vocab_size "
                                  f"{self.vocab_size}): the tokenizer does not fit the model")
        self.eos_token_id, self.pad_token_id = eos_token_id, pad
        self.max_batch_size, self.prefill_tokens = max_batch_size, prefill_tokens
        self.device = resolve_device(device)
        self.dtype = _DTYPES[model.params_dtype if dtype == "auto" else dtype]
        self.model: Optional[torch.nn.Module] = build_hf_model(model, dtype=self.dtype, device=self.device)
        self.tied = bool(model.tie_embeddings)
        self._targets = self._checkpoint_targets()
        self._seeds = torch.Generator().manual_seed(seed)
        self._version = 0
        self._inconsistent: Optional[str] = None  # why the weights cannot be served (a failed update), or None
        if weights_path is not None:
            self.update_weights(load_checkpoint_buckets(weights_path), version=0)

    # ------------------------------------------------------------------ weights
    def _checkpoint_targets(self) -> dict[str, _Target]:
        """Checkpoint name -> slice of a model parameter, for every tensor an update must (or may) carry."""
        targets: dict[str, _Target] = {}
        for name, param in self._params().items():
            fused = _FUSED_EXPERTS.match(name)
            if fused is None:
                targets[name] = _Target(name, ())
                continue
            prefix, kind = fused.groups()
            for e in range(param.shape[0]):
                if kind == "down_proj":
                    targets[f"{prefix}.{e}.down_proj.weight"] = _Target(name, (e,))
                else:
                    half = param.shape[1] // 2
                    targets[f"{prefix}.{e}.gate_proj.weight"] = _Target(name, (e, slice(0, half)))
                    targets[f"{prefix}.{e}.up_proj.weight"] = _Target(name, (e, slice(half, None)))
        return targets

    def _params(self) -> dict[str, torch.nn.Parameter]:
        # named_parameters lists a tied lm_head once, under model.embed_tokens.weight
        return dict(self._live_model().named_parameters())

    def _canonical(self, name: str) -> str:
        """The checkpoint name ``name`` stands for: a tied model's head is its embedding (checkpoints may carry both)."""
        if self.tied and name == "lm_head.weight":
            return "model.embed_tokens.weight"
        if name not in self._targets:
            raise EngineError(f"weight update: the model has no tensor {name!r} (expected Hugging Face checkpoint "
                              f"names such as {next(iter(self._targets))!r})")
        return name

    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint name a complete update must carry, with its shape (what the bridge must send)."""
        params = self._params()
        return {name: tuple(params[t.param][t.index].shape) for name, t in self._targets.items()}

    @property
    def weight_version(self) -> int:
        return self._version

    def update_weights(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> None:
        """Copy every bucket in after checking its names and shapes; serve ``version`` once every tensor came.

        A bucket is checked whole before any of it is copied. Once copying has begun the weights are a mix of two
        versions until the update completes, so a failure part way leaves the engine refusing to generate until a
        later update succeeds; the version advances only on success. The prefix cache is cleared first: whatever
        the outcome, the keys and values in it were computed by the weights being replaced."""
        params = self._params()
        self.clear_prefix_cache()
        missing = set(self._targets)
        started = False
        try:
            with torch.no_grad():
                for bucket in buckets:
                    checked = []
                    for name, tensor in bucket.items():
                        canonical = self._canonical(name)
                        target = self._targets[canonical]
                        view = params[target.param][target.index]
                        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                            raise EngineError(f"weight update: {name!r} must be a floating-point tensor, got "
                                              f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
                        if tuple(tensor.shape) != tuple(view.shape):
                            raise EngineError(f"weight update: {name!r} has shape {tuple(tensor.shape)}, the model's "
                                              f"is {tuple(view.shape)}")
                        checked.append((name, canonical, view, tensor))
                    for name, canonical, view, tensor in checked:
                        if name != canonical and canonical not in missing:
                            continue  # a tied head after its embedding: the embedding wins (what the bridge loads)
                        started = True
                        view.copy_(tensor)
                        missing.discard(canonical)
            if missing:
                shown = ", ".join(sorted(missing)[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                raise EngineError(f"weight update to version {version} is incomplete: no tensor for {shown}")
        except BaseException as exc:
            if started:
                self._inconsistent = (f"the weight update to version {version} failed part way ({exc}); the "
                                      f"engine's weights are inconsistent until a complete update succeeds")
            raise
        self._inconsistent = None
        self._version = version

    def clear_prefix_cache(self) -> None:
        """Forget every cached sequence. Besides new weights (stale keys), a caller whose results must not depend
        on earlier calls clears it: a prefix taken from the cache was computed in another forward (a longer sequence,
        another batch, decode steps), so its keys, and the log-probs after it, differ from a fresh prefill's in the
        last bits (the loop does at every rollout: a resumed run starts with an empty cache)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    # --------------------------------------------------------------- generation
    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Completions of ``requests`` in order; prompts of similar length are batched together."""
        self._live_model()
        if self._inconsistent is not None:
            raise EngineError(f"cannot generate: {self._inconsistent}")
        for i, request in enumerate(requests):
            self._check_request(i, request)
        seeds = [r.sampling.seed if r.sampling.seed is not None
                 else int(torch.randint(0, 2**62, (), generator=self._seeds)) for r in requests]
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        results: list[Optional[Generation]] = [None] * len(requests)
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start:start + self.max_batch_size]
            for i, generation in zip(chunk, self._generate_batch([requests[i] for i in chunk],
                                                                   [seeds[i] for i in chunk])):
                results[i] = generation
        return results  # type: ignore[return-value]

    def _check_request(self, i: int, request: GenerationRequest) -> None:
        prompt, sampling = request.prompt_ids, request.sampling
        if len(prompt) == 0:
            raise EngineError(f"request {i}: empty prompt (a completion needs at least one prompt token)")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(f"request {i}: prompt entries {bad[:5]} are not token ids of the vocabulary "
                              f"[0, {self.vocab_size}) (Python ints)")
        bad = [t for t in sampling.stop_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(f"request {i}: stop token ids {bad} are outside the vocabulary [0, {self.vocab_size}) "
                              "or are not token ids (Python ints)")
        if len(prompt) + sampling.max_new_tokens > self.max_positions:
            raise EngineError(f"request {i}: prompt ({len(prompt)} tokens) + max_new_tokens "
                              f"({sampling.max_new_tokens}) exceeds the model's max_position_embeddings "
                              f"({self.max_positions})")

    @torch.inference_mode()
    def _generate_batch(self, requests: Sequence[GenerationRequest], seeds: Sequence[int]) -> list[Generation]:
        """Prefill in buckets, then decode every row in lockstep over one preallocated cache.

        Each prompt's keys and values sit right-aligned before column ``width`` (the longest prompt), so every row
        writes its next token into the same column; the columns left of a shorter prompt are masked out. The cache
        is allocated for ``2 * width`` columns (at most ``width`` + the most new tokens) and reallocated at twice the
        size, for the rows still running, when it is full: a cap such as an evaluation's 30k new tokens is never
        allocated for rows that stop long before it, and the copies add up to less than the final size. A row leaving
        the batch leaves its keys and values (its prompt and completion but the last token) in the prefix cache."""
        model, device = self._live_model(), self.device
        n = len(requests)
        lengths = torch.tensor([len(r.prompt_ids) for r in requests], device=device)
        width = int(lengths.max())
        sampling = [r.sampling for r in requests]
        cache = _PreallocatedCache(model.config, n, min(2 * width, width + max(s.max_new_tokens for s in sampling)),
                                   dtype=self.dtype, device=device)
        reused: list[tuple[Optional[CachedSequence], int]] = [(None, 0)] * n
        if self.prefix_cache is not None:
            self._share_prefixes(model, self.prefix_cache, [r.prompt_ids for r in requests])
            reused = [self.prefix_cache.match(r.prompt_ids) for r in requests]
        logits = self._prefill(model, requests, reused, cache, width)
        starts = width - lengths  # each row's first column

        def attention_mask() -> torch.Tensor:
            """SDPA's boolean mask over the cache's columns, built once per allocation (True where a row has a
            token): transformers takes a 4-D mask as it is, where from a 2-D one it would rebuild [rows, 1, 1,
            length] at every step."""
            return (torch.arange(cache.columns, device=device)[None] >= starts[:, None])[:, None, None, :]

        mask = attention_mask()
        positions = lengths - 1  # each row's own position, whatever its padding

        temperature = torch.tensor([s.temperature for s in sampling], dtype=torch.float32, device=device)
        top_p = torch.tensor([s.top_p for s in sampling], dtype=torch.float32, device=device)
        stops = [frozenset((self.eos_token_id, *s.stop_token_ids)) for s in sampling]
        generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
        outputs: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        finish: list[str] = ["length"] * n
        live = list(range(n))  # request index of each row still in the batch
        while True:
            uniforms = torch.stack([torch.rand((), generator=generators[i], device=device, dtype=torch.float64)
                                    for i in live])
            try:
                tokens, chosen = sample_tokens(logits, temperature, top_p, uniforms)
            except EngineError as exc:
                raise EngineError(f"{exc} (weight version {self._version})") from None
            keep = []
            for row, (i, token, lp) in enumerate(zip(live, tokens.tolist(), chosen.tolist())):
                outputs[i].append(token)
                logprobs[i].append(lp)
                if token in stops[i]:
                    finish[i] = "stop"
                elif len(outputs[i]) < sampling[i].max_new_tokens:
                    keep.append(row)
                    continue
                kept = len(requests[i].prompt_ids) + len(outputs[i]) - 1  # every token but the one just sampled
                if self.prefix_cache is not None and self.prefix_cache.keeps(kept, cache.row_bytes(kept)):
                    self.prefix_cache.store(requests[i].prompt_ids + tuple(outputs[i][:-1]),
                                            cache.row_states(row, int(starts[row])), replaces=reused[i][0])
            if not keep:
                break
            if len(keep) < len(live):  # finished rows leave the batch: the rows kept move up, in place
                index = torch.tensor(keep, device=device)
                cache.keep_rows(index)
                mask[:len(keep)] = mask[index]
                positions, tokens, starts = positions[index], tokens[index], starts[index]
                temperature, top_p = temperature[index], top_p[index]
                live = [live[row] for row in keep]
            if cache.length == cache.columns:  # full: twice the columns, for the rows still running
                cache.reallocate(min(2 * cache.columns, width + max(sampling[i].max_new_tokens for i in live)))
                mask = attention_mask()
            positions = positions + 1
            out = model(input_ids=tokens[:, None], attention_mask=mask[:len(live), ..., :cache.length + 1],
                        position_ids=positions[:, None], cache=cache, use_cache=True)
            logits = out.logits[:, -1]
        return [Generation(prompt_ids=tuple(r.prompt_ids), output_ids=tuple(outputs[i]),
                           logprobs=tuple(logprobs[i]), finish_reason=finish[i],  # type: ignore[arg-type]
                           weight_version=self._version) for i, r in enumerate(requests)]

    def _prefill(self, model: torch.nn.Module, requests: Sequence[GenerationRequest],
                 reused: Sequence[tuple[Optional[CachedSequence], int]], cache: _PreallocatedCache,
                 width: int) -> torch.Tensor:
        """Forward the prompts, store their keys and values in ``cache`` and return each one's next-token logits.

        ``reused[i]`` is the cached sequence whose first ``n`` keys and values prompt ``i`` takes instead of
        forwarding its first ``n`` tokens (``(None, 0)``: none). Logits are computed for the last prompt token
        only."""
        logits = torch.empty((len(requests), self.vocab_size), dtype=self.dtype, device=self.device)
        prompts = [r.prompt_ids for r in requests]
        for bucket, bucket_logits, prefill, starts in self._prefill_buckets(model, prompts, reused):
            logits[bucket] = bucket_logits
            cache.store_prompts(bucket, [len(prompts[i]) for i in bucket], prefill, starts, width)
        return logits

    def _share_prefixes(self, model: torch.nn.Module, cache: PrefixCache, prompts: Sequence[tuple[int, ...]]) -> None:
        """Prefill once, into the prefix cache, each start that prompts of this batch share beyond what the cache
        holds (a GRPO group's identical first prompts, the instructions every agent or designer prompt opens with),
        so that every prompt then continues it instead of forwarding it again. Starts are those of neighbours in
        sorted order, each at most one token short of either prompt (its last token is forwarded for its logits)."""
        ordered = sorted(prompts)  # equal prompts side by side share all but their last token
        shared = set()
        for a, b in zip(ordered, ordered[1:]):
            n = min(common_prefix(a, b), len(a) - 1, len(b) - 1)
            if n >= cache.block and cache.peek(a[:n + 1])[1] < n:
                shared.add(a[:n])
        starts = sorted(shared)
        reused = [cache.peek(start) for start in starts]  # not prompts: their tokens count when prompts take them
        cache.stats.shared_tokens += sum(len(start) - m for start, (_, m) in zip(starts, reused))
        for bucket, _, prefill, columns in self._prefill_buckets(model, starts, reused):
            for row, (i, column) in enumerate(zip(bucket, columns)):
                cache.store(starts[i], prefill.row_states(row, column, column + len(starts[i])),
                            replaces=reused[i][0])

    def _prefill_buckets(self, model: torch.nn.Module, prompts: Sequence[tuple[int, ...]],
                         reused: Sequence[tuple[Optional[CachedSequence], int]]
                         ) -> Iterator[tuple[list[int], torch.Tensor, _PreallocatedCache, list[int]]]:
        """:meth:`_prefill_bucket` over buckets of prompts of similar length, fresh prompts apart from those
        continuing a cached prefix: each bucket's prompt indices, then what :meth:`_prefill_bucket` returns. A
        bucket's cache (its rows x its longest prefix plus its longest suffix, the part not ``reused``) stays within
        ``prefill_tokens`` columns (a longer prompt goes alone): for fresh prompts, its padded tokens."""
        order = sorted(range(len(prompts)), key=lambda i: (reused[i][1] > 0, len(prompts[i])))
        buckets: list[list[int]] = []
        longest = (0, 0)  # the current bucket's longest prefix and suffix
        for i in order:
            m = reused[i][1]
            grown = (max(longest[0], m), max(longest[1], len(prompts[i]) - m))
            if buckets and (reused[buckets[-1][0]][1] > 0) == (m > 0) and \
                    (len(buckets[-1]) + 1) * sum(grown) <= self.prefill_tokens:
                buckets[-1].append(i)
                longest = grown
            else:
                buckets.append([i])
                longest = (m, len(prompts[i]) - m)
        for bucket in buckets:
            yield (bucket, *self._prefill_bucket(model, [prompts[i] for i in bucket], [reused[i] for i in bucket]))

    def _prefill_bucket(self, model: torch.nn.Module, prompts: Sequence[tuple[int, ...]],
                        reused: Sequence[tuple[Optional[CachedSequence], int]]
                        ) -> tuple[torch.Tensor, _PreallocatedCache, list[int]]:
        """One forward of the prompts' suffixes: their last tokens' logits, the bucket's cache and each row's first
        column in it.

        Row ``j`` holds its cached prefix (``n_j`` columns) right-aligned before column ``P`` (the longest prefix)
        and its suffix *right*-padded from column ``P``. Without a prefix (``P`` 0) causal attention alone keeps a
        token from seeing the padding after it, so no mask is built (a left-padded batch needs a [batch, 1, length,
        length] one, which SDPA on CPU copies into a float mask four times its size). With prefixes a boolean mask
        hides the columns before each row's prefix; the suffixes then go in chunks of queries that keep it within
        ``_MASK_ENTRIES``. Positions continue each row's prefix."""
        device, rows = self.device, len(prompts)
        taken = torch.tensor([m for _, m in reused], device=device)
        lengths = [len(p) - m for p, (_, m) in zip(prompts, reused)]
        before, width = int(taken.max()), max(lengths)
        prefill = _PreallocatedCache(model.config, rows, before + width, dtype=self.dtype, device=device)
        prefill.place_prefixes([(row, [(k[:, :m], v[:, :m]) for k, v in entry.layers])
                                for row, (entry, m) in enumerate(reused) if entry is not None and m > 0], before)
        ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        for row, (prompt, (_, m)) in enumerate(zip(prompts, reused)):
            ids[row, :len(prompt) - m] = torch.tensor(prompt[m:])
        ids = ids.to(device)
        last = torch.tensor(lengths, device=device) - 1  # each row's last token, in its suffix
        hidden = torch.empty((rows, model.config.hidden_size), dtype=self.dtype, device=device)
        decoder, every = model.get_decoder(), torch.arange(rows, device=device)
        step = width if before == 0 else max(1, min(width, _MASK_ENTRIES // (rows * (before + width))))
        for first in range(0, width, step):
            end = min(first + step, width)
            if before == 0:
                out = decoder(input_ids=ids, cache=prefill, use_cache=True)
            else:
                queries = torch.arange(first, end, device=device)
                columns = torch.arange(before + end, device=device)
                mask = ((columns >= before - taken[:, None, None]) & (columns <= before + queries[None, :, None]))
                out = decoder(input_ids=ids[:, first:end], attention_mask=mask[:, None], cache=prefill,
                              position_ids=taken[:, None] + queries[None], use_cache=True)
            here = (last >= first) & (last < end)
            hidden[here] = out.last_hidden_state[every[here], last[here] - first]
        return model.get_output_embeddings()(hidden), prefill, [before - m for _, m in reused]

    # ------------------------------------------------------------------ life
    def _live_model(self) -> torch.nn.Module:
        if self.model is None:
            raise EngineError("the hf engine is closed")
        return self.model

    def close(self) -> None:
        self.model = None
        self.clear_prefix_cache()


class _PreallocatedLayer(DynamicLayer):
    """One attention layer's keys and values in preallocated buffers written in place: a decode step writes one
    column (DynamicCache concatenates, copying the layer's whole cache at every step) and attention reads a view of
    the columns filled so far."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.buffers = (keys, values)
        self.length = 0
        self.device = keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the buffers exist from the start."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        start, self.length = self.length, self.length + key_states.shape[-2]
        for buffer, states in zip(self.buffers, (key_states, value_states)):
            buffer[:, :, start:self.length].copy_(states)
        self.keys, self.values = (buffer[:, :, :self.length] for buffer in self.buffers)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


class _PreallocatedCache(Cache):
    """The KV cache of one batch: per layer, keys and values [rows, kv heads, ``columns``, head dim], zeroed when
    allocated (a masked-out column must hold finite numbers: NaN times a zero attention weight is NaN) and
    reallocated only when full (:meth:`reallocate`)."""

    def __init__(self, config: Any, rows: int, columns: int, *, dtype: torch.dtype, device: torch.device) -> None:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (rows, config.num_key_value_heads, columns, head_dim)
        super().__init__(layers=[_PreallocatedLayer(torch.zeros(shape, dtype=dtype, device=device),
                                                    torch.zeros(shape, dtype=dtype, device=device))
                                 for _ in range(config.num_hidden_layers)])
        self.columns = columns

    @property
    def length(self) -> int:
        """Columns filled so far (the same in every layer and row)."""
        return self.layers[0].length

    def store_prompts(self, rows: Sequence[int], lengths: Sequence[int], prefill: _PreallocatedCache,
                      starts: Sequence[int], width: int) -> None:
        """Copy row ``j`` of a prefill cache (``lengths[j]`` columns from ``starts[j]``) into row ``rows[j]``,
        right-aligned before column ``width``; the cache then holds ``width`` columns."""
        for layer, source in zip(self.layers, prefill.layers):
            for buffer, states in zip(layer.buffers, source.buffers):
                for j, (row, length, start) in enumerate(zip(rows, lengths, starts)):
                    buffer[row, :, width - length:width].copy_(states[j, :, start:start + length])
            layer.length = width

    def place_prefixes(self, prefixes: Sequence[tuple[int, Sequence[LayerKV]]], end: int) -> None:
        """Copy each ``(row, per-layer keys and values)`` into its row, right-aligned before column ``end``; the
        cache then holds ``end`` columns."""
        for index, layer in enumerate(self.layers):
            for row, states in prefixes:
                for buffer, tensor in zip(layer.buffers, states[index]):
                    buffer[row, :, end - tensor.shape[1]:end].copy_(tensor)
            layer.length = end
            layer.keys, layer.values = (buffer[:, :, :end] for buffer in layer.buffers)

    def row_bytes(self, columns: int) -> int:
        """Bytes of one row's keys and values over ``columns`` columns, every layer."""
        return sum(buffer[0, :, :columns].nbytes for layer in self.layers for buffer in layer.buffers)

    def row_states(self, row: int, start: int, end: Optional[int] = None) -> list[LayerKV]:
        """Copies of row ``row``'s keys and values from column ``start`` to ``end`` (the last one filled), per
        layer."""
        return [tuple(buffer[row, :, start:layer.length if end is None else end].clone()  # type: ignore[misc]
                      for buffer in layer.buffers) for layer in self.layers]

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (ascending), moved up to the first ``len(index)`` rows of the same buffers."""
        for layer in self.layers:
            keys, values = (buffer[index, :, :layer.length] for buffer in layer.buffers)
            layer.buffers = tuple(buffer[:len(index)] for buffer in layer.buffers)
            layer.buffers[0][:, :, :layer.length] = keys
            layer.buffers[1][:, :, :layer.length] = values

    def reallocate(self, columns: int) -> None:
        """New buffers of ``columns`` columns for the rows kept so far, their filled columns copied; the old ones
        are released layer by layer."""
        for layer in self.layers:
            old = layer.buffers
            layer.buffers = tuple(torch.zeros((*buffer.shape[:2], columns, buffer.shape[3]), dtype=buffer.dtype,
                                              device=buffer.device) for buffer in old)
            for new, buffer in zip(layer.buffers, old):
                new[:, :, :layer.length].copy_(buffer[:, :, :layer.length])
            layer.keys, layer.values = (buffer[:, :, :layer.length] for buffer in layer.buffers)  # off the old ones
        self.columns = columns


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its behaviour log-prob.

    The log-prob is ``log_softmax(logits / T)`` in float32 (T = 1 for greedy rows, ``temperature`` 0), before top-p:
    what the trainer recomputes. Sampled rows draw by inverse CDF over the top-p nucleus (tokens sorted by
    probability, each kept while the mass before it is below ``top_p`` of the whole), using one uniform per row from
    that request's own generator, so a row's draw does not depend on the other rows. The running mass is float64 (and
    so should the uniforms be): in float32 it stops growing near 1 and would cut off the tail of a large vocabulary
    (most of Qwen3's tokens at top_p 1) although the log-probs report it as possible."""
    greedy = temperature == 0
    scaled = logits.float() / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    broken = torch.isnan(logp).any(dim=-1)  # a NaN or +inf logit (or all -inf) leaves no distribution
    if broken.any():
        raise EngineError(f"the model's logits are NaN or +inf in {int(broken.sum())} of {len(broken)} sequences: "
                          "the served weights diverged or overflow in their dtype")
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    probs = sorted_logp.double().exp()
    cdf = probs.cumsum(dim=-1)
    probs = probs * (cdf - probs < top_p.double()[:, None] * cdf[:, -1:])
    cdf = probs.cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (uniforms.double() * cdf[:, -1])[:, None], right=True)
    pick = torch.minimum(pick, (probs > 0).sum(dim=-1, keepdim=True) - 1)
    tokens = torch.where(greedy, order[:, 0], order.gather(1, pick)[:, 0])
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def load_checkpoint_buckets(path: str) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors of a local Hugging Face folder, one bucket per safetensors shard (those its index lists)."""
    from safetensors.torch import load_file

    from spade_mega.hf_weights import WeightFolderError, weight_files

    try:
        listing = weight_files(path)
    except WeightFolderError as exc:
        raise EngineError(f"inference.hf_weights: {exc} (give a local Hugging Face model folder)") from None
    for name, listed in listing.items():
        file = Path(path) / name
        try:
            bucket = load_file(str(file))
        except Exception as exc:  # safetensors' errors name neither the file nor the setting
            raise EngineError(f"inference.hf_weights: cannot read {file}: {exc}") from exc
        if listed is not None:
            if not listed <= bucket.keys():
                raise EngineError(f"inference.hf_weights: the index lists {sorted(listed - bucket.keys())[0]} in "
                                  f"{file}, which does not hold it")
            bucket = {k: v for k, v in bucket.items() if k in listed}
        yield bucket


def from_config(cfg: SpadeConfig, tokenizer: Any) -> HFEngine:
    """The hf engine of a run: ``cfg.model`` built with ``cfg.inference``'s settings, eos/pad from ``tokenizer``."""
    if tokenizer.eos_token_id is None:
        raise EngineError("the run's tokenizer has no eos token: completions could never stop")
    inf = cfg.inference
    return HFEngine(cfg.model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                    device=inf.device, dtype=inf.dtype, max_batch_size=inf.max_batch_size, seed=cfg.run.seed,
                    weights_path=inf.hf_weights, prefix_cache_mb=inf.prefix_cache_mb)
