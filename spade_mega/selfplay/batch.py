"""From one rollout's trajectories to the optimizer steps: per-role GRPO advantages, then TrainSamples in batches.

Agent trajectories are grouped by environment (normalised within the group), designer trajectories by skill (centred,
times ``env_reward_scale``); both go through the one advantage op (:func:`spade_mega.kernels.grpo.sample_advantages`,
the Triton kernel when ``kernels.enabled``). Every sample keeps its behaviour log-probs as ``rollout_logprobs`` for
truncated importance sampling: the delayed designer samples were generated several optimizer steps ago, and the
engine's numerics differ from the trainer's even for fresh ones.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

import torch

from spade_mega.config.schema import KernelsConfig, RLConfig
from spade_mega.megatron.batch import Role, TrainSample
from spade_mega.rl.advantages import AGENT, DESIGNER, ids_of


@dataclass(frozen=True)
class Trajectory:
    """One sequence to train on: its tokens as generated, its reward and the group its advantage is relative to
    (the environment for the agent, the skill for the designer). ``valid`` False: a designer sample whose reward is
    masked (nothing measured); it takes no part in its skill's mean and is not trained on."""

    token_ids: Sequence[int]
    loss_mask: Sequence[int]
    behaviour_logprobs: Sequence[float]
    role: Role
    reward: float
    group: str
    valid: bool = True


def advantages(trajectories: Sequence[Trajectory], designer_scale: float, rl: RLConfig,
               kernels: KernelsConfig) -> torch.Tensor:
    """Per-sample advantages of a mixed batch (float32); masked designer samples get 0."""
    from spade_mega.kernels.grpo import sample_advantages

    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    roles = torch.tensor([DESIGNER if t.role == "designer" else AGENT for t in trajectories], dtype=torch.long)
    groups = ids_of([(t.role, t.group) for t in trajectories])
    valid = torch.tensor([t.valid for t in trajectories], dtype=torch.bool)
    return sample_advantages(rewards, groups, roles, groups, designer_scale, rl, kernels, valid=valid).samples


def train_samples(trajectories: Sequence[Trajectory], advantages: torch.Tensor) -> list[TrainSample]:
    """TrainSamples of the valid trajectories, each token of the model's own output carrying its sample's advantage."""
    out = []
    for t, adv in zip(trajectories, advantages.tolist()):
        if not t.valid:
            continue
        mask = torch.tensor(list(t.loss_mask), dtype=torch.bool)
        out.append(TrainSample(tokens=torch.tensor(list(t.token_ids), dtype=torch.long), loss_mask=mask,
                               advantages=torch.where(mask, torch.tensor(adv, dtype=torch.float32), 0.0),
                               role=t.role,
                               rollout_logprobs=torch.tensor(list(t.behaviour_logprobs), dtype=torch.float32)))
    return out


def optimizer_batches(samples: Sequence[TrainSample], global_batch_size: int, seed: int) -> list[list[TrainSample]]:
    """The rollout's samples in a seeded random order, cut into optimizer steps of ``global_batch_size`` (the last
    one may be smaller): shuffled, so that each step mixes environments, skills and roles."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    steps = math.ceil(len(order) / global_batch_size)
    return [[samples[i] for i in order[k * global_batch_size:(k + 1) * global_batch_size]] for k in range(steps)]
