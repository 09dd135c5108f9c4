"""Scenarios the Megatron tests run under torchrun (gloo, CPU, one thread per process). Results go to --out as JSON and
.pt files that the tests compare; nothing is asserted here.

  reference  one process: save the initial checkpoint, one training step on batch A, save it
  layout     any layout: load the initial checkpoint, one step on batch A, save it; with --continue also the logits
             of batch B and two more steps (B, C): the uninterrupted run
  resume     any layout: load --load, logits of batch B, steps B and C; with --dump, first load each --dump
             checkpoint and write its full weights (needs one process)
  grpo       one process: GRPO on "a+b=" (one-digit sums) for --steps steps, mean reward per step
  killsave   one process: a complete checkpoint, then a second save that the test kills
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

VOCAB = 512


def config(overrides: list[str]):
    from spade_mega.config.loader import apply_overrides, build, to_dict
    from spade_mega.config.schema import SpadeConfig

    base = to_dict(SpadeConfig())
    base["optimizer"].update(lr=1e-4, clip_grad=1.0)
    base["parallel"]["max_tokens_per_gpu"] = 18  # every sample of make_batch fills a micro-batch alone
    cfg = build(SpadeConfig, apply_overrides(base, overrides))
    cfg.check()
    return cfg


def make_batch(seed: int):
    """Six multi-turn samples of both roles with behaviour and old log-probs that differ from the policy's, so the
    PPO ratio, clipping and truncated IS are all active. Lengths come in equal pairs: with the token budget of 18 each
    sample is a micro-batch of its own in every layout (the MoE load-balancing loss depends on a micro-batch's
    composition, so layouts are compared on the same compositions)."""
    import torch

    from spade_mega.megatron import TrainSample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate((16, 16, 12, 12, 10, 10)):
        tokens = torch.randint(0, VOCAB, (n,), generator=g)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[3:6] = True  # first model turn
        mask[8:n - 1] = True  # second model turn, after an environment observation at 6..7
        adv = torch.where(mask, torch.tensor(float((-1) ** i) * (0.5 + i / 10)), torch.tensor(0.0))
        old = -math.log(VOCAB) + 0.3 * torch.randn(n, generator=g)
        rollout = old + 0.2 * torch.randn(n, generator=g)
        samples.append(TrainSample(tokens, mask, adv, role="designer" if i % 3 == 2 else "agent",
                                   old_logprobs=old, rollout_logprobs=rollout))
    return samples


def is_rank0() -> bool:
    import torch.distributed as dist

    return dist.get_rank() == 0


def write_json(path: Path, data: dict) -> None:
    if is_rank0():
        path.write_text(json.dumps(data, indent=1))


def logits_of(trainer, samples) -> "object":
    import torch

    return torch.cat(trainer.logits(samples))


def scenario_reference(args, trainer) -> None:
    trainer.save(str(args.out / "init"))
    step = trainer.train_step(make_batch(1))
    trainer.save(str(args.out / "reference"))
    write_json(args.out / "reference.json", {"step1": step.metrics})


def scenario_layout(args, trainer) -> None:
    import torch

    trainer.load(str(args.out / "init"))
    result = {"step1": trainer.train_step(make_batch(1)).metrics}
    trainer.save(str(args.out / args.tag))
    if args.continue_run:
        logits = logits_of(trainer, make_batch(2))
        if is_rank0():
            torch.save(logits, args.out / f"{args.tag}_logits.pt")
        result["step2"] = trainer.train_step(make_batch(2)).metrics
        result["step3"] = trainer.train_step(make_batch(3)).metrics
    write_json(args.out / f"{args.tag}.json", result)


def scenario_resume(args, trainer) -> None:
    import torch

    for name in args.dump:
        trainer.load(str(args.out / name))
        weights = {n: p.detach().clone() for n, p in trainer.model[0].module.named_parameters()}
        torch.save(weights, args.out / f"{name}_weights.pt")
    step = trainer.load(args.load)
    logits = logits_of(trainer, make_batch(2))
    if is_rank0():
        torch.save(logits, args.out / f"{args.tag}_logits.pt")
    result = {"loaded_step": step, "step2": trainer.train_step(make_batch(2)).metrics,
              "step3": trainer.train_step(make_batch(3)).metrics}
    write_json(args.out / f"{args.tag}.json", result)


def scenario_grpo(args, trainer) -> None:
    """GRPO on a verifiable reward: the prompt "a+b=" (a + b <= 9), one answer token, reward 1 if it is the sum."""
    import torch

    from spade_mega.megatron import TrainSample
    from spade_mega.rl.advantages import agent_advantages

    digits = [ord(str(d)) for d in range(10)]
    g = torch.Generator().manual_seed(0)
    pairs = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]
    group = 8
    rewards = []
    for _ in range(args.steps):
        picks = torch.randint(len(pairs), (8,), generator=g).tolist()
        prompts = [torch.tensor([ord(c) for c in f"{pairs[k][0]}+{pairs[k][1]}="]) for k in picks]
        # sample the answers from the policy itself (temperature 1): logits of the position after each prompt
        probe = [TrainSample(torch.cat([p, p.new_zeros(1)]), torch.zeros(len(p) + 1, dtype=torch.bool),
                             torch.zeros(len(p) + 1)) for p in prompts]
        next_logits = torch.stack([lg[-1] for lg in trainer.logits(probe)])
        answers = torch.multinomial(torch.softmax(next_logits, -1), group, replacement=True, generator=g)
        samples, reward, groups = [], [], []
        for k, prompt in enumerate(prompts):
            for token in answers[k].tolist():
                tokens = torch.cat([prompt, torch.tensor([token])])
                mask = torch.zeros(len(tokens), dtype=torch.bool)
                mask[-1] = True
                samples.append(TrainSample(tokens, mask, torch.zeros(len(tokens))))
                reward.append(float(token == digits[sum(pairs[picks[k]])]))
                groups.append(k)
        advantages = agent_advantages(torch.tensor(reward), torch.tensor(groups))
        for s, a in zip(samples, advantages.tolist()):
            s.advantages = torch.where(s.loss_mask, torch.tensor(a), torch.tensor(0.0))
        trainer.train_step(samples)
        rewards.append(sum(reward) / len(reward))
    write_json(args.out / "grpo.json", {"mean_reward": rewards})


def scenario_killsave(args, trainer) -> None:
    trainer.save(str(args.out / "ckpt"))
    trainer.train_step(make_batch(1))
    print("SAVING", flush=True)
    trainer.save(str(args.out / "ckpt"))
    print("SAVED", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["reference", "layout", "resume", "grpo", "killsave"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tag", default="run")
    parser.add_argument("--load")
    parser.add_argument("--dump", nargs="*", default=[])
    parser.add_argument("--continue-run", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()

    import torch

    torch.set_num_threads(1)
    from spade_mega.megatron import Trainer

    trainer = Trainer(config(args.overrides))
    globals()[f"scenario_{args.scenario}"](args, trainer)
    from spade_mega.megatron.parallel import shutdown

    shutdown()


if __name__ == "__main__":
    sys.exit(main())
