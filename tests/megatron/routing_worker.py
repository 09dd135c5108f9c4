"""Routing-replay scenario for tests/megatron/test_megatron_routing_replay.py (gloo, CPU, one thread per process).

  replay  any layout, rl.routing_replay on: with --load, the checkpoint --load (else build and save the initial
          weights to --out/init). The old-policy pass over batch A with a budget of --pass-budget tokens (all six
          samples in one row by default), then one at the steps' budget (one sample a row); step 1 on the samples in
          a seeded shuffled order, with the old log-probs of the second pass and the routing of the first (another
          packing, another order); the old-policy pass again (the routing the stepped router picks itself); step 2,
          which replays the first routing still; the log-probs after it; the error of a step on samples with old
          log-probs but no routing. With one process it also records what every
          router call used (:class:`LayerReplay`), mapped to the samples. Written to --out/<tag>.json and
          <tag>_*.pt; nothing is asserted here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_worker import config, is_rank0, make_batch, write_json

def scenario_replay(args) -> None:
    import torch
    import torch.distributed as dist

    from spade_mega.megatron import Trainer
    from spade_mega.megatron.batch import BatchError, samples_from

    trainer = Trainer(config(["rl.routing_replay=true", *args.overrides]))
    step_budget = trainer.cfg.parallel.max_tokens_per_gpu
    from spade_mega.megatron import routing

    calls: list[tuple[object, object, torch.Tensor]] = []
    used = routing.LayerReplay.get_replay_topk

    def spy(self, scores, topk, *rest, **kw):  # what each router call of the steps routed with
        probs, indices = used(self, scores, topk, *rest, **kw)
        if self.router_replay_action in (routing.FORWARD, routing.BACKWARD):
            calls.append((self, self.router_replay_action, indices.detach().cpu().clone()))
        return probs, indices

    routing.LayerReplay.get_replay_topk = spy
    if args.load:
        trainer.load(args.load)
    else:
        trainer.save(str(args.out / "init"))

    def old_policy(budget: int):
        batch = make_batch(1)
        trainer.cfg.parallel.max_tokens_per_gpu = budget
        values = trainer.old_policy(batch)
        trainer.cfg.parallel.max_tokens_per_gpu = step_budget
        return batch, values

    batch, _ = old_policy(args.pass_budget)  # the routing replayed: all samples in one row
    routed = [s.routing.clone() for s in batch]
    _, old = old_policy(step_budget)  # the old log-probs: the steps' own packing, so step 1's ratio is exactly 1
    order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(3)).tolist()
    steps = [batch[k] for k in order]
    for s, k in zip(steps, order):
        s.old_logprobs = old[k]
    result: dict = {"order": order, "routing_dtype": str(routed[0].dtype)}
    result["step1"] = trainer.train_step(steps).metrics
    first_calls, calls[:] = list(calls), []
    moved, _ = old_policy(step_budget)  # what the stepped router picks by itself
    result["step2"] = trainer.train_step(steps).metrics
    second_calls = list(calls)
    after = torch.cat(trainer.logprobs(make_batch(1)))
    try:  # old log-probs without the routing they were taken with
        trainer.train_step(make_batch(2))
    except BatchError as exc:
        result["unrouted"] = str(exc)
    if is_rank0():
        torch.save(torch.stack([torch.cat([r.long() for r in routed]), torch.cat([s.routing.long() for s in moved])]),
                   args.out / f"{args.tag}_routing.pt")
        torch.save(after, args.out / f"{args.tag}_after.pt")
    if dist.get_world_size() == 1:  # one row a sample: the n-th call of a layer's router is the n-th row
        rows = [mb.samples[0] for mb in trainer._plan(samples_from(steps)).micro_batches[0]]
        hooks = trainer.routing.layers[0]

        def agree(recorded: list, action) -> list[bool]:
            """Per (layer, row): whether the experts used equal the first pass's for that row's sample, as sets."""
            out = []
            for j, hook in enumerate(hooks):
                mine = [indices for h, a, indices in recorded if h is hook and a == action]
                assert len(mine) == len(rows), (len(mine), len(rows))
                for indices, s in zip(mine, rows):
                    want = routed[order[s]][:, j].long()
                    out.append(bool(torch.equal(indices.sort(1).values, want.sort(1).values)))
            return out

        result["calls"] = {f"step{n}_{name}": agree(recorded, action)
                           for n, recorded in ((1, first_calls), (2, second_calls))
                           for name, action in (("forward", routing.FORWARD), ("recompute", routing.BACKWARD))
                           if any(a == action for _, a, _ in recorded)}
    write_json(args.out / f"{args.tag}.json", result)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["replay"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tag", default="run")
    parser.add_argument("--load")
    parser.add_argument("--pass-budget", type=int, default=80, help="the first pass's parallel.max_tokens_per_gpu "
                        "(the steps': the config's, 18 by default: every sample of make_batch fills a row alone)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()

    import torch

    torch.set_num_threads(1)
    globals()[f"scenario_{args.scenario}"](args)
    from spade_mega.megatron.parallel import shutdown

    shutdown()


if __name__ == "__main__":
    main()
