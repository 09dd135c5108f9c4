"""The hf engine's prefix cache: an agent's next turn prefills only its new tokens, and generates exactly what a
full prefill does.

Every comparison runs the same requests through two engines with the same weights, one with the cache and one
without (prefix_cache_mb 0): the same tokens, log-probs within 1e-5. The cache must also be what it claims to be:
reused (whole earlier turns, partial matches to the token), invalidated by every weight update, and bounded."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

from spade_mega.config.errors import ConfigError
from spade_mega.config.loader import load_config
from spade_mega.inference import EngineError, Generation, GenerationRequest, SamplingParams, build_engine
from spade_mega.inference import hf as hf_module
from spade_mega.inference.hf import HFEngine, build_hf_model
from spade_mega.inference.prefix_cache import PrefixCache
from spade_mega.tokenizer import byte_tokenizer

from hf_engine_support import CONFIG, cfg, one_thread  # noqa: F401 (fixtures)

EOS = byte_tokenizer().eos_token_id


def make_engine(cfg, prefix_cache_mb: float, init_seed: int = 0, **kwargs) -> HFEngine:
    torch.manual_seed(init_seed)  # the same seed, the same weights
    return HFEngine(cfg.model, eos_token_id=EOS, pad_token_id=0, device="cpu", prefix_cache_mb=prefix_cache_mb,
                    **kwargs)


def tokens(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(1, EOS, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def sampling(i: int, turn: int) -> SamplingParams:
    """Greedy and seeded samples mixed, completions of different lengths."""
    return SamplingParams(max_new_tokens=4 + (3 * i + turn) % 7, temperature=0.0 if i % 2 else 1.0, seed=10 * i + turn)


def converse(engine: HFEngine, prompts: list[tuple[int, ...]], turns: int,
             between: Callable[[int, int], tuple[int, ...]] = lambda i, turn: tokens(20 + 7 * i, 100 * turn + i),
             on_turn: Optional[Callable[[int], None]] = None) -> list[list[Generation]]:
    """The lockstep rollout's calls: each turn prompts with the last prompt, its completion and a new observation."""
    done: list[list[Generation]] = []
    for turn in range(turns):
        if on_turn is not None:
            on_turn(turn)
        done.append(engine.generate([GenerationRequest(p, sampling(i, turn)) for i, p in enumerate(prompts)]))
        prompts = [p + g.output_ids + between(i, turn) for i, (p, g) in enumerate(zip(prompts, done[-1]))]
    return done


def assert_same(cached: list[Generation], plain: list[Generation]) -> None:
    for a, b in zip(cached, plain, strict=True):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunked", [False, True])
def test_later_turns_prefill_only_their_new_tokens_and_generate_what_a_full_prefill_does(cfg, monkeypatch, chunked):
    """Six episodes of three turns, prompts of 30 to 230 tokens, in prefill buckets whose cache holds at most 1,000
    columns x rows (several per call, rows continuing prefixes of different lengths together); a fresh conversation
    joins at turn 2, so one call mixes cached and fresh prompts. Chunked: a mask budget of 5,000 entries forwards the
    suffixes in chunks of a few queries. Every later turn reuses its whole previous turn (prompt and completion but its
    last token, whose keys were never computed) and forwards only the new tokens."""
    if chunked:
        monkeypatch.setattr(hf_module, "_MASK_ENTRIES", 5_000)
    cached, plain = (make_engine(cfg, mb, prefill_tokens=1000) for mb in (64, 0))
    forwarded: list[int] = []  # tokens per row of each prefill forward
    cached.model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: forwarded.append(args[0].shape[1]) if args[0].shape[1] > 1 else None)
    sdpa, attended = torch.nn.functional.scaled_dot_product_attention, []

    def recording(query, key, value, attn_mask=None, **kwargs):
        if attn_mask is None or attn_mask.shape[2] > 1:  # prefill (a decode step's mask has one query row)
            attended.append((key.shape[0], key.shape[2], attn_mask is not None))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    prompts = [tokens(30 + 40 * i, i) for i in range(6)]
    previous: list[Generation] = []
    for turn in range(3):
        if turn == 1:
            prompts.append(tokens(90, 99))  # a fresh conversation
        requests = [GenerationRequest(p, sampling(i, turn)) for i, p in enumerate(prompts)]
        reused, forwarded[:] = cached.prefix_cache.stats.reused_tokens, []
        done = cached.generate(requests)
        assert_same(done, plain.generate(requests))
        reused = cached.prefix_cache.stats.reused_tokens - reused
        assert reused == sum(len(g.prompt_ids) + len(g.output_ids) - 1 for g in previous)  # each turn whole
        if turn > 0:
            new = [len(r.prompt_ids) - len(g.prompt_ids) - len(g.output_ids) + 1 for r, g in zip(requests, previous)]
            continued = [n for n in forwarded if n != 90]
            assert (90 in forwarded) == (turn == 1)  # the newcomer, whole, in its own bucket
            if chunked:
                assert max(continued) < max(new) and len(continued) >= 2  # in chunks of queries
            else:
                assert max(continued) == max(new)  # buckets of the continued conversations' new tokens
        previous = done
        prompts = [p + g.output_ids + tokens(20 + 7 * i, 100 * turn + i) for i, (p, g) in enumerate(zip(prompts, done))]
    assert len(cached.prefix_cache) == len(prompts)  # each turn's entry replaced its conversation's previous one
    assert all(rows * columns <= 1000 for rows, columns, _ in attended)
    assert any(masked and rows >= 2 for rows, _, masked in attended)  # different prefix lengths in one forward


def test_a_prompt_that_only_partly_matches_reuses_exactly_the_common_tokens(cfg):
    """A prompt that leaves a cached sequence part way (a shared system prompt, then another episode) reuses the
    tokens up to the first difference, not a block boundary; one that shares less than a block, nothing; one that
    is the cached sequence itself, all but its last token (whose logits start the completion)."""
    cached, plain = (make_engine(cfg, mb) for mb in (64, 0))
    first = [GenerationRequest(tokens(200, 1), SamplingParams(max_new_tokens=8, temperature=0.0))]
    done, = cached.generate(first)
    assert_same([done], plain.generate(first))
    sequence = done.prompt_ids + done.output_ids[:-1]  # what the cache holds
    prompts = [sequence[:137] + tokens(50, 2), sequence, sequence[:10] + tokens(60, 3)]
    requests = [GenerationRequest(p, SamplingParams(max_new_tokens=6, temperature=t, seed=5))
                for p, t in zip(prompts, (0.0, 1.0, 0.0))]
    stats = cached.prefix_cache.stats
    reused = []
    for request in requests:  # one lookup each, so each one's reuse is seen alone
        before = stats.reused_tokens
        assert_same(cached.generate([request]), plain.generate([request]))
        reused.append(stats.reused_tokens - before)
    assert reused == [137, len(sequence) - 1, 0]
    assert_same(cached.generate(requests), plain.generate(requests))  # the three in one batch


def test_prompts_of_one_batch_forward_the_start_they_share_once(cfg):
    """A GRPO group's plays open with the same prompt, and all agent prompts with the same instructions. Four equal
    prompts, two that share their first 100 tokens with them and an unrelated one, in one call with nothing cached:
    the shared starts (149 tokens of the equal ones, 100 of the others) go in one forward, then each prompt forwards
    what follows its start (the equal ones their last token); the completions are those of a cache-less engine."""
    cached, plain = make_engine(cfg, 64), make_engine(cfg, 0)
    forwarded: list[tuple[int, int]] = []
    cached.model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: forwarded.append(tuple(args[0].shape)) if args[0].shape[1] > 1 else None)
    common = tokens(150, 1)
    prompts = [common] * 4 + [common[:100] + tokens(30, 2), common[:100] + tokens(40, 3), (7,) + tokens(120, 4)]
    requests = [GenerationRequest(p, SamplingParams(max_new_tokens=5, temperature=float(i % 2), seed=i))
                for i, p in enumerate(prompts)]
    assert_same(cached.generate(requests), plain.generate(requests))
    assert sorted(forwarded) == [(1, 121), (2, 149), (6, 40)]  # the unrelated prompt; the starts; what follows them
    assert cached.prefix_cache.stats.reused_tokens == 4 * 149 + 2 * 100
    # of which the starts' 249 were forwarded by this call: the prompts' 991 tokens, 547 not forwarded
    stats = cached.prefix_cache.stats
    assert (stats.lookups, stats.prompt_tokens, stats.shared_tokens) == (7, sum(map(len, prompts)), 149 + 100)
    again = [GenerationRequest(p, SamplingParams(max_new_tokens=5, temperature=0.0)) for p in prompts[3:]]
    assert_same(cached.generate(again), plain.generate(again))  # the starts are cached now: nothing to share


def test_a_weight_update_invalidates_the_cache(cfg):
    """Keys and values computed by the old weights must never meet the new ones: after an update the next turn
    prefills its whole prompt, and generates what an engine without a cache does with the new weights. A failed
    update clears it too (the weights it computed with are gone either way)."""
    cached, plain = (make_engine(cfg, mb) for mb in (64, 0))
    torch.manual_seed(7)
    weights = _checkpoint_weights(build_hf_model(cfg.model, dtype=torch.float32, device=torch.device("cpu")))
    prompts = [tokens(80 + 30 * i, i) for i in range(3)]

    def updating(engine: HFEngine) -> Callable[[int], None]:
        def update(turn: int) -> None:
            if turn == 1:
                engine.update_weights([weights], version=1)
            hits.append(engine.prefix_cache.stats.hits if engine.prefix_cache is not None else 0)
        return update

    hits: list[int] = []
    generations = converse(cached, prompts, 3, on_turn=updating(cached))
    assert hits[1] == hits[2] == 0  # turn 2 found nothing: the update cleared turn 1's sequences
    assert cached.prefix_cache.stats.hits - hits[2] == len(prompts)  # turn 3 continued turn 2 from the cache
    assert_same(sum(generations, []), sum(converse(plain, prompts, 3, on_turn=updating(plain)), []))

    assert len(cached.prefix_cache) > 0

    def failing():
        yield {}
        raise RuntimeError("the bridge lost a rank")

    with pytest.raises(RuntimeError, match="lost a rank"):
        cached.update_weights(failing(), version=2)
    assert len(cached.prefix_cache) == 0


def _checkpoint_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights under checkpoint names (one tensor per expert projection), as the bridge streams them."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        return {k: v for f in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_the_cache_stays_within_its_budget_evicting_the_least_recently_used(cfg):
    """A budget for about two of five conversations: every call ends within it, the oldest go first, the next turn
    still generates what a full prefill does (from the cache where its conversation survived, else in full); a
    sequence larger than the whole budget is never kept."""
    per_token = 2 * cfg.model.num_layers * cfg.model.num_query_groups * cfg.model.kv_channels * 4  # float32 K and V
    budget = 2.5 * 190 * per_token
    cached, plain = make_engine(cfg, budget / 2**20), make_engine(cfg, 0)
    prompts = [tokens(170 + 5 * i, i) for i in range(5)]
    sizes: list[int] = []
    generations = converse(cached, prompts, 2, on_turn=lambda turn: sizes.append(cached.prefix_cache.nbytes))
    sizes.append(cached.prefix_cache.nbytes)
    assert_same(sum(generations, []), sum(converse(plain, prompts, 2), []))
    stats = cached.prefix_cache.stats
    assert 0 < max(sizes) <= cached.prefix_cache.budget_bytes
    assert stats.evictions >= 3 and 1 <= stats.hits < len(prompts)

    tiny = make_engine(cfg, 100 * per_token / 2**20)  # room for 100 tokens: a 170-token sequence does not fit
    request = [GenerationRequest(prompts[0], SamplingParams(max_new_tokens=4, temperature=0.0))]
    assert_same(tiny.generate(request), plain.generate(request))
    assert len(tiny.prefix_cache) == 0 and tiny.prefix_cache.nbytes == 0


def test_a_sequence_the_cache_cannot_keep_is_not_copied(cfg, monkeypatch):
    """A finished row's keys and values are copied out of the batch's cache only when the prefix cache will keep
    them: a long answer (an evaluation's 30k tokens: ~3 GB on a 30B-A3B model) larger than the budget was copied
    whole, on the engine's device, next to the batch's cache, then dropped. Short sequences (under a block) alike."""
    per_token = 2 * cfg.model.num_layers * cfg.model.num_query_groups * cfg.model.kv_channels * 4  # float32 K and V
    copies: list[int] = []
    row_states = hf_module._PreallocatedCache.row_states
    monkeypatch.setattr(hf_module._PreallocatedCache, "row_states",
                        lambda self, *args: copies.append(1) or row_states(self, *args))
    tiny = make_engine(cfg, 100 * per_token / 2**20)  # room for 100 tokens
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    tiny.generate([GenerationRequest(tokens(170, 1), greedy), GenerationRequest(tokens(8, 2), greedy)])
    assert copies == [] and len(tiny.prefix_cache) == 0
    tiny.generate([GenerationRequest(tokens(60, 3), greedy)])
    assert copies == [1] and len(tiny.prefix_cache) == 1  # one that fits: copied and kept


def _kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((2, n, 4), float(n)), torch.full((2, n, 4), -float(n)))]


def test_prefix_cache_lookup_eviction_and_replacement():
    """The data structure alone: the longest common prefix wins, a hit is a use for the LRU order, an entry that is
    a prefix of a new one is replaced by it, and clear() empties it."""
    per_entry = 2 * 2 * 4 * 4  # bytes per token of _kv
    cache = PrefixCache(100 * per_entry, block=4)
    a, b = tuple(range(40)), tuple(range(20)) + tuple(range(100, 120))
    cache.store(a, _kv(40))
    cache.store(b, _kv(40))
    entry, n = cache.match(tuple(range(30)) + (7, 7))
    assert n == 30 and entry.layers[0][0][0, 0, 0] == 40 and entry.ids.tolist() == list(a)
    entry, n = cache.match(b[:25] + (1,))
    assert n == 25 and entry.ids.tolist() == list(b)
    assert cache.match(tuple(range(3)) + (9,) * 20) == (None, 0)  # less than a block in common
    cache.match(a + (1,))  # a used after b: b is the least recently used
    cache.store(tuple(range(200, 230)), _kv(30))  # 110 tokens > 100: one must go
    assert [e.ids[0] for e in cache._entries.values()] == [0, 200] and cache.stats.evictions == 1
    longer = a + (5,) * 10
    entry, _ = cache.match(longer)
    cache.store(longer, _kv(50), replaces=entry)  # a is a prefix of it: replaced, nothing evicted
    assert [len(e.ids) for e in cache._entries.values()] == [30, 50] and cache.stats.evictions == 1
    assert cache.nbytes == 80 * per_entry
    with pytest.raises(ValueError, match="for a sequence of 12"):
        cache.store(tuple(range(12)), _kv(11))
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.match(longer) == (None, 0)


def test_prefix_cache_mb_is_a_checked_setting(cfg):
    torch.manual_seed(0)
    assert build_engine(cfg, byte_tokenizer()).prefix_cache.budget_bytes == int(cfg.inference.prefix_cache_mb * 2**20)
    off = load_config(CONFIG, ["inference.device=cpu", "inference.prefix_cache_mb=0"])
    assert build_engine(off, byte_tokenizer()).prefix_cache is None
    with pytest.raises(ConfigError, match="inference.prefix_cache_mb: must be >= 0"):
        load_config(CONFIG, ["inference.prefix_cache_mb=-1"])
    with pytest.raises(ConfigError, match="inference.prefix_cache_mb: expected a finite float, got inf"):
        load_config(CONFIG, ["inference.prefix_cache_mb=.inf"])
    for bad in (float("nan"), float("inf")):
        with pytest.raises(EngineError, match="prefix_cache_mb must be a finite number >= 0"):
            make_engine(cfg, bad)
    assert len(make_engine(cfg, 1e-9).generate([GenerationRequest(tokens(40, 0), SamplingParams(1))])) == 1


def test_clearing_the_cache_makes_the_next_call_what_a_fresh_engine_generates_bit_for_bit(cfg):
    """What the cache holds changes a prompt's keys and values in the last bits (a prefix forwarded within a longer
    sequence, in another batch, or one decode step at a time), so a resumed run, whose engine starts empty, plays
    what the straight run played only if the straight run's cache was empty at the same point too. After
    clear_prefix_cache the engine generates exactly (not within 1e-5) what a new engine with the same weights does."""
    start = tokens(60, 1)
    used, fresh = make_engine(cfg, 64), make_engine(cfg, 64)
    used.generate([GenerationRequest(start + tokens(30, 2), SamplingParams(max_new_tokens=8, seed=1))])  # an eval
    used.clear_prefix_cache()
    assert len(used.prefix_cache) == 0 and used.prefix_cache.nbytes == 0
    requests = [GenerationRequest(start + tokens(40 - 15 * i, 3 + i), SamplingParams(max_new_tokens=8, seed=5 + i))
                for i in range(2)]
    assert used.generate(requests) == fresh.generate(requests)
    make_engine(cfg, 0).clear_prefix_cache()  # no cache: nothing to clear


@pytest.mark.multiproc
def test_every_rollout_starts_and_ends_with_an_empty_prefix_cache(cfg, tmp_path):
    """The straight run evaluates after saving a checkpoint, and its evaluation's sequences (agent prompts like the
    rollout's) stayed in the cache into the next rollout, while a run resumed from that checkpoint starts it with an
    empty one: its log-probs, and so its training, differed in the last bits from the straight run's (which
    tests/test_selfplay.py requires to be bitwise the same; its resumed run happens to re-evaluate first, so it did
    not see it). After the rollout the trainer steps, on the same GPU for an hf engine there: the rollout's entries,
    never used again (the sync would clear them), are freed first. Real actor, hf engine and sandbox, one small
    rollout of the tiny model."""
    from sandbox_support import strict_missing

    from spade_mega.selfplay.loop import _Actor

    overrides = [f"run.output_dir={tmp_path}", "inference.device=cpu", "rollout.envs_per_rollout=1",
                 "rollout.agent_trajectories_per_env=2", "rollout.hint_plays_per_env=1", "rollout.max_turns=2",
                 "rollout.max_response_tokens=8", "rollout.max_designer_tokens=24", "curriculum.corpus.token_budget=64"]
    if strict_missing() is not None:
        overrides.append("sandbox.isolation=best-effort")
    actor = _Actor(load_config(CONFIG, overrides), tmp_path / "run")
    engine, held = actor.engine, []
    generate = engine.generate

    def recording(requests):
        held.append(len(engine.prefix_cache))
        return generate(requests)

    try:
        engine.generate([GenerationRequest(tokens(40, 1), SamplingParams(max_new_tokens=4, seed=1))])
        assert len(engine.prefix_cache) == 1  # what an evaluation leaves behind
        engine.generate = recording
        metrics = actor.rollout(1).metrics
        assert len(engine.prefix_cache) == 0 and engine.prefix_cache.nbytes == 0
    finally:
        actor.close()
    assert metrics["agent/episodes"] > 0 and held[0] == 0 and max(held) > 0  # used within the rollout


def test_emptying_a_prefix_cache_is_an_engine_capability_the_loop_asks_for_by_its_protocol(cfg):
    """The hf engine keeps its prefix cache in this process and says so by the PrefixCaching protocol, which the loop
    asks for (as MemoryReleasing for colocated servers); the server engines keep theirs in the server and have no
    such part, nor has an engine that caches nothing of its own (the tests' scripted one)."""
    from solver_engine import ScriptedSolverEngine

    from spade_mega.inference import PrefixCaching
    from spade_mega.inference.server import ServerEngine

    assert isinstance(make_engine(cfg, 64), PrefixCaching) and isinstance(make_engine(cfg, 0), PrefixCaching)
    assert not issubclass(ServerEngine, PrefixCaching) and not issubclass(ScriptedSolverEngine, PrefixCaching)
