"""Sandbox step latency and validation throughput, against baselines measured in the same run.

    python -m tools.bench sandbox [--steps 20000] [--per-call 20] [--programs 24]
    python tools/bench/sandbox.py ...

Step latency (median and p99 of one ``step`` round trip, the same trivial environment everywhere):
- in-process call: the environment object called directly (what the reference SPADE code does with ``exec``);
- unisolated persistent worker: our worker process and protocol without bubblewrap, seccomp, uid drop or cgroups;
- strict persistent worker: the same call path on a worker of a strict ``SandboxPool``, and ``EnvHandle.step``
  (which adds the contract checks a user gets);
- a new process per call: ``python -c`` that loads the program, resets, steps and prints the result, and a new
  strict sandbox per call (start a worker, load, reset, step, kill), SandboxFusion style.
Ratios: strict / unisolated worker (target <= 2x) and process per call / strict (target >= 500x).
Also: ``step_many`` over 8 environments (aggregate steps/s) and validation throughput (programs/s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spade_mega.config.schema import SandboxConfig, ValidationConfig  # noqa: E402
from spade_mega.envs.program import EnvProgram  # noqa: E402
from spade_mega.envs.sandbox import SandboxPool  # noqa: E402
from spade_mega.envs.sandbox.isolation import IsolationPlan, Launch, plan_isolation  # noqa: E402
from spade_mega.envs.sandbox.pool import check_step  # noqa: E402
from spade_mega.envs.sandbox.process import spawn  # noqa: E402
from spade_mega.envs.validate import Validator  # noqa: E402

WALK = """
class Walk:
    max_turns = 1000000

    def reset(self, seed):
        self.t = 0
        self.pos = seed
        return "start"

    def step(self, action):
        self.t += 1
        self.pos += 1 if action == "right" else -1
        return f"at {self.pos}", 0.0, False, False, {}
"""

GUESS = """
import random


class Guess:
    max_turns = {turns}

    def reset(self, seed):
        self.secret = random.Random(seed).randint(1, {top})
        self.turn = 0
        return "Guess a number between 1 and {top}."

    def step(self, action):
        self.turn += 1
        try:
            guess = int(action.strip())
        except ValueError:
            return "Reply with an integer.", 0.0, False, self.turn >= self.max_turns, {{}}
        if guess == self.secret:
            return "Correct!", 1.0, True, False, {{"turns": self.turn}}
        hint = "higher" if guess < self.secret else "lower"
        return f"{{guess}} is wrong, go {{hint}}.", 0.0, False, self.turn >= self.max_turns, {{}}
"""


def timings(fn: Callable[[int], object], n: int, warmup: int = 200) -> list[float]:
    for i in range(warmup):
        fn(i)
    out, clock = [], time.perf_counter_ns
    for i in range(n):
        start = clock()
        fn(i)
        out.append(clock() - start)
    return out


def summary(name: str, samples_ns: list[float]) -> dict[str, float]:
    ordered = sorted(samples_ns)
    median = statistics.median(ordered) / 1000
    p99 = ordered[max(0, int(len(ordered) * 0.99) - 1)] / 1000
    print(f"  {name:<50} median {median:>11.1f} us   p99 {p99:>11.1f} us", flush=True)
    return {"median_us": median, "p99_us": p99}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench sandbox", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20000, help="timed steps per persistent-worker variant")
    parser.add_argument("--per-call", type=int, default=20, help="timed calls per process-per-call variant")
    parser.add_argument("--programs", type=int, default=24, help="programs in the validation throughput run")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    actions = ("right", "left")
    results: dict[str, dict[str, float]] = {}
    print(f"sandbox bench: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start", flush=True)

    print("step latency (one round trip)")
    namespace: dict[str, object] = {}
    exec(compile(WALK, "<bench>", "exec"), namespace)  # trusted benchmark text, the in-process baseline
    local = namespace["Walk"]()  # type: ignore[operator]
    local.reset(0)
    results["in_process"] = summary("in-process call", timings(lambda i: local.step(actions[i & 1]), args.steps * 5))

    cfg = SandboxConfig(warm_workers=8)
    bare = spawn(Launch(IsolationPlan(None, None, None, None, False, 0, False), cfg), None)
    bare.call("load", WALK, 10.0)
    bare.call("reset", 0, 10.0)
    with SandboxPool(cfg) as pool:
        assert pool.isolation is not None
        print(f"  (strict isolation: {pool.isolation.describe()})")
        env = pool.open(EnvProgram(WALK, "", "bench"))
        env.reset(0)
        worker = env._worker
        assert worker is not None
        variants: dict[str, Callable[[int], object]] = {
            "unisolated_worker": lambda i: check_step(bare.call("step", actions[i & 1], 5.0).value),
            "strict_worker": lambda i: check_step(worker.call("step", actions[i & 1], 5.0).value),
            "strict_handle": lambda i: env.step(actions[i & 1]),
        }
        labels = {"unisolated_worker": "unisolated persistent worker (WorkerProcess.call)",
                  "strict_worker": "strict persistent worker (WorkerProcess.call)",
                  "strict_handle": "strict persistent worker (EnvHandle.step)"}
        # Interleaved in rounds, so a burst of load from elsewhere on the machine hits every variant alike.
        samples: dict[str, list[float]] = {name: [] for name in variants}
        rounds = 20
        for _ in range(rounds):
            for name, fn in variants.items():
                samples[name] += timings(fn, max(1, args.steps // rounds), warmup=50)
        for name in variants:
            results[name] = summary(labels[name], samples[name])
        bare.kill()
        env.close()

        code = WALK + "\nimport json\nenv = Walk()\nenv.reset(0)\nprint(json.dumps(env.step('right')))\n"
        python = os.path.realpath(sys.executable)
        results["process_per_call"] = summary(
            "new process per call (python -c, no isolation)",
            timings(lambda i: subprocess.run([python, "-S", "-c", code], capture_output=True, check=True),
                    args.per_call, warmup=2))

        strict_launch = Launch(plan_isolation(cfg), cfg)

        def sandbox_per_call(i: int) -> None:
            one = spawn(strict_launch, None)  # started in the call, not taken from the warm pool
            for op, arg in (("load", WALK), ("reset", 0), ("step", "right")):
                assert one.call(op, arg, 10.0).ok
            one.kill()

        results["sandbox_per_call"] = summary("new strict sandbox per call (start, load, reset, step, kill)",
                                              timings(sandbox_per_call, args.per_call, warmup=2))

        print("batch stepping")
        envs = [pool.open(EnvProgram(WALK, "", "bench")) for _ in range(8)]
        pool.reset_many([(e, i) for i, e in enumerate(envs)])
        batch_s = sequential_s = 0.0
        rounds = max(1, args.steps // 40)
        for r in range(rounds):  # interleaved, as above
            start = time.perf_counter()
            pool.step_many([(e, actions[r & 1]) for e in envs])
            middle = time.perf_counter()
            for e in envs:
                e.step(actions[r & 1])
            batch_s, sequential_s = batch_s + middle - start, sequential_s + time.perf_counter() - middle
        batch_rate, sequential_rate = rounds * len(envs) / batch_s, rounds * len(envs) / sequential_s
        for e in envs:
            e.close()
        print(f"  step_many over 8 environments: {batch_rate:,.0f} steps/s; one at a time: {sequential_rate:,.0f} "
              f"steps/s (x{batch_rate / sequential_rate:.2f})")
        results["batch"] = {"step_many_steps_per_s": batch_rate, "sequential_steps_per_s": sequential_rate}

        print("validation throughput")
        programs = [EnvProgram(GUESS.format(turns=6 + i % 5, top=20 + i), "binary search", "bench")
                    for i in range(args.programs)]
        validator = Validator(pool, ValidationConfig())
        start = time.perf_counter()
        reports = validator.validate_many(programs)
        elapsed = time.perf_counter() - start
        assert all(r.ok for r in reports), [r.detail for r in reports if not r.ok]
        rate = len(programs) / elapsed
        print(f"  {len(programs)} programs in {elapsed:.2f} s: {rate:.1f} programs/s "
              f"(concurrency {validator.cfg.concurrency}, {pool.cfg.warm_workers} warm workers)")
        results["validation"] = {"programs_per_s": rate, "seconds": elapsed}

    strict, bare_med = results["strict_worker"]["median_us"], results["unisolated_worker"]["median_us"]
    print("ratios (medians)")
    print(f"  strict worker / unisolated worker:   x{strict / bare_med:.2f}   (target <= 2)")
    handle_vs_local = results["strict_handle"]["median_us"] / results["in_process"]["median_us"]
    print(f"  EnvHandle.step / in-process call:    x{handle_vs_local:.0f}")
    print(f"  process per call / strict worker:    x{results['process_per_call']['median_us'] / strict:.0f}   "
          "(target >= 500)")
    print(f"  sandbox per call / strict worker:    x{results['sandbox_per_call']['median_us'] / strict:.0f}")
    print(f"load average {os.getloadavg()[0]:.1f} at end", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
