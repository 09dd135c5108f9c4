"""The cost of MoE routing replay (``rl.routing_replay``) in the trainer: the old-log-prob pass that also records the
routing, and the train step that replays it, against the same pass and step without replay.

    python -m tools.bench routing_replay [--rounds 5] [--samples 16] [--max-len 128] [overrides...]

One process (gloo on CPU, NCCL on GPU), one trainer built with replay on, a Qwen3-MoE-shaped model of 4 layers, 16
experts top-4 (``overrides`` change it). Baselines measured in the same run, alternating with the measured path
round by round after a warm-up of each: ``Trainer.logprobs`` for the pass (what the loop ran before), a step on the
samples without their routing and with the trainer's replay switched off for the step. Times are CPU seconds of the
process on CPU (the machine may be shared), wall seconds on GPU; medians over ``--rounds``. Also: the bytes of routing
kept per token, and the step's drift after a few steps of a large learning rate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODEL = ["model.num_layers=4", "model.hidden_size=256", "model.ffn_hidden_size=512", "model.num_attention_heads=4",
         "model.num_query_groups=2", "model.kv_channels=64", "model.num_experts=16", "model.moe_router_topk=4",
         "model.moe_ffn_hidden_size=128", "optimizer.lr=1e-3"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench routing_replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("overrides", nargs="*", help="config overrides (dotted keys) after the bench's model")
    args = parser.parse_intermixed_args(argv)

    import torch

    from spade_mega.config.loader import apply_overrides, build, to_dict
    from spade_mega.config.schema import SpadeConfig
    from spade_mega.megatron import Trainer
    from spade_mega.megatron.parallel import shutdown
    from tools.bench.train_step import synthetic_batch

    torch.set_num_threads(1)
    cfg = build(SpadeConfig, apply_overrides(to_dict(SpadeConfig()), ["rl.routing_replay=true", *MODEL,
                                                                      *args.overrides]))
    cfg.check()
    trainer = Trainer(cfg)
    batch = synthetic_batch(args.samples, cfg.model.vocab_size, args.max_len)
    tokens = sum(len(s) for s in batch)
    gpu = torch.cuda.is_available()
    clock = time.perf_counter if gpu else time.process_time

    def timed(fn):
        if gpu:
            torch.cuda.synchronize()
        start = clock()
        out = fn()
        if gpu:
            torch.cuda.synchronize()
        return clock() - start, out

    def unrouted():
        return [s.__class__(s.tokens, s.loss_mask, s.advantages, s.role, s.rollout_logprobs, s.old_logprobs)
                for s in batch]

    def plain_step():
        routing, trainer.routing = trainer.routing, None
        try:
            return trainer.train_step(unrouted())
        finally:
            trainer.routing = routing

    times: dict[str, list[float]] = {"pass": [], "pass_recording": [], "step": [], "step_replayed": []}
    drift = 0.0
    for k in range(args.rounds + 1):  # round 0 warms each path up
        pass_s, _ = timed(lambda: trainer.logprobs(batch))
        record_s, _ = timed(lambda: trainer.old_policy(batch))
        step_s, _ = timed(plain_step)
        replay_s, result = timed(lambda: trainer.train_step(batch))
        drift = result.metrics["routing_replay_drift"]
        if k:
            for key, value in zip(times, (pass_s, record_s, step_s, replay_s)):
                times[key].append(value)
    med = {key: statistics.median(values) for key, values in times.items()}
    kept = sum(s.routing.numel() * s.routing.element_size() for s in batch)
    m = cfg.model
    unit = "wall s (GPU)" if gpu else "CPU s"
    print(f"routing replay, {m.num_layers} MoE layers, {m.num_experts} experts top-{m.moe_router_topk}, hidden "
          f"{m.hidden_size}; {args.samples} samples, {tokens} tokens; median of {args.rounds} rounds, {unit}")
    print("| path | baseline | with replay | ratio |")
    print("|---|---|---|---|")
    print(f"| old-log-prob pass (Trainer.logprobs -> old_policy, recording) | {med['pass']:.3f} | "
          f"{med['pass_recording']:.3f} | {med['pass_recording'] / med['pass']:.3f} |")
    print(f"| train step (own routing -> replayed, drift counted) | {med['step']:.3f} | {med['step_replayed']:.3f} | "
          f"{med['step_replayed'] / med['step']:.3f} |")
    print(f"routing kept: {kept / tokens:.0f} bytes per token ({m.num_layers} layers x top-{m.moe_router_topk} x "
          f"{batch[0].routing.element_size()} byte), {kept / 2**20:.2f} MiB for the batch; drift of the last replayed "
          f"step (the old policy re-recorded each round): {drift:.3f}")
    trainer.close()
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
