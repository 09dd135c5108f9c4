"""Scenarios of the KL-to-reference tests (rl.kl_coef > 0), run under torchrun (gloo, CPU, one thread per process).
Results go to --out as JSON and .pt files that tests/megatron/test_megatron_kl.py compares; nothing is asserted here.

  straight  any layout: a new run's reference (prepare_reference), steps on batches A, B, C (a checkpoint after B,
            one process), the reference log-probs of A with the weights checked bit for bit around the swap, a
            fourth step on A; with --init, reference and policy are read from that step-0 checkpoint (another layout
            compared with one process). One process also saves that step-0 checkpoint first and runs the gradient
            check: a step with the KL term against a step without it whose advantages carry the KL's derivative
  resumed   one process: what cannot be a reference is refused; a run resumed from the straight run's checkpoint
            (prepare_reference, then its load): the reference log-probs of A, the steps on C and A; one whose initial
            weights are the straight run's as a Hugging Face folder (inference.hf_weights): the reference log-probs;
            a new run whose rl.reference names the straight run's step-2 checkpoint: its policy and reference
  plain     one process, rl.kl_coef 0: the first step on batch A
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from megatron_worker import config, is_rank0, make_batch, worker_main, write_json


def weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in trainer.model for p in chunk.module.parameters()]


def grads(trainer) -> torch.Tensor:
    """This rank's reduced gradients of the last step (the grad buffers stay filled until the next step)."""
    return torch.cat([buffer.grad_data.detach().clone().reshape(-1) for chunk in trainer.model
                      for buffer in chunk.buffers + chunk.expert_parallel_buffers])


def as_lists(values: list[torch.Tensor]) -> list[list[float]]:
    return [v.tolist() for v in values]


def scenario_straight(args) -> None:
    from spade_mega.megatron import Trainer
    from spade_mega.megatron.reference import prepare_reference

    trainer = Trainer(config(args.overrides))
    if args.init is None:  # the initial weights as a step-0 checkpoint (the model only) and a Hugging Face folder
        from spade_mega.bridge import save_hf
        from spade_mega.tokenizer import byte_tokenizer

        trainer.save(str(args.out / "init"))
        save_hf(trainer, args.out / "hf_init", tokenizer=byte_tokenizer())
    prepare_reference(trainer, None)
    if args.init is not None:
        trainer.load(args.init)
    batch = make_batch(1)
    result = {"initial_logprobs": as_lists(trainer.logprobs(batch)), "reference_ready_before_step": None}
    result["reference_ready_before_step"] = trainer.reference.ready
    result["step1"] = trainer.train_step(make_batch(1)).metrics
    result["step2"] = trainer.train_step(make_batch(2)).metrics
    if args.init is None:
        trainer.save(str(args.out / "straight"))
        result["step2_logprobs"] = as_lists(trainer.logprobs(batch))
    result["step3"] = trainer.train_step(make_batch(3)).metrics
    before = weights(trainer)
    result["policy_logprobs"] = as_lists(trainer.logprobs(batch))
    result["reference_logprobs"] = as_lists(trainer.reference_logprobs(batch))
    after = weights(trainer)
    result["weights_bit_exact_after_swap"] = all(torch.equal(a, b) for a, b in zip(before, after))
    result["step4"] = trainer.train_step(make_batch(1)).metrics
    if args.init is None:
        result["gradient"] = gradient_check(trainer, args)
    write_json(args.out / f"{args.tag}.json", result)


def gradient_check(trainer, args) -> dict:
    """From the current weights (away from the reference): one step on batch A with the KL term, and one step from
    the same state (restored from a checkpoint) on A with the KL term's derivative moved into the advantages and a
    reference that adds no gradient (ref = current, where every estimator's derivative is 0 but k1's, whose
    derivative 1 is the same on both sides). With old = current log-probs the PPO ratio is 1 (nothing clipped), so
    the per-token gradient is (-A + kl_coef * dKL/dlp) * dlp: equal gradients iff the trainer adds kl_coef times
    rl.loss.kl_to_reference to the loss. The step's loss against rl.loss.policy_loss on the whole batch too."""
    from spade_mega.rl.loss import kl_to_reference, policy_loss

    rl = trainer.cfg.rl
    trainer.save(str(args.out / "before_gradient"))
    batch = make_batch(4)
    current = trainer.logprobs(batch)
    reference = trainer.reference_logprobs(batch)
    for sample, lp, ref in zip(batch, current, reference):
        sample.old_logprobs, sample.rollout_logprobs, sample.ref_logprobs = lp, None, ref
    with_kl = trainer.train_step(batch).metrics
    g_kl = grads(trainer)

    width = max(len(s) for s in batch)

    def rows(values: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.cat([v.double(), v.new_zeros(width - len(v)).double()]) for v in values])

    mask = rows([s.loss_mask.double() for s in batch]).bool()
    loss, _ = policy_loss(rows(current), rows(current), rows([s.advantages for s in batch]), mask, rl,
                          ref_logprobs=rows(reference))

    trainer.load(str(args.out / "before_gradient"))
    shifted = make_batch(4)
    for sample, lp, ref in zip(shifted, current, reference):
        x = lp.double().clone().requires_grad_(True)
        kl_to_reference(x, ref.double(), rl.kl_estimator).sum().backward()
        y = lp.double().clone().requires_grad_(True)
        kl_to_reference(y, lp.double(), rl.kl_estimator).sum().backward()
        derivative = (x.grad - y.grad).float()
        sample.advantages = torch.where(sample.loss_mask, sample.advantages - rl.kl_coef * derivative, 0.0)
        sample.old_logprobs, sample.rollout_logprobs, sample.ref_logprobs = lp, None, lp
    without_kl = trainer.train_step(shifted).metrics
    g_shifted = grads(trainer)
    if is_rank0():
        torch.save({"with_kl": g_kl, "shifted": g_shifted}, args.out / "gradients.pt")
    return {"with_kl": with_kl, "shifted": without_kl, "policy_loss": float(loss)}


def scenario_resumed(args) -> None:
    """Refusals first (on the fresh trainer, which they must leave as it is), then the resume, then a second trainer
    resumed the same way but whose initial weights are a Hugging Face folder (inference.hf_weights)."""
    import json
    import shutil

    from spade_mega.config.errors import ConfigError
    from spade_mega.megatron import Trainer
    from spade_mega.megatron.reference import load_reference, prepare_reference

    trainer = Trainer(config(args.overrides))
    checkpoint = sorted(Path(args.load).glob("step_*"))[-1]  # the step folder, as the loop resumes from
    initial = weights(trainer)
    refused = {}
    empty = args.out / "empty"
    empty.mkdir(exist_ok=True)
    other_layout = args.out / "other_layout" / checkpoint.name
    shutil.copytree(checkpoint, other_layout, dirs_exist_ok=True)
    manifest = json.loads((other_layout / "spade_checkpoint.json").read_text())
    manifest["layout"] = "TP2 PP1 EP2 ETP2 DP1"  # as if saved by a two-GPU run
    (other_layout / "spade_checkpoint.json").write_text(json.dumps(manifest))
    attempts = {"missing": lambda: load_reference(trainer, str(args.out / "missing")),
                "not_a_checkpoint": lambda: load_reference(trainer, str(empty)),
                "other_layout": lambda: prepare_reference(trainer, other_layout)}
    for name, attempt in attempts.items():
        try:
            attempt()
            refused[name] = None
        except ConfigError as exc:
            refused[name] = {"path": exc.path, "message": str(exc)}
    untouched = all(torch.equal(a, b) for a, b in zip(initial, weights(trainer)))

    prepare_reference(trainer, checkpoint)
    trainer.load(str(checkpoint))
    batch = make_batch(1)
    result = {"refused": refused, "weights_untouched_by_refusals": untouched,
              "reference_logprobs": as_lists(trainer.reference_logprobs(batch)),
              "step3": trainer.train_step(make_batch(3)).metrics,
              "step4": trainer.train_step(make_batch(1)).metrics}
    from_hf = Trainer(config([*args.overrides, f"inference.hf_weights={args.out / 'hf_init'}", "run.seed=7"]))
    prepare_reference(from_hf, checkpoint)  # another seed: only the folder can give the initial weights back
    from_hf.load(str(checkpoint))
    result["hf_reference_logprobs"] = as_lists(from_hf.reference_logprobs(batch))
    named = Trainer(config([*args.overrides, f"rl.reference={checkpoint}"]))  # a new run, a step-2 reference
    schedule = (named.scheduler.num_steps, named.optimizer.param_groups[0]["lr"])
    prepare_reference(named, None)
    result["named"] = {"step": named.step, "schedule_kept": schedule == (named.scheduler.num_steps,
                                                                         named.optimizer.param_groups[0]["lr"]),
                       "policy_logprobs": as_lists(named.logprobs(batch)),
                       "reference_logprobs": as_lists(named.reference_logprobs(batch))}
    result["loop"] = loop_metrics(from_hf, args)
    write_json(args.out / f"{args.tag}.json", result)


def loop_metrics(trainer, args) -> dict:
    """The self-play loop's optimizer steps of one rollout (SelfPlay._train) in steps of two samples, the first of
    them without a designer sample: the KL metrics it writes for the rollout."""
    from spade_mega.selfplay.batch import optimizer_batches
    from spade_mega.selfplay.loop import SelfPlay
    from spade_mega.selfplay.state import derive_seed

    cfg = config([*args.overrides, "selfplay.global_batch_size=2", f"run.output_dir={args.out / 'loop'}"])
    samples = make_batch(2)
    for sample in samples:
        sample.old_logprobs = None  # the loop takes them from the trainer
    rollout = next(r for r in range(1, 100) if all(
        s.role == "agent" for s in optimizer_batches(samples, 2, derive_seed(cfg.run.seed, "batch", r))[0]))
    metrics, _ = SelfPlay(cfg)._train(trainer, samples, rollout)
    return {k: v for k, v in metrics.items() if k.startswith("train/kl") or k == "train/steps"}


def scenario_plain(args) -> None:
    """One process, the KL term off: the first step on batch A (the straight run's step 1, where the reference is
    the policy and the KL term adds nothing, but the reference forward runs)."""
    from spade_mega.megatron import Trainer

    trainer = Trainer(config(args.overrides))
    write_json(args.out / f"{args.tag}.json", {"step1": trainer.train_step(make_batch(1)).metrics})


def options(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(tag="straight")
    parser.add_argument("--init", default=None)
    parser.add_argument("--load", default=None)


if __name__ == "__main__":
    worker_main(globals(), options)
