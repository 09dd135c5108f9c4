"""What the train step computes from the model's output: per-token log-probs from vocab-parallel logits, and the GRPO
policy loss (spade_mega.rl.loss). :func:`select_objective` is the one place that chooses their implementation; the
Triton kernels plug in here behind ``kernels.enabled``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from spade_mega.config.schema import RLConfig
from spade_mega.rl.loss import policy_loss

LogprobFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
EntropyFn = Callable[[torch.Tensor, float], torch.Tensor]


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(labels) under ``softmax(logits / temperature)``, where each tensor-parallel rank holds a vocabulary slice
    of ``logits`` [..., V / TP]. Differentiable; the full vocabulary is never gathered."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = logits.float() / temperature  # a fresh tensor: the cross entropy works in place on its input
    return -vocab_parallel_cross_entropy(scaled, labels)


def vocab_parallel_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-token entropy of ``softmax(logits / temperature)`` over vocabulary slices; differentiable.

    H = log Z - sum(e^z z) / Z with z = logits - max, Z = sum(e^z): both sums are reduced over the tensor-parallel
    group (all-reduce forward, identity backward: each rank's partial sum enters the total once)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    scaled = logits.float() / temperature
    peak = scaled.detach().amax(dim=-1, keepdim=True)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = scaled - peak
    exp = shifted.exp()
    total = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    weighted = reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1))
    return total.log() - weighted / total


@dataclass(frozen=True)
class Objective:
    """Log-probs, entropy and loss implementations with the settings they need."""

    rl: RLConfig
    temperature: float
    token_logprobs: LogprobFn
    token_entropy: EntropyFn
    loss: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

    @property
    def needs_entropy(self) -> bool:
        return self.rl.entropy_coef > 0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, old_logprobs: torch.Tensor,
                 advantages: torch.Tensor, loss_mask: torch.Tensor, sample_ids: torch.Tensor, *,
                 rollout_logprobs: Optional[torch.Tensor], normalizer: float
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss share of one packed micro-batch ([1, L] inputs) and its metrics."""
        logprobs = self.token_logprobs(logits, labels, self.temperature)
        entropy = self.token_entropy(logits, self.temperature) if self.needs_entropy else None
        flat = lambda t: None if t is None else t.reshape(-1)  # noqa: E731
        return self.loss(flat(logprobs), flat(old_logprobs), flat(advantages), flat(loss_mask), self.rl,
                         rollout_logprobs=flat(rollout_logprobs), entropy=flat(entropy),
                         sample_ids=flat(sample_ids), normalizer=normalizer)


def select_objective(rl: RLConfig, temperature: float) -> Objective:
    """The objective for this run (plain torch reference implementations)."""
    if temperature <= 0:
        raise ValueError(f"log-probs need a sampling temperature > 0, got {temperature}")
    return Objective(rl=rl, temperature=temperature, token_logprobs=vocab_parallel_logprobs,
                     token_entropy=vocab_parallel_entropy, loss=policy_loss)
