"""The in-process hf engine on the tiny demo model: what the rollout and the trainer rely on.

Log-probs must equal the trainer's recomputation (a full forward of prompt + completion), greedy must be the argmax,
seeds must reproduce, batching must not change results, and a weight update must be all-or-nothing."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spade_mega.config.loader import load_config
from spade_mega.inference import Engine, EngineError, GenerationRequest, SamplingParams, build_engine
from spade_mega.inference.hf import HFEngine, build_hf_model, sample_tokens
from spade_mega.tokenizer import byte_tokenizer

from hf_engine_support import CONFIG, cfg, one_thread  # noqa: F401 (fixtures)

TOK = byte_tokenizer()
EOS, PAD = TOK.eos_token_id, TOK.pad_token_id


def make_engine(model, init_seed: int = 0, **kwargs) -> HFEngine:
    torch.manual_seed(init_seed)  # the random init: the same seed gives the same weights
    return HFEngine(model, eos_token_id=kwargs.pop("eos_token_id", EOS), pad_token_id=PAD, device="cpu", **kwargs)


@pytest.fixture(scope="module")
def engine(cfg):
    torch.manual_seed(0)
    return build_engine(cfg, TOK)


def request(prompt: str, **sampling) -> GenerationRequest:
    return GenerationRequest(tuple(TOK.encode(prompt)), SamplingParams(**sampling))


def full_forward_logprobs(model, generation, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(logits / T) of each output token from one forward of prompt + output, and the argmax tokens."""
    ids = torch.tensor([generation.prompt_ids + generation.output_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(generation.prompt_ids) - 1:-1].float()
    out = torch.tensor(generation.output_ids)
    return torch.log_softmax(logits / temperature, -1).gather(1, out[:, None])[:, 0], logits.argmax(-1)


def test_build_engine_takes_eos_and_pad_from_the_tokenizer(engine, cfg):
    assert isinstance(engine, HFEngine) and isinstance(engine, Engine)
    assert (engine.eos_token_id, engine.pad_token_id) == (TOK.convert_tokens_to_ids("<|im_end|>"), PAD)
    assert engine.vocab_size == cfg.model.vocab_size and engine.weight_version == 0


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_logprobs_equal_a_full_forward_at_the_sampling_temperature(engine, temperature, top_p):
    reqs = [request(p, max_new_tokens=12, temperature=temperature, top_p=top_p, seed=i)
            for i, p in enumerate(["hello", "a much longer prompt than the first", "x"])]
    for gen in engine.generate(reqs):
        assert len(gen.output_ids) == len(gen.logprobs) >= 1
        expected, argmax = full_forward_logprobs(engine.model, gen, temperature or 1.0)
        torch.testing.assert_close(torch.tensor(gen.logprobs), expected, atol=1e-5, rtol=0)
        if temperature == 0:
            assert gen.output_ids == tuple(argmax.tolist())


def test_a_tiny_nucleus_samples_the_most_likely_token_but_reports_the_untruncated_logprob(engine):
    greedy, = engine.generate([request("nucleus", max_new_tokens=8, temperature=0.0)])
    tiny, = engine.generate([request("nucleus", max_new_tokens=8, temperature=0.5, top_p=1e-6, seed=3)])
    assert tiny.output_ids == greedy.output_ids
    expected, _ = full_forward_logprobs(engine.model, tiny, 0.5)
    torch.testing.assert_close(torch.tensor(tiny.logprobs), expected, atol=1e-5, rtol=0)
    assert max(tiny.logprobs) < 0  # the log-prob before truncation, not log(1) of the one-token nucleus


@pytest.mark.parametrize("top_p", [1.0, 0.9999])
def test_the_tail_of_a_qwen3_sized_vocabulary_is_sampled_at_its_probability(top_p):
    """One likely token and 151,935 tokens of probability ~1e-9 each (1.5e-4 together). In float32 the running mass
    stops growing at ~0.99985 (each tail token is below its rounding step), so the tail was never drawn where it
    should be although the reported log-probs say it can be: each draw must match a float64 inverse CDF."""
    vocab = 151_936
    logits = -20.0 - 1e-5 * torch.arange(vocab, dtype=torch.float32)[None]  # decreasing: sorted order = id order
    logits[0, 0] = 0.0
    p = torch.softmax(logits.double(), -1)[0]
    tail = 1 - p[0].item()
    assert 1e-4 < tail < 2e-4
    nucleus = p * (p.cumsum(0) - p < top_p)
    for u in (1 - tail / 2, 1 - tail / 4, 1 - tail / 100, 1 - 2 * tail, 0.0):
        token, logprob = sample_tokens(logits, torch.ones(1), torch.tensor([top_p]),
                                       torch.tensor([u], dtype=torch.float64))
        want = int(torch.searchsorted(nucleus.cumsum(0), u * nucleus.sum(), right=True))
        assert abs(token.item() - want) <= 100, (u, token.item(), want)
        assert logprob.item() == pytest.approx(math.log(p[token.item()].item()), abs=1e-4)


def test_nan_or_infinite_logits_are_an_engine_error_not_a_crash(cfg):
    """Diverged weights (or a bf16 overflow) give NaN / +inf logits: the engine says so instead of failing on an
    index deep in the sampler."""
    engine = make_engine(cfg.model)
    weights = saved_weights(engine.model)
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], float("nan"))
    engine.update_weights([weights], version=3)
    for temperature in (1.0, 0.0):
        with pytest.raises(EngineError, match=r"NaN or \+inf .*\(weight version 3\)"):
            engine.generate([request("diverged", max_new_tokens=4, temperature=temperature, seed=0)])
    logits = torch.zeros(2, 8)
    logits[1, 3] = float("inf")
    with pytest.raises(EngineError, match=r"NaN or \+inf"):
        sample_tokens(logits, torch.ones(2), torch.ones(2), torch.full((2,), 0.5, dtype=torch.float64))


def test_same_seed_same_completion_other_seed_other_completion(engine):
    reqs = [request("seed test", max_new_tokens=16, temperature=1.0, seed=s) for s in (7, 7, 8)]
    first, again = engine.generate(reqs), engine.generate(reqs)
    assert first == again
    assert first[0].output_ids == first[1].output_ids  # the same seed inside one batch, too
    assert first[0].output_ids != first[2].output_ids
    unseeded = [request("seed test", max_new_tokens=16, temperature=1.0)] * 2
    a, b = engine.generate(unseeded)
    assert a.output_ids != b.output_ids  # no seed: each request draws its own


def test_stop_and_eos_tokens_end_the_completion_and_are_included(engine, cfg):
    free, = engine.generate([request("stop here", max_new_tokens=10, temperature=0.0)])
    assert free.finish_reason == "length" and len(free.output_ids) == 10
    k = next(i for i in range(2, 10) if free.output_ids[i] not in free.output_ids[:i])
    stop = free.output_ids[k]
    stopped, = engine.generate([request("stop here", max_new_tokens=10, temperature=0.0, stop_token_ids=(stop,))])
    assert stopped.output_ids == free.output_ids[:k + 1] and stopped.finish_reason == "stop"
    assert stopped.logprobs == pytest.approx(free.logprobs[:k + 1], abs=1e-6)
    eos_engine = make_engine(cfg.model, eos_token_id=stop)
    eos_engine.update_weights([saved_weights(engine.model)], version=1)
    ended, = eos_engine.generate([request("stop here", max_new_tokens=10, temperature=0.0)])
    assert ended.output_ids == stopped.output_ids and ended.finish_reason == "stop" and ended.weight_version == 1


def test_batched_and_chunked_greedy_equals_one_at_a_time(cfg):
    engine = make_engine(cfg.model, max_batch_size=2)
    prompts = ["a", "two words", "a prompt of middling length", "bb", "the longest prompt of this little batch"]
    reqs = [request(p, max_new_tokens=6 + 2 * i, temperature=0.0) for i, p in enumerate(prompts)]
    alone = [engine.generate([r])[0] for r in reqs]
    chunked = engine.generate(reqs)
    engine.max_batch_size = 8
    batched = engine.generate(reqs)
    engine.prefill_tokens = 1  # every prompt forwarded on its own, the batch decoded together
    prefilled_alone = engine.generate(reqs)
    for one, *others in zip(alone, chunked, batched, prefilled_alone):
        for other in others:
            assert other.output_ids == one.output_ids and other.finish_reason == one.finish_reason == "length"
            torch.testing.assert_close(torch.tensor(other.logprobs), torch.tensor(one.logprobs), atol=1e-5, rtol=0)
    assert [len(g.output_ids) for g in batched] == [6, 8, 10, 12, 14]


def test_a_seeded_sample_does_not_depend_on_its_batch_in_float32(cfg):
    """Each request draws from its own generator: alone, in chunks or in one batch (in another order) it samples the
    same completion. (bfloat16 kernels are not batch-invariant: there the logits, and so samples, may differ.)"""
    engine = make_engine(cfg.model, max_batch_size=2)
    prompts = ["a", "two words", "a prompt of middling length", "bb", "the longest prompt of this little batch"]
    reqs = [request(p, max_new_tokens=16, temperature=1.0, top_p=0.9, seed=100 + i) for i, p in enumerate(prompts)]
    alone = [engine.generate([r])[0] for r in reqs]
    chunked = engine.generate(reqs)
    engine.max_batch_size = 8
    batched = engine.generate(reqs[::-1])[::-1]
    assert [g.output_ids for g in chunked] == [g.output_ids for g in batched] == [g.output_ids for g in alone]
    assert len({g.output_ids for g in alone}) == len(alone)


@pytest.mark.parametrize("prefill_tokens,buckets", [(16384, [(4, 400)]), (800, [(2, 250), (2, 400)])])
def test_memory_grows_with_batch_times_length_and_the_cache_is_written_in_place(cfg, monkeypatch, prefill_tokens,
                                                                                 buckets):
    """What SDPA is given. Prompts go in (length-sorted buckets of at most ``prefill_tokens`` padded tokens) with no
    mask: a left-padded batch needed a [batch, 1, length, length] one (16 designer prompts of 3.6k tokens: 200 MB of
    mask, which SDPA on CPU copied into a float one of 800 MB). Every decode step's keys are a view of
    one buffer per layer allocated before the first step (DynamicCache reallocated and copied the whole cache at
    each step), masked by [rows, 1, 1, columns], also after finished rows left the batch."""
    engine = make_engine(cfg.model, prefill_tokens=prefill_tokens)
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def recording(query, key, value, attn_mask=None, **kwargs):
        calls.append((tuple(key.shape), None if attn_mask is None else tuple(attn_mask.shape),
                      key.untyped_storage().data_ptr()))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    gen = torch.Generator().manual_seed(0)
    reqs = [GenerationRequest(tuple(torch.randint(0, EOS, (n,), generator=gen).tolist()),
                              SamplingParams(max_new_tokens=new, temperature=0.0))
            for n, new in ((400, 3), (150, 7), (400, 5), (250, 4))]
    generations = engine.generate(reqs)
    monkeypatch.undo()
    layers, width = cfg.model.num_layers, 400
    prefill, decode = calls[:layers * len(buckets)], calls[layers * len(buckets):]
    assert [(key[0], key[2]) for key, _, _ in prefill[::layers]] == buckets
    assert all(mask is None for _, mask, _ in prefill)
    assert len(decode) == layers * (7 - 1)  # the longest completion's steps after its first token
    for step, (key, mask, _) in enumerate(decode):
        assert key[2] == width + 1 + step // layers and mask == (key[0], 1, 1, key[2])
    assert [key[0] for key, _, _ in decode[::layers]] == [4, 4, 3, 2, 1, 1]  # rows leave as they finish
    for layer in range(layers):
        assert len({storage for _, _, storage in decode[layer::layers]}) == 1
    for generation in generations:  # the cache, its padding columns and the moved rows hold the right values
        expected, argmax = full_forward_logprobs(engine.model, generation, 1.0)
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=1e-5, rtol=0)
        assert generation.output_ids == tuple(argmax.tolist())


def test_the_cache_follows_the_tokens_generated_not_max_new_tokens(cfg, monkeypatch):
    """max_new_tokens is a cap (an evaluation's 30k tokens, where most answers are short), not what a batch needs:
    the cache must not be sized for it before the first step (prompt + max_new_tokens columns for every row: 64 rows
    x 33k columns of a 0.6B model is 240 GB where the engine before held what the rows had generated). Here one row
    stops at its first token under a 4,000-token cap: the memory behind the keys SDPA reads stays within twice what
    the rows wrote, and the rows that run past the first allocation (one of them leaving later) keep their
    log-probs."""
    engine = make_engine(cfg.model)
    sdpa, storages = torch.nn.functional.scaled_dot_product_attention, []

    def recording(query, key, value, attn_mask=None, **kwargs):
        storages.append(key.untyped_storage().nbytes())
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    gen = torch.Generator().manual_seed(1)
    prompt = {n: tuple(torch.randint(0, EOS, (n,), generator=gen).tolist()) for n in (40, 9, 30)}
    reqs = [GenerationRequest(prompt[40], SamplingParams(max_new_tokens=4000, temperature=1.0, seed=1,
                                                         stop_token_ids=tuple(range(cfg.model.vocab_size)))),
            GenerationRequest(prompt[9], SamplingParams(max_new_tokens=100, temperature=1.0, seed=2)),
            GenerationRequest(prompt[30], SamplingParams(max_new_tokens=60, temperature=0.0))]
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    generations = engine.generate(reqs)
    monkeypatch.undo()
    assert [(len(g.output_ids), g.finish_reason) for g in generations] == [(1, "stop"), (100, "length"),
                                                                           (60, "length")]
    written = len(reqs) * cfg.model.num_query_groups * (40 + 100) * cfg.model.kv_channels * 4  # bytes, float32
    assert max(storages) <= 2 * written, (max(storages), written)
    for request, generation in zip(reqs, generations):
        expected, argmax = full_forward_logprobs(engine.model, generation, request.sampling.temperature or 1.0)
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=1e-5, rtol=0)
    assert generations[2].output_ids == tuple(argmax.tolist())


def saved_weights(model) -> dict[str, torch.Tensor]:
    """``model``'s weights as transformers writes a checkpoint (one tensor per expert projection)."""
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        return {k: v for f in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("moe,tied", [(True, False), (False, True)])
def test_weights_saved_by_transformers_round_trip(cfg, tmp_path, moe, tied):
    model = cfg.model if moe else type(cfg.model)(**{**vars(cfg.model), "num_experts": 0, "tie_embeddings": True})
    assert model.tie_embeddings == tied
    engine = make_engine(model, init_seed=1)
    torch.manual_seed(2)
    other = build_hf_model(model, dtype=torch.float32, device=torch.device("cpu"))
    weights = saved_weights(other)
    # a tied checkpoint may carry the head too: the engine takes it as the embedding
    assert set(weights) - ({"lm_head.weight"} if tied else set()) == set(engine.expected_weights())
    ids = torch.tensor([TOK.encode("round trip of the weights")])
    with torch.no_grad():
        want = other(input_ids=ids).logits
        assert not torch.allclose(engine.model(input_ids=ids).logits, want)
        names = sorted(weights)
        engine.update_weights(({n: weights[n] for n in names[i::3]} for i in range(3)), version=5)
        assert torch.equal(engine.model(input_ids=ids).logits, want)
    assert engine.weight_version == 5
    other.save_pretrained(tmp_path)
    loaded = make_engine(model, init_seed=3, weights_path=str(tmp_path))
    with torch.no_grad():
        assert torch.equal(loaded.model(input_ids=ids).logits, want)


def test_a_tied_model_takes_the_embedding_whatever_order_the_head_copy_comes_in(cfg):
    """A tied checkpoint may store a head that differs from its embedding; the bridge loads the embedding into the
    trainer, so the engine serves it too, also when the head comes in a later bucket (the last shard, where it
    usually is: the head used to overwrite the embedding there)."""
    model = type(cfg.model)(**{**vars(cfg.model), "num_experts": 0, "tie_embeddings": True})
    engine = make_engine(model)
    weights = saved_weights(build_hf_model(model, dtype=torch.float32, device=torch.device("cpu")))
    embedding = weights["model.embed_tokens.weight"]
    head = {"lm_head.weight": torch.randn_like(embedding)}
    for buckets in ([weights, head], [head, weights]):
        engine.update_weights(buckets, version=1)
        assert torch.equal(engine.model.get_input_embeddings().weight, embedding)
        assert torch.equal(engine.model.get_output_embeddings().weight, embedding)
    engine.update_weights([{n: t for n, t in weights.items() if n != "model.embed_tokens.weight"},
                           {"lm_head.weight": embedding * 2}], version=2)  # a head alone stands for the embedding
    assert torch.equal(engine.model.get_input_embeddings().weight, embedding * 2)


def test_a_bfloat16_engine_computes_what_transformers_bfloat16_model_does(cfg):
    """Rotary frequencies stay float32 in a bfloat16 model, as transformers and Megatron keep them: cast to bfloat16
    (off by up to 2**-9) the angles drift by a radian by position 3,000, away from what the trainer computes."""
    import transformers

    engine = make_engine(cfg.model, dtype="bfloat16")
    torch.manual_seed(5)
    reference = transformers.AutoModelForCausalLM.from_config(engine.model.config, dtype=torch.bfloat16).eval()
    engine.update_weights([saved_weights(reference)], version=1)
    ids = torch.randint(0, cfg.model.vocab_size, (1, 3000), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(engine.model(input_ids=ids).logits, reference(input_ids=ids).logits)
    assert next(engine.model.parameters()).dtype == torch.bfloat16


def test_a_failed_update_refuses_generation_until_a_complete_one(cfg):
    engine = make_engine(cfg.model)
    weights = saved_weights(engine.model)
    req = [request("consistency", max_new_tokens=4, temperature=0.0)]
    before = engine.generate(req)

    # refused before anything is copied: the engine keeps serving the old weights
    with pytest.raises(EngineError, match="no tensor 'model.layers.0.mlp.experts.9.up_proj.weight'"):
        engine.update_weights([{"model.layers.0.mlp.experts.9.up_proj.weight": torch.zeros(32, 64)}], version=1)
    with pytest.raises(EngineError, match=r"'model.norm.weight' has shape \(3,\), the model's is \(64,\)"):
        engine.update_weights([{"model.norm.weight": torch.zeros(3)}], version=1)
    assert engine.generate(req) == before and engine.weight_version == 0

    missing = "model.layers.1.mlp.experts.3.down_proj.weight"
    partial = {n: torch.zeros_like(t) for n, t in weights.items() if n != missing}
    with pytest.raises(EngineError, match=f"incomplete: no tensor for {missing}"):
        engine.update_weights([partial], version=1)
    with pytest.raises(EngineError, match="inconsistent"):
        engine.generate(req)

    def failing_stream():
        yield dict(list(weights.items())[:5])
        raise RuntimeError("the bridge lost a rank")

    with pytest.raises(RuntimeError, match="lost a rank"):
        engine.update_weights(failing_stream(), version=1)
    with pytest.raises(EngineError, match="version 1 failed part way"):
        engine.generate(req)
    assert engine.weight_version == 0
    engine.update_weights([weights], version=2)
    again = engine.generate(req)
    assert again[0].output_ids == before[0].output_ids and again[0].weight_version == 2


@pytest.mark.parametrize("prompt,max_new,match", [
    ((), 4, "request 1: empty prompt"),
    ((1, 512), 4, r"request 1: prompt entries \[512\] are not token ids of the vocabulary \[0, 512\)"),
    ((-1, 3), 4, r"request 1: prompt entries \[-1\] are not token ids"),
    (None, None, r"request 1: prompt \(100 tokens\) \+ max_new_tokens \(\d+\) exceeds the model's "
                 r"max_position_embeddings \(\d+\)"),
])
def test_bad_requests_name_the_request(engine, prompt, max_new, match):
    if prompt is None:  # one token past the model's context
        prompt, max_new = (1,) * 100, engine.max_positions - 99
    good = request("fine", max_new_tokens=2)
    with pytest.raises(EngineError, match=match):
        engine.generate([good, GenerationRequest(prompt, SamplingParams(max_new_tokens=max_new))])


@pytest.mark.parametrize("fields,match", [
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1, got 0"),
    (dict(temperature=-0.5), r"temperature must be a finite number >= 0, got -0.5"),
    (dict(temperature=float("nan")), r"temperature must be a finite number >= 0, got nan"),
    (dict(temperature=float("inf")), r"temperature must be a finite number >= 0, got inf"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=float("nan")), r"top_p must be in \(0, 1\], got nan"),
])
def test_bad_sampling_params_are_refused_by_name(fields, match):
    """Not at sampling time, where a NaN temperature would read as NaN logits, i.e. as broken weights."""
    with pytest.raises(EngineError, match=match):
        SamplingParams(**{"max_new_tokens": 4, **fields})


@pytest.mark.parametrize("stops,match", [((512,), r"\[512\] are outside the vocabulary \[0, 512\)"),
                                         (("<|im_end|>",), r"\['<\|im_end\|>'\] .* are not token ids \(Python ints\)")])
def test_bad_stop_token_ids_name_the_request(engine, stops, match):
    with pytest.raises(EngineError, match=r"request 0: stop token ids " + match):
        engine.generate([request("fine", max_new_tokens=2, stop_token_ids=stops)])


def test_an_engine_this_build_lacks_is_reported_unavailable(cfg):
    lacking = type(cfg)(**{**vars(cfg), "rollout": type(cfg.rollout)(**{**vars(cfg.rollout), "engine": "trtllm"})})
    with pytest.raises(EngineError, match="rollout.engine 'trtllm' is unavailable"):
        build_engine(lacking, TOK)


def test_inference_settings_are_checked(cfg, tmp_path):
    from spade_mega.config.errors import ConfigError

    with pytest.raises(ConfigError, match="inference.max_batch_size"):
        load_config(CONFIG, ["inference.max_batch_size=0"])
    with pytest.raises(EngineError, match="prefill_tokens must be >= 1, got 0"):
        make_engine(cfg.model, prefill_tokens=0)
    with pytest.raises(EngineError, match=r"inference.hf_weights: .*: no \*.safetensors files"):
        make_engine(cfg.model, weights_path=str(tmp_path))


def test_a_damaged_weights_file_is_named(cfg, tmp_path):
    """inference.hf_weights with a shard cut short (an interrupted copy): the error names the file, as a SpadeError."""
    build_hf_model(cfg.model, dtype=torch.float32, device=torch.device("cpu")).save_pretrained(tmp_path)
    shard, = tmp_path.glob("*.safetensors")
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(EngineError, match=f"inference.hf_weights: cannot read {shard}: .*incomplete"):
        make_engine(cfg.model, weights_path=str(tmp_path))


def test_a_closed_engine_says_so(cfg):
    engine = make_engine(cfg.model)
    engine.close()
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        engine.generate([request("x", max_new_tokens=1)])
