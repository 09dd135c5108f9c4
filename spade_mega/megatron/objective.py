"""What the train step computes from the model's output: per-token log-probs (and entropy) from the vocab-parallel
logits, then the GRPO policy loss of spade_mega.rl.loss. The log-probs go through the switch point of the Triton
kernels (spade_mega.kernels.grpo, ``kernels.enabled``): fused kernels when enabled, the plain-torch references
otherwise; this module is the one place the train step gets them from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from spade_mega.config.errors import ConfigError
from spade_mega.config.schema import KernelsConfig, RLConfig
from spade_mega.rl.loss import SampleSums, kl_to_reference, policy_loss


def _tp_group() -> Any:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None


@dataclass(frozen=True)
class Objective:
    """The GRPO objective on logits whose last dimension is this rank's vocabulary slice (Megatron's layout)."""

    rl: RLConfig
    kernels: KernelsConfig
    temperature: float

    @property
    def needs_entropy(self) -> bool:
        return self.rl.entropy_coef > 0

    def token_logprobs(self, logits: torch.Tensor, labels: torch.Tensor,
                       loss_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """log p(labels) under ``softmax(logits / temperature)`` (and the entropy when the loss needs it),
        differentiable; positions outside ``loss_mask`` (when given) are 0 and not computed."""
        from spade_mega.kernels import grpo  # imports triton: only when a model is trained

        return grpo.token_logprobs(logits, labels, self.kernels, temperature=self.temperature, loss_mask=loss_mask,
                                   with_entropy=self.needs_entropy, tp_group=_tp_group())

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, old_logprobs: torch.Tensor,
                 advantages: torch.Tensor, loss_mask: torch.Tensor, sample_ids: torch.Tensor, *,
                 rollout_logprobs: Optional[torch.Tensor], normalizer: float,
                 sample_sums: Optional[SampleSums] = None, ref_logprobs: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss share of one packed micro-batch ([1, L] inputs, or a context-parallel shard of one with its
        ``sample_sums``) and its metrics: policy_loss's, and with ``ref_logprobs`` also ``kl_tokens``, the detached
        per-token KL estimate ([L], 0 off the loss mask) that the train step splits by role."""
        logprobs, entropy = self.token_logprobs(logits, labels, loss_mask)

        def flat(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.reshape(-1)

        loss, metrics = policy_loss(flat(logprobs), flat(old_logprobs), flat(advantages), flat(loss_mask), self.rl,
                                    rollout_logprobs=flat(rollout_logprobs), ref_logprobs=flat(ref_logprobs),
                                    entropy=flat(entropy), sample_ids=flat(sample_ids), normalizer=normalizer,
                                    sample_sums=sample_sums)
        if ref_logprobs is not None:
            kl = kl_to_reference(flat(logprobs).detach().float(), flat(ref_logprobs).float(), self.rl.kl_estimator)
            metrics["kl_tokens"] = torch.where(flat(loss_mask).bool(), kl, torch.zeros_like(kl))
        return loss, metrics


def select_objective(rl: RLConfig, kernels: KernelsConfig, temperature: float) -> Objective:
    """The objective of a run: the sampling temperature its log-probs are taken at, the kernels switch."""
    if temperature <= 0:
        raise ConfigError("rollout.temperature", f"the trained log-probs are taken at the sampling temperature, "
                                                 f"which must be > 0 (greedy rollouts cannot be trained on), "
                                                 f"got {temperature}")
    return Objective(rl=rl, kernels=kernels, temperature=temperature)
