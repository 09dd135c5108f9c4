"""From one rollout's trajectories to the optimizer steps: per-role GRPO advantages, then TrainSamples in batches.

Agent trajectories are grouped by environment (normalised within the group), designer trajectories by skill (centred,
times ``env_reward_scale``); both go through the one advantage op (:func:`spade_mega.kernels.grpo.sample_advantages`,
the Triton kernel when ``kernels.enabled``). With ``rl.filter_zero_std_groups`` the agent groups whose rewards are all
equal (advantage 0 everywhere) are marked filtered and left out of the steps (DAPO's dynamic sampling). Every sample
keeps its behaviour log-probs as ``rollout_logprobs`` for truncated importance sampling: the delayed designer samples
were generated several optimizer steps ago, and the engine's numerics differ from the trainer's even for fresh ones.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from spade_mega.config.schema import KernelsConfig, RLConfig
from spade_mega.megatron.batch import Role, TrainSample
from spade_mega.rl.advantages import AGENT, DESIGNER, ids_of


@dataclass(frozen=True)
class Trajectory:
    """One sequence to train on: its tokens as generated, its reward and the group its advantage is relative to
    (the environment for the agent, the skill for the designer). ``valid`` False: a designer sample whose reward is
    masked (nothing measured); it takes no part in its skill's mean and is not trained on. ``filtered``: an agent
    sample of a group whose rewards are all equal, dropped by ``rl.filter_zero_std_groups`` (its advantage, 0, is
    still computed and recorded)."""

    token_ids: Sequence[int]
    loss_mask: Sequence[int]
    behaviour_logprobs: Sequence[float]
    role: Role
    reward: float
    group: str
    valid: bool = True
    filtered: bool = False

    @property
    def trains(self) -> bool:
        """Whether it becomes a TrainSample of the rollout's optimizer steps."""
        return self.valid and not self.filtered


def filter_zero_std_groups(trajectories: Sequence[Trajectory]) -> tuple[list[Trajectory], int]:
    """DAPO's dynamic-sampling filter: the agent trajectories of every group whose rewards are all equal (as the
    advantage op reads them, in float32), marked ``filtered``; and how many groups that is. Such a group's advantages
    are exactly 0, so its samples carry no policy gradient and would only dilute the token-mean loss. A group of one
    (its other plays broke) is one of them. Designer trajectories are never filtered: they are centred per skill and
    paid by regret. The same order; a filtered trajectory is a copy holding the same token lists (the transcript finds
    its record by them)."""
    rewards: dict[str, list[float]] = {}
    for t in trajectories:
        if t.role == "agent":
            rewards.setdefault(t.group, []).append(t.reward)
    flat = set()
    for group, values in rewards.items():
        as_read = torch.tensor(values, dtype=torch.float32)
        if bool((as_read == as_read[0]).all()):
            flat.add(group)
    return [replace(t, filtered=True) if t.role == "agent" and t.group in flat else t for t in trajectories], len(flat)


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
    """TrainSamples of the trajectories that train (valid, not filtered), each token of the model's own output carrying
    its sample's advantage."""
    out = []
    for t, adv in zip(trajectories, advantages.tolist()):
        if not t.trains:
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
