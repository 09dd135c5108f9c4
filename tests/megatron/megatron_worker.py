"""Scenarios the Megatron tests run under torchrun (gloo, CPU, one thread per process). Results go to --out as JSON and
.pt files that the tests compare; nothing is asserted here.

  reference  one process: save the initial checkpoint, one training step on batch A, save it; with --continue-run
             also the logits of batch B and two more steps (B, C)
  layout     any layout: load the initial checkpoint, one step on batch A, save it; with --continue also the logits
             of batch B and two more steps (B, C): the uninterrupted run
  resume     any layout: load --load, logits of batch B, steps B and C; with --dump, first load each --dump
             checkpoint and write its full weights (needs one process)
  weights    one process: only write the full weights of each --dump checkpoint
  grpo       one process: GRPO on "a+b=" (one-digit sums) for --steps steps, mean reward per step
  killsave   one process: a complete checkpoint, then a second save that the test kills
  schedule   one process: a checkpoint loaded by a run configured with another learning-rate schedule and other
             Adam hyper-parameters
  compat     which CPU shims install, and their patched behaviours (JSON on stdout)
  single     one process: packing and loss normalisation invariances
  padding    any layout: the MoE load-balancing loss and gradients of a padded row against the unpadded row
  qwen3_30b  the Qwen3-30B-A3B TransformerConfig and parameter counts on the meta device (JSON on stdout)
  models     one process: Trainers of 2, 4 and 2 layers built one after the other, one step each
  skip       any layout: a finite step, one whose gradients overflow (skipped), a finite step; per rank what moved
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

import samples
from samples import VOCAB


def config(overrides: list[str]):
    from spade_mega.config.loader import apply_overrides, build, to_dict
    from spade_mega.config.schema import SpadeConfig

    base = to_dict(SpadeConfig())
    base["optimizer"].update(lr=1e-4, clip_grad=1.0)
    base["parallel"]["max_tokens_per_gpu"] = 18  # every sample of make_batch fills a micro-batch alone
    cfg = build(SpadeConfig, apply_overrides(base, overrides))
    cfg.check()
    return cfg


LENGTHS = (16, 16, 12, 12, 10, 10)
TURNS = ((3, 6), (8, -1))  # two model turns, an environment observation at 6..7 between them


def make_batch(seed: int):
    """Six samples (samples.make_batch). Lengths come in equal pairs: with the token budget of 18 each sample is a
    micro-batch of its own in every layout (the MoE load-balancing loss depends on a micro-batch's composition, so
    layouts are compared on the same compositions)."""
    return samples.make_batch(seed, LENGTHS, TURNS)


def is_rank0() -> bool:
    import torch.distributed as dist

    return dist.get_rank() == 0


def write_json(path: Path, data: dict) -> None:
    if is_rank0():
        path.write_text(json.dumps(data, indent=1))


def logits_of(trainer, samples) -> "object":
    import torch

    return torch.cat(trainer.logits(samples))


def trainer_for(args):
    from spade_mega.megatron import Trainer

    return Trainer(config(args.overrides))


def continue_run(trainer, args, tag: str, result: dict) -> None:
    """After step 1: the logits of batch B, then steps on B and C (with --continue-run)."""
    import torch

    if not args.continue_run:
        return
    logits = logits_of(trainer, make_batch(2))
    if is_rank0():
        torch.save(logits, args.out / f"{tag}_logits.pt")
    result["step2"] = trainer.train_step(make_batch(2)).metrics
    result["step3"] = trainer.train_step(make_batch(3)).metrics


def scenario_reference(args) -> None:
    from spade_mega.kernels.dispatch import LAUNCHES

    trainer = trainer_for(args)
    trainer.save(str(args.out / "init"))
    result = {"step1": trainer.train_step(make_batch(1)).metrics}
    result["kernel_launches"] = dict(LAUNCHES)  # which path step 1 took (kernels.enabled)
    trainer.save(str(args.out / "reference"))
    continue_run(trainer, args, "reference", result)
    write_json(args.out / "reference.json", result)


def scenario_layout(args) -> None:
    trainer = trainer_for(args)
    trainer.load(str(args.out / "init"))
    result = {"step1": trainer.train_step(make_batch(1)).metrics}
    trainer.save(str(args.out / args.tag))
    continue_run(trainer, args, args.tag, result)
    write_json(args.out / f"{args.tag}.json", result)


def scenario_models(args) -> None:
    """One process, three Trainers one after the other (as a self-play run or a test may build them): 2 layers, 4
    layers, 2 layers again, one step each on batch A."""
    from spade_mega.megatron import Trainer

    steps = {}
    for name, layers in (("first", 2), ("deeper", 4), ("again", 2)):
        steps[name] = Trainer(config([f"model.num_layers={layers}", *args.overrides])).train_step(
            make_batch(1)).metrics
    write_json(args.out / "models.json", steps)


def dump_weights(trainer, args) -> None:
    """The full weights of each --dump checkpoint as ``<name>_weights.pt`` (needs one process)."""
    import torch

    for name in args.dump:
        trainer.load(str(args.out / name))
        weights = {n: p.detach().clone() for n, p in trainer.model[0].module.named_parameters()}
        torch.save(weights, args.out / f"{name}_weights.pt")


def scenario_weights(args) -> None:
    dump_weights(trainer_for(args), args)


def scenario_resume(args) -> None:
    import torch

    trainer = trainer_for(args)
    dump_weights(trainer, args)
    step = trainer.load(args.load)
    logits = logits_of(trainer, make_batch(2))
    if is_rank0():
        torch.save(logits, args.out / f"{args.tag}_logits.pt")
    result = {"loaded_step": step, "step2": trainer.train_step(make_batch(2)).metrics,
              "step3": trainer.train_step(make_batch(3)).metrics}
    write_json(args.out / f"{args.tag}.json", result)


DIGITS, PLUS, EQUALS = list(range(10)), 10, 11  # the arithmetic task's own small vocabulary


def scenario_grpo(args) -> None:
    """GRPO on a verifiable reward: prompt "a+b=" (a + b <= 9), one answer token sampled from the policy itself,
    reward 1 when it is the sum. Group-normalised advantages (spade_mega.rl), one optimizer step per batch."""
    import torch

    from spade_mega.megatron import TrainSample
    from spade_mega.rl.advantages import agent_advantages

    trainer = trainer_for(args)
    g = torch.Generator().manual_seed(0)
    pairs = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]
    prompts_per_step, group = 16, 8
    rewards = []
    for _ in range(args.steps):
        picks = torch.randint(len(pairs), (prompts_per_step,), generator=g).tolist()
        prompts = [torch.tensor([pairs[k][0], PLUS, pairs[k][1], EQUALS]) for k in picks]
        # the answer's distribution: logits at the position after the prompt (row t: token t given tokens[:t])
        probe = [TrainSample(torch.cat([p, p.new_zeros(1)]), torch.zeros(5, dtype=torch.bool), torch.zeros(5))
                 for p in prompts]
        next_logits = torch.stack([logits[-1] for logits in trainer.logits(probe)])
        answers = torch.multinomial(torch.softmax(next_logits / trainer.objective.temperature, -1), group,
                                    replacement=True, generator=g)
        samples, reward, groups = [], [], []
        for k, prompt in enumerate(prompts):
            for token in answers[k].tolist():
                samples.append(TrainSample(torch.cat([prompt, torch.tensor([token])]),
                                           torch.tensor([False] * 4 + [True]), torch.zeros(5)))
                reward.append(float(token == DIGITS[sum(pairs[picks[k]])]))
                groups.append(k)
        advantages = agent_advantages(torch.tensor(reward), torch.tensor(groups))
        for sample, advantage in zip(samples, advantages.tolist()):
            sample.advantages = torch.where(sample.loss_mask, torch.tensor(advantage), torch.tensor(0.0))
        trainer.train_step(samples)
        rewards.append(sum(reward) / len(reward))
    write_json(args.out / "grpo.json", {"mean_reward": rewards})


def scenario_skip(args) -> None:
    """Any layout: a finite step on batch A, then a step on batch B whose sample 0 carries an advantage of
    --advantage (3e38: its gradients overflow; 1e20: they stay finite, their global norm overflows), then a finite
    step on batch C. Each rank writes skip_<rank>.json: every step's ``updated``, whether its own reduced grad
    buffers were finite when the step was decided, and whether the skipped step left its weights, Adam moments,
    schedule and learning rate as they were."""
    import torch
    import torch.distributed as dist

    trainer = trainer_for(args)
    decide, local_finite = trainer._gradients_finite, []

    def recorded() -> bool:  # what this rank's buffers held when the job decided (the decision itself unchanged)
        local_finite.append(all(bool(torch.isfinite(b.grad_data).all()) for chunk in trainer.model
                                for b in chunk.buffers + chunk.expert_parallel_buffers))
        return decide()

    trainer._gradients_finite = recorded

    def snapshot() -> dict:
        optimizers = [opt.optimizer for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])]
        return {"weights": [p.detach().clone() for chunk in trainer.model for p in chunk.parameters()],
                "moments": [t.clone() for opt in optimizers for state in opt.state.values()
                            for t in state.values() if torch.is_tensor(t)],
                "schedule": trainer.scheduler.num_steps, "lr": trainer.optimizer.param_groups[0]["lr"]}

    def same(a: dict, b: dict) -> bool:
        return a["schedule"] == b["schedule"] and a["lr"] == b["lr"] and all(
            len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k]))
            for k in ("weights", "moments"))

    first = trainer.train_step(make_batch(1))
    before = snapshot()
    overflowing = make_batch(2)
    overflowing[0].advantages = torch.where(overflowing[0].loss_mask, torch.tensor(args.advantage), torch.tensor(0.0))
    skipped = trainer.train_step(overflowing)
    after = snapshot()
    last = trainer.train_step(make_batch(3))
    moved = snapshot()
    (args.out / f"skip_{dist.get_rank()}.json").write_text(json.dumps({
        "updated": [first.updated, skipped.updated, last.updated], "local_finite": local_finite,
        "moments": len(before["moments"]), "unchanged": same(before, after), "trainer_step": trainer.step,
        "skipped_grad_norm": skipped.metrics["grad_norm"], "last_moved": not same(after, moved),
        "finite_after": all(bool(torch.isfinite(w).all()) for w in moved["weights"])}))


def scenario_killsave(args) -> None:
    """Resume from the newest complete checkpoint under --out/ckpt if any, save, train one step, then save again
    (the test kills that second save)."""
    from spade_mega.megatron import find_latest

    trainer = trainer_for(args)
    latest = find_latest(args.out / "ckpt")
    if latest is not None:
        print("LOADED", trainer.load(str(args.out / "ckpt")), flush=True)
    trainer.save(str(args.out / "ckpt"))
    trainer.train_step(make_batch(1))
    print("SAVING", flush=True)
    trainer.save(str(args.out / "ckpt"))
    print("SAVED", flush=True)


def scenario_schedule(args) -> None:
    """One process: two updates under a cosine schedule over 4 steps, saved; a trainer configured with a linear
    schedule over 12 steps and another learning rate loads it, takes a step and loads it again (a rollback): the
    schedule and learning rate it continues with."""
    from spade_mega.megatron import Trainer

    first = Trainer(config(["optimizer.lr_schedule=cosine", "selfplay.num_rollouts=4", *args.overrides]))
    for seed in (1, 2):
        first.train_step(make_batch(seed))
    first.save(str(args.out / "schedule"))
    resumed = Trainer(config(["optimizer.lr_schedule=linear", "selfplay.num_rollouts=12", "optimizer.lr=5e-5",
                              "optimizer.adam_beta1=0.8", "optimizer.adam_beta2=0.95", "optimizer.adam_eps=1e-6",
                              "optimizer.weight_decay=0.05", *args.overrides]))
    resumed.load(str(args.out / "schedule"))
    resumed.train_step(make_batch(3))
    resumed.load(str(args.out / "schedule"))
    scheduler = resumed.scheduler
    groups = [g for opt in getattr(resumed.optimizer, "chained_optimizers", [resumed.optimizer])
              for g in opt.optimizer.param_groups]
    write_json(args.out / "schedule.json", {
        "num_steps": scheduler.num_steps, "lr_decay_steps": scheduler.lr_decay_steps,
        "lr_decay_style": scheduler.lr_decay_style, "lr": resumed.optimizer.param_groups[0]["lr"],
        "groups": [{k: g[k] for k in ("betas", "eps", "weight_decay", "wd_mult")} for g in groups]})


def scenario_compat(args) -> None:
    """Which shims install (and the evidence), then whether each patched behaviour is right."""
    import numpy as np
    import torch

    if args.no_triton:
        sys.modules["triton"] = None  # as on a machine without triton
    from spade_mega.megatron import compat

    applied = compat.install()
    from megatron.core.optimizer import clip_grads
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    checks = {}
    before = torch.get_rng_state()
    tracker = CudaRNGStatesTracker()
    tracker.add("stream", 5)
    with tracker.fork("stream"):
        first = torch.rand(4)
    with tracker.fork("stream"):
        second = torch.rand(4)
    again = CudaRNGStatesTracker()
    again.add("stream", 5)
    with again.fork("stream"):
        replay = torch.rand(4)
    checks["rng_tracker"] = bool(torch.equal(first, replay) and not torch.equal(first, second)
                                 and torch.equal(before, torch.get_rng_state()))
    stream = torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.Stream())
    with torch.cuda.stream(stream):
        event = stream.record_event()
    checks["cuda_runtime"] = torch.cuda.current_device() == torch.device("cpu") and event.query()
    checks["device_literals"] = schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.full((2,), 3.0)
    clip_grads.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=2.0)
    checks["type_names"] = bool(torch.allclose(param.grad, torch.full((2,), 1.5), rtol=1e-5)) \
        and param.type() == "torch.FloatTensor"
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
                               sequence_parallel=True, normalization="RMSNorm")
    norm = torch_norm.WrappedTorchNorm(config=config, hidden_size=8)
    checks["torch_norm_sp"] = isinstance(norm, torch.nn.RMSNorm) and \
        all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    # the shim moves nothing outside LanguageModule's set-up: elsewhere .cuda() still fails on this torch
    from megatron.core.models.common.language_module.language_module import LanguageModule

    checks["tied_embeddings"] = hasattr(LanguageModule.setup_embeddings_and_output_layer, "__wrapped__") and \
        "CUDA" in str(compat._raises(lambda: torch.zeros(1).cuda()))
    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([2, 3]), as_numpy=True)
    checks["alltoall_splits"] = isinstance(splits, np.ndarray) and splits.tolist() == [2, 3]
    if args.no_triton:
        from megatron.core.transformer.moe.ops import paged_stash

        try:
            paged_stash.paged_stash_copy_kernel()
        except RuntimeError as exc:
            checks["paged_stash"] = "needs triton" in str(exc)
    import megatron.core

    print(json.dumps({"version": megatron.core.__version__, "applied": applied, "checks": checks}))


def scenario_single(args) -> None:
    """One process: log-probs at the initial weights; then, for every loss aggregation, one step with each sample in
    its own micro-batch and one with the whole batch in one row (same loss and update expected)."""
    import torch

    trainer = trainer_for(args)
    trainer.save(str(args.out / "single_init"))
    budgets = {"one_per_micro_batch": 18, "all_in_one_row": 200}
    result: dict = {"logprobs": {}, "steps": {}}
    for name, budget in budgets.items():
        trainer.cfg.parallel.max_tokens_per_gpu = budget
        result["logprobs"][name] = [lp.tolist() for lp in trainer.logprobs(make_batch(1))]
    for aggregation in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        trainer.cfg.rl.loss_aggregation = aggregation
        for name, budget in budgets.items():
            trainer.load(str(args.out / "single_init"))
            trainer.cfg.parallel.max_tokens_per_gpu = budget
            result["steps"][f"{aggregation}/{name}"] = trainer.train_step(make_batch(1)).metrics
            torch.save(torch.cat([p.detach().reshape(-1) for p in trainer.model[0].module.parameters()]),
                       args.out / f"single_{aggregation}_{name}.pt")
    write_json(args.out / "single.json", result)


def scenario_padding(args) -> None:
    """Any layout, the same micro-batches on every rank: two samples (12 tokens) in a row of their own length, in a
    row of 24 (half padding; under TP2+SP one rank's slice is all padding), the latter again with its padding
    unmarked (what the routers saw before padding_mask), and an all-padding row. Each gets one forward-backward at the
    initial weights with a loss on the real positions' logits; recorded: the load-balancing loss and this rank's
    gradients (router weights, all parameters), compared with the unpadded row as relative errors (max over ranks)."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from spade_mega.megatron import TrainSample, compat
    from spade_mega.megatron.batch import pack, samples_from

    trainer = trainer_for(args)
    g = torch.Generator().manual_seed(7)
    batch = samples_from([TrainSample(torch.randint(0, VOCAB, (n,), generator=g), torch.arange(n) > 1, torch.zeros(n))
                          for n in (7, 5)])
    padded = pack(batch, token_budget=24, length_multiple=24).micro_batches[0][0]
    rows = {"plain": pack(batch, token_budget=12).micro_batches[0][0], "padded": padded,
            "unmarked": dataclasses.replace(padded, sample_ids=padded.sample_ids.clamp(min=0)),
            "empty": pack(batch, token_budget=12, data_parallel=3, length_multiple=2).micro_batches[2][0]}

    def loss_fn(mb, logits):
        weight = mb.loss_mask.to(logits.device, logits.dtype)[..., None]
        return (logits.float().square() * weight).sum() / 100, {}

    aux, grads = {}, {}
    for name, mb in rows.items():
        for chunk in trainer.model:
            chunk.zero_grad_buffer()
        trainer._run_schedule([mb], loss_fn, forward_only=False)
        aux[name] = compat.moe_load_balancing_loss(trainer.model_cfg.num_layers, 1)
        grads[name] = {f"{i}.{n}": p.main_grad.detach().clone() for i, chunk in enumerate(trainer.model)
                       for n, p in chunk.named_parameters()}

    def flat(name, router):
        return torch.cat([v.reshape(-1) for k, v in grads[name].items() if "router." in k or not router])

    def err(name, router):
        return float((flat(name, router) - flat("plain", router)).norm() / flat("plain", router).norm())

    empty = flat("empty", False)
    stats = torch.tensor([err("padded", True), err("padded", False), err("unmarked", True), float(empty.abs().max()),
                          float(not torch.isfinite(empty).all())], dtype=torch.float64)
    stats = torch.nan_to_num(stats, nan=math.inf)  # a maximum over ranks may drop NaN
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    keys = ("router_grad_err", "grad_err", "unmarked_router_grad_err", "empty_grad_max", "empty_grad_not_finite")
    write_json(args.out / f"{args.tag}.json", {"aux": aux, **dict(zip(keys, stats.tolist()))})


def scenario_qwen3_30b(args) -> None:
    """The exact Qwen3-30B-A3B TransformerConfig from its config.json, and the parameters of a 2-layer slice of it
    built on the meta device (all 48 layers are identical; building 6144 expert modules would only cost time)."""
    import dataclasses

    import torch

    from spade_mega.config.schema import ParallelConfig
    from spade_mega.megatron.parallel import init_distributed, initialize, resolve_layout
    from spade_mega.megatron.providers import Backend, build_model_chunks, model_config_from_hf, transformer_config

    model = model_config_from_hf(args.hf_config)
    parallel = ParallelConfig()
    meta = Backend("local", torch.device("meta"))
    config = transformer_config(model, parallel, meta, perform_initialization=False)
    fields = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
              "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "layernorm_epsilon", "qk_layernorm",
              "normalization", "gated_linear_unit", "add_bias_linear", "add_qkv_bias",
              "moe_shared_expert_intermediate_size", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
              "bf16", "moe_router_pre_softmax")
    result = {"config": {f: getattr(config, f) for f in fields}, "activation": config.activation_func.__name__}
    sliced = dataclasses.replace(model, num_layers=2)
    initialize(resolve_layout(parallel, sliced, init_distributed()), 0)
    with torch.device("meta"):
        chunk = build_model_chunks(sliced, transformer_config(sliced, parallel, meta, perform_initialization=False),
                                   meta)[0]
    sizes = {name: p.numel() for name, p in chunk.named_parameters()}
    result.update(slice_layers=2, slice_total=sum(sizes.values()),
                  slice_expert=sum(n for name, n in sizes.items() if ".mlp.experts." in name),
                  devices=sorted({p.device.type for p in chunk.parameters()}))
    print(json.dumps(result))


def worker_main(scope: dict[str, Any], options: Callable[[argparse.ArgumentParser], object] = lambda parser: None,
                prepare: Callable[[argparse.Namespace], object] = lambda args: None,
                without_parallel: Iterable[str] = ()) -> None:
    """A worker's command line: ``<scenario> [options] [config overrides]``, the scenarios being the
    ``scenario_<name>`` functions of ``scope`` (the worker's globals()); ``options`` adds the worker's own, --out and
    --tag are common. The scenario runs on one thread (as the tests' launches: one per process), then the parallel
    state is shut down, except after the scenarios ``without_parallel`` (which never start it)."""
    scenarios = {name.removeprefix("scenario_"): fn for name, fn in scope.items() if name.startswith("scenario_")}
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(scenarios))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tag", default="run")
    options(parser)
    parser.add_argument("overrides", nargs="*", help="config overrides: key=value")
    args = parser.parse_intermixed_args()

    import torch

    torch.set_num_threads(1)
    prepare(args)
    scenarios[args.scenario](args)
    if args.scenario not in without_parallel:
        from spade_mega.megatron.parallel import shutdown

        shutdown()


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load")
    parser.add_argument("--dump", nargs="*", default=[])
    parser.add_argument("--continue-run", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-triton", action="store_true")
    parser.add_argument("--hf-config")
    parser.add_argument("--advantage", type=float, default=3e38, help="skip: sample 0's advantage in the second step")
    parser.add_argument("--num-samples", type=int, default=None,
                        help="only the first N samples of each batch (an odd count leaves a data-parallel rank short)")


def only_first_samples(args: argparse.Namespace) -> None:
    global LENGTHS
    if args.num_samples is not None:
        LENGTHS = LENGTHS[:args.num_samples]


if __name__ == "__main__":
    sys.exit(worker_main(globals(), options, only_first_samples, without_parallel=("compat",)))
