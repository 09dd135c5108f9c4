"""The one switch point between the Triton kernels and the plain-torch GRPO ops: ``kernels.enabled``.

The trainer calls these functions whatever the switch says. Enabled, the fused kernels run where they can (CUDA
tensors; CPU under ``TRITON_INTERPRET=1``); disabled, or on a device without them, the references run. Either way the
result is the one ``spade_mega.rl`` specifies:

- :func:`token_logprobs`: per-token log-probs (and entropy) from the (vocab-parallel) logits with the fused
  online-softmax kernel and its backward: what a trainer that calls ``policy_loss`` itself plugs in.
- :func:`policy_loss_from_logits`: :func:`token_logprobs`, then ``rl.loss.policy_loss`` unchanged. The PPO-clip and
  TIS arithmetic on the per-token vectors stays in ``policy_loss``, so its aggregations, sequence-level TIS, KL and
  metrics hold exactly; the vocabulary-sized work, where all the memory traffic is, is the kernel's. (The op's own
  fused per-token loss, ``tis_logprob(..., old_logprobs, advantages)``, is checked against ``policy_loss`` and is what
  the benchmark compares with Liger's fused GRPO loss.)
- :func:`sample_advantages`: ``rl.advantages.grpo_advantages`` (and ``token_advantages`` for a ``[samples, tokens]``
  loss mask) as one fused launch.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from spade_mega.config.schema import KernelsConfig, RLConfig
from spade_mega.kernels.grpo_advantage import GrpoAdvantages, grpo_advantage
from spade_mega.kernels.tis_logprob import tis_logprob
from spade_mega.rl.loss import policy_loss


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, kernels: KernelsConfig, *, temperature: float,
                   loss_mask: Optional[torch.Tensor] = None, with_entropy: bool = False,
                   tp_group: Optional[dist.ProcessGroup] = None, vocab_start: Optional[int] = None
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of ``tokens`` under ``softmax(logits / temperature)`` (and the entropy, when asked), differentiable
    with respect to ``logits [..., vocab_shard]``. With tensor parallelism pass ``tp_group`` (and ``vocab_start``
    unless it is rank * shard width, Megatron's layout). Tokens outside ``loss_mask`` get 0 and are not read."""
    out = tis_logprob(logits, tokens, loss_mask=loss_mask, temperature=temperature, with_entropy=with_entropy,
                      tp_group=tp_group, vocab_start=vocab_start, use_kernels=kernels.enabled)
    return out.logprobs, out.entropy


def policy_loss_from_logits(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    rl: RLConfig,
    kernels: KernelsConfig,
    *,
    temperature: float,
    rollout_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    sample_ids: Optional[torch.Tensor] = None,
    normalizer: Optional[float] = None,
    with_entropy: bool = True,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_start: Optional[int] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``rl.loss.policy_loss`` from logits ``[..., vocab_shard]`` of the sampled ``tokens`` (same leading shape as
    the other per-token tensors) at the sampling ``temperature``. The entropy is computed when ``with_entropy``
    (reported as a metric) and always when ``rl.entropy_coef > 0``; ``tp_group``/``vocab_start`` as for
    :func:`token_logprobs`."""
    logprobs, entropy = token_logprobs(logits, tokens, kernels, temperature=temperature, loss_mask=loss_mask,
                                       with_entropy=with_entropy or rl.entropy_coef > 0, tp_group=tp_group,
                                       vocab_start=vocab_start)
    return policy_loss(logprobs, old_logprobs, advantages, loss_mask, rl, rollout_logprobs=rollout_logprobs,
                       ref_logprobs=ref_logprobs, entropy=entropy, sample_ids=sample_ids, normalizer=normalizer)


def sample_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    roles: torch.Tensor,
    skill_ids: torch.Tensor,
    designer_scale: float,
    rl: RLConfig,
    kernels: KernelsConfig,
    *,
    valid: Optional[torch.Tensor] = None,
    loss_mask: Optional[torch.Tensor] = None,
) -> GrpoAdvantages:
    """Per-role GRPO advantages of a mixed batch (``rl.adv_std_normalize``, ``rl.adv_eps``), and per token for a
    ``[samples, tokens]`` ``loss_mask``."""
    return grpo_advantage(rewards, group_ids, roles, skill_ids, designer_scale, std_normalize=rl.adv_std_normalize,
                          eps=rl.adv_eps, valid=valid, loss_mask=loss_mask, use_kernels=kernels.enabled)
