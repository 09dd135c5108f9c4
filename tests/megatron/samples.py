"""The training batches of the Megatron worker scenarios: multi-turn samples of both roles whose behaviour and old
log-probs differ from the policy's, so that the PPO ratio, clipping and truncated IS are all active, with advantages
of both signs. Each worker chooses the lengths (how the samples pack into rows) and the model turns' spans."""

from __future__ import annotations

import math
from typing import Sequence

VOCAB = 512


def make_batch(seed: int, lengths: Sequence[int], turns: Sequence[tuple[int, int]]) -> list:
    """One sample per length; ``turns``: the loss mask's (start, stop) slices (a negative stop counts from the end:
    -1 leaves the last token out), the tokens between them environment observations. Every third sample is the
    designer's."""
    import torch

    from spade_mega.megatron import TrainSample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate(lengths):
        tokens = torch.randint(0, VOCAB, (n,), generator=g)
        mask = torch.zeros(n, dtype=torch.bool)
        for start, stop in turns:
            mask[start:stop] = True
        adv = torch.where(mask, torch.tensor(float((-1) ** i) * (0.5 + i / 10)), torch.tensor(0.0))
        old = -math.log(VOCAB) + 0.3 * torch.randn(n, generator=g)
        rollout = old + 0.2 * torch.randn(n, generator=g)
        samples.append(TrainSample(tokens, mask, adv, role="designer" if i % 3 == 2 else "agent",
                                   old_logprobs=old, rollout_logprobs=rollout))
    return samples
