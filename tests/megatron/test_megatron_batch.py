"""Training samples and their packing into micro-batches by a token budget (plain data: no model, no processes)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spade_mega.megatron import BatchError, TrainSample, pack, samples_from


def multi_turn(n: int, seed: int = 0, role: str = "agent") -> TrainSample:
    """prompt (3 tokens), then model turns of 3 tokens alternating with 2 observation tokens."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n, dtype=torch.bool)
    for start in range(3, n, 5):
        mask[start:start + 3] = True
    return TrainSample(torch.randint(0, 100, (n,), generator=g), mask, torch.where(mask, 0.5, 0.0), role=role,
                       old_logprobs=-torch.rand(n, generator=g), rollout_logprobs=-torch.rand(n, generator=g))


def test_a_row_holds_whole_samples_with_shifted_labels_and_values() -> None:
    batch = samples_from([multi_turn(9, 1), multi_turn(7, 2, "designer")])
    plan = pack(batch, token_budget=20)
    assert plan.num_micro_batches == 1
    mb = plan.micro_batches[0][0]
    assert mb.samples == [0, 1] and mb.cu_seqlens.tolist() == [0, 9, 16]
    first, second = batch
    assert mb.tokens[0, :9].tolist() == first.tokens.tolist()
    assert mb.labels[0, :8].tolist() == first.tokens[1:].tolist()  # position t predicts token t + 1
    assert mb.loss_mask[0, :8].tolist() == first.loss_mask[1:].tolist() and not mb.loss_mask[0, 8]
    assert torch.equal(mb.old_logprobs[0, 9:15], second.old_logprobs[1:])
    assert torch.equal(mb.rollout_logprobs[0, 9:15], second.rollout_logprobs[1:])
    assert mb.position_ids[0].tolist() == list(range(9)) + list(range(7))
    assert mb.sample_ids[0].tolist() == [0] * 9 + [1] * 7


def test_attention_never_crosses_samples() -> None:
    mb = pack(samples_from([multi_turn(4), multi_turn(3)]), token_budget=8, length_multiple=4).micro_batches[0][0]
    assert mb.length == 8  # 7 tokens padded to a multiple of 4
    allowed = ~mb.attention_mask()[0, 0]
    seg = [0] * 4 + [1] * 3 + [2]
    for q in range(8):
        for k in range(8):
            assert bool(allowed[q, k]) == (seg[q] == seg[k] and k <= q), (q, k)
    assert mb.sample_ids[0, 7] == -1 and not mb.loss_mask[0, 7]


def test_budget_data_parallel_split_and_equal_micro_batch_counts() -> None:
    batch = samples_from([multi_turn(n, n) for n in (16, 16, 12, 12, 10, 10, 5)])
    plan = pack(batch, token_budget=18, data_parallel=2)
    assert len(plan.micro_batches) == 2
    assert len(plan.micro_batches[0]) == len(plan.micro_batches[1]) == plan.num_micro_batches
    seen = sorted(i for rank in plan.micro_batches for mb in rank for i in mb.samples)
    assert seen == list(range(7))  # every sample exactly once
    empty = [mb for rank in plan.micro_batches for mb in rank if not mb.samples]
    assert all(not mb.loss_mask.any() for mb in empty)


def test_rows_padded_for_sequence_parallelism_stay_within_the_token_budget() -> None:
    """Budget 10, rows a multiple of 4: a row holds at most 8 tokens (12 after padding would exceed the budget the
    user sized the memory by), and a sample of 9 or 10 tokens is refused with the reason."""
    plan = pack(samples_from([multi_turn(n, n) for n in (8, 5, 3)]), token_budget=10, length_multiple=4)
    assert all(mb.length <= 10 for mb in plan.micro_batches[0])
    with pytest.raises(BatchError, match=r"sample 0 has 9 tokens.*8 = parallel.max_tokens_per_gpu \(10\) rounded down"):
        pack(samples_from([multi_turn(9)]), token_budget=10, length_multiple=4)


def test_interleaved_schedule_gets_a_multiple_of_the_pipeline_size() -> None:
    plan = pack(samples_from([multi_turn(10, i) for i in range(3)]), token_budget=10, count_multiple=2)
    assert plan.num_micro_batches == 4


def test_packing_is_deterministic() -> None:
    batch = samples_from([multi_turn(n, n) for n in (7, 13, 5, 9, 11, 3)])
    a = pack(batch, token_budget=16, data_parallel=2)
    b = pack(batch, token_budget=16, data_parallel=2)
    assert [[mb.samples for mb in rank] for rank in a.micro_batches] == \
        [[mb.samples for mb in rank] for rank in b.micro_batches]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(2, 40), min_size=1, max_size=20), budget=st.integers(40, 90),
       dp=st.integers(1, 4), multiple=st.sampled_from([1, 2, 4]))
def test_packing_properties(lengths: list[int], budget: int, dp: int, multiple: int) -> None:
    batch = samples_from([TrainSample(torch.arange(n) % 7, torch.arange(n) > 0, torch.ones(n)) for n in lengths])
    plan = pack(batch, token_budget=budget, data_parallel=dp, length_multiple=multiple)
    placed = []
    for rank in plan.micro_batches:
        assert len(rank) == plan.num_micro_batches
        for mb in rank:
            used = sum(lengths[i] for i in mb.samples)
            assert used <= budget and mb.length % multiple == 0 and used <= mb.length < used + multiple + 1
            assert mb.length <= budget  # padding included
            assert int(mb.loss_mask.sum()) == sum(lengths[i] - 1 for i in mb.samples)
            placed += mb.samples
    assert sorted(placed) == list(range(len(lengths)))


@pytest.mark.parametrize("make, words", [
    (lambda: TrainSample([1], [False], [0.0]), "at least 2 tokens"),
    (lambda: TrainSample([1, 2, 3], [False, True], [0.0, 0.0, 0.0]), "loss_mask has 2 values for 3 tokens"),
    (lambda: TrainSample([1, 2], [True, True], [0.0, 0.0]), "loss_mask[0] is true"),
    (lambda: TrainSample([[1, 2]], [[False, True]], [[0.0, 0.0]]), "must be 1-D"),
    (lambda: TrainSample([1, 2], [False, True], [0.0, float("nan")]), "advantages is not finite"),
    (lambda: TrainSample([-1, 2], [False, True], [0.0, 1.0]), "tokens must be >= 0"),
    (lambda: TrainSample([1.0, 2.7], [False, True], [0.0, 1.0]), "tokens must be integer token ids"),
    (lambda: TrainSample([1, 2], [False, True], [0.0, 1.0], role="judge"), "role must be one of"),
    # values that are not a sequence of numbers: named, not torch's "Could not infer dtype of NoneType"
    (lambda: TrainSample([1, 2], None, [0.0, 1.0]), "loss_mask must be a sequence of numbers, got None"),
    (lambda: TrainSample([1, 2], [False, True], None), "advantages must be a sequence of numbers, got None"),
    (lambda: TrainSample("hello", [False, True], [0.0, 1.0]), "tokens must be a sequence of numbers, got str"),
    (lambda: TrainSample([[1, 2], [3]], [False, True], [0.0, 1.0]), "tokens must be a sequence of numbers"),
    (lambda: TrainSample([1, 2**70], [False, True], [0.0, 1.0]), "tokens must be a sequence of numbers"),
    (lambda: TrainSample([1, 2], [False, True], ["a", "b"]), "advantages must be a sequence of numbers"),
    (lambda: TrainSample([], [], []), "at least 2 tokens"),  # not "integer token ids, got float32"
    (lambda: TrainSample([True, False], [False, True], [0.0, 1.0]), "tokens must be integer token ids, got torch.bool"),
])
def test_bad_samples_are_rejected_with_the_field_named(make, words: str) -> None:
    with pytest.raises(BatchError) as err:
        make()
    assert words in str(err.value)


def test_batch_level_errors() -> None:
    with pytest.raises(BatchError, match="parallel.max_tokens_per_gpu = 8"):
        pack(samples_from([multi_turn(9)]), token_budget=8)
    with pytest.raises(BatchError, match="empty"):
        samples_from([])
    with pytest.raises(BatchError, match="a sequence of TrainSample, got one TrainSample"):
        samples_from(multi_turn(5))  # type: ignore[arg-type]
    with pytest.raises(BatchError, match="batch item 1 is a dict, not a TrainSample"):
        samples_from([multi_turn(5), {"tokens": [1, 2]}])  # type: ignore[list-item]
    mixed = samples_from([multi_turn(5), TrainSample([1, 2], [False, True], [0.0, 1.0])])
    with pytest.raises(BatchError, match="rollout_logprobs missing"):
        pack(mixed, token_budget=10)


@pytest.mark.parametrize("budget", [10, 5])
def test_rollout_logprobs_for_some_samples_only_are_refused_however_the_batch_is_packed(budget: int) -> None:
    """Truncated IS needs the behaviour log-probs of every sample (a delayed designer sample trained without them
    would silently skip its correction): refused whether or not the samples share a row."""
    mixed = samples_from([multi_turn(5), TrainSample([1, 2], [False, True], [0.0, 1.0])])
    with pytest.raises(BatchError, match="sample 1: rollout_logprobs missing"):
        pack(mixed, token_budget=budget)
