"""``spade-mega env validate FILE...`` and ``spade-mega env play FILE``: environment programs from the command line.

``validate`` runs the full validation of each program file in the sandbox and exits 1 if any is rejected (with its
reason code); ``play`` lets a person play a program: type an action per line, see observations and rewards.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from spade_mega.config.loader import load_config
from spade_mega.config.schema import SpadeConfig
from spade_mega.envs.episode import episode_return
from spade_mega.envs.program import EnvProgram
from spade_mega.errors import SpadeError

if TYPE_CHECKING:
    from spade_mega.envs.sandbox import SandboxError

REJECTED = 1


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hint", default="", help="the privileged hint travelling with the program")
    parser.add_argument("--skill", default="", help="the program's skill tag")
    parser.add_argument("--config", "-c", metavar="FILE",
                        help="YAML config (its sandbox and validation sections, and rollout.max_turns)")
    parser.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted config override, repeatable: -s sandbox.call_timeout_s=2")


def _read_program(path: str, args: argparse.Namespace) -> EnvProgram:
    file = Path(path)
    if file.suffix != ".py":
        raise SpadeError(f"{path}: an environment program is a .py file")
    try:
        source = file.read_text(encoding="utf-8-sig")  # a leading byte-order mark is no part of the program
    except FileNotFoundError:
        raise SpadeError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpadeError(f"{path}: cannot read it as UTF-8 text ({exc})") from None
    return EnvProgram(source=source, hint=args.hint, skill=args.skill, provenance={"origin": "file", "path": path})


def _validate(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from spade_mega.envs.sandbox import SandboxPool
    from spade_mega.envs.validate import Validator

    cfg: SpadeConfig = load_config(args.config, args.overrides)
    programs = [_read_program(path, args) for path in args.files]
    with SandboxPool(cfg.sandbox) as pool, Progress(transient=True, console=_stderr_console()) as progress:
        task = progress.add_task("validating", total=len(programs))
        validator = Validator(pool, cfg.validation, rollout_turns=cfg.rollout.max_turns)
        reports = validator.validate_many(programs, lambda _: progress.advance(task))
    width = max(len(path) for path in args.files)
    for path, report in zip(args.files, reports):
        if args.json:
            print(json.dumps({"file": path, **report.to_dict()}))
        elif report.ok:
            cut = f" (the rollout plays {report.horizon})" if report.horizon < report.max_turns else ""
            print(f"ok        {path:<{width}}  {report.class_name}, max_turns {report.max_turns}{cut}, "
                  f"{report.seconds:.2f} s")
        else:
            assert report.reason is not None
            print(f"rejected  {path:<{width}}  {report.reason.value}: {report.detail}")
    if cfg.validation.solvability.enabled:  # it asks the policy, which only a run has
        print("note: validation.solvability is enabled but was not run: it asks the policy (the run's engine); "
              "training runs it after these sandbox checks, so 'ok' here covers those alone", file=sys.stderr)
    rejected = Counter(r.reason.value for r in reports if r.reason is not None)
    if not args.json:
        causes = ", ".join(f"{reason} {n}" for reason, n in sorted(rejected.items()))
        print(f"{len(reports) - sum(rejected.values())} ok, {sum(rejected.values())} rejected"
              + (f" ({causes})" if causes else ""))
    return REJECTED if rejected else 0


def _play(args: argparse.Namespace) -> int:
    from spade_mega.envs.sandbox import SandboxError, SandboxPool

    if not -2**63 <= args.seed <= 2**64 - 1:
        raise SpadeError(f"--seed must be in [-2**63, 2**64 - 1] (the sandbox's 64-bit seeds), got {args.seed}")
    cfg: SpadeConfig = load_config(args.config, args.overrides)
    program = _read_program(args.file, args)
    sandbox = dataclasses.replace(cfg.sandbox, warm_workers=1)
    interactive = sys.stdin.isatty()
    with SandboxPool(sandbox) as pool, pool.open(program) as env:
        # an episode ends where training ends it: at max_turns, or earlier at the rollout's turn limit
        horizon = min(env.max_turns, cfg.rollout.max_turns)
        limit = "max_turns" if horizon == env.max_turns else "rollout.max_turns"
        cut = f" (the rollout plays {horizon})" if horizon < env.max_turns else ""
        print(f"[{env.class_name}, max_turns {env.max_turns}{cut}, seed {args.seed}; one action per line, "
              f"end of input quits]")
        try:
            print(env.reset(args.seed))
        except SandboxError as error:
            _failed(args.file, f"reset({args.seed})", error)
        _show_output(env.last_output)
        rewards: list[float] = []  # summed as the rollout sums them: a running sum can pass through inf
        turns = 0
        while True:
            if interactive:
                print("> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                print(f"[stopped after {turns} turns, return {episode_return(rewards):+.3f}]")
                return 0
            action = line.rstrip("\n")
            try:
                observation, reward, terminated, truncated, info = env.step(action)
            except SandboxError as error:
                _failed(args.file, f"step {turns + 1} (action {action!r})", error)
            turns += 1
            rewards.append(reward)
            _show_output(env.last_output)
            print(f"[reward {reward:+.3f}{', info ' + json.dumps(info) if info else ''}]")
            print(observation)
            if terminated or truncated:
                print(f"[episode {'terminated' if terminated else 'truncated'} after {turns} turns, "
                      f"return {episode_return(rewards):+.3f}]")
                return 0
            if turns >= horizon:
                print(f"[episode truncated after {turns} turns ({limit}), "
                      f"return {episode_return(rewards):+.3f}]")
                return 0


def _failed(path: str, call: str, error: SandboxError) -> NoReturn:
    """Show what the program printed during the failing call, then end with one line saying where it failed."""
    _show_output(error.output)
    raise SpadeError(f"{path}: the program failed at {call}: {error}") from None


def _show_output(output: str) -> None:
    for line in output.splitlines():
        print(f"| {line}")


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def register(subparsers: argparse._SubParsersAction) -> None:
    env = subparsers.add_parser("env", help="validate or play environment programs",
                                description="Validate environment programs, or play one interactively. Programs "
                                            "run in the isolated sandbox (see the config's sandbox section).")
    actions = env.add_subparsers(title="actions", metavar="ACTION", required=True)
    validate = actions.add_parser("validate", help="validate environment programs; exit 1 if any is rejected",
                                  description="Run every validation check on each program file and print one line "
                                              "per file: ok, or rejected with its reason code.")
    validate.add_argument("files", nargs="+", metavar="FILE", help="environment program (.py)")
    validate.add_argument("--json", action="store_true", help="print one JSON report per line instead")
    _add_common(validate)
    validate.set_defaults(func=_validate)
    play = actions.add_parser("play", help="play an environment program: one action per line",
                              description="Reset the program with --seed, then read one action per line from "
                                          "standard input and print each observation and reward, until the "
                                          "episode ends (at the latest at max_turns or rollout.max_turns, as in "
                                          "training).")
    play.add_argument("file", metavar="FILE", help="environment program (.py)")
    play.add_argument("--seed", type=int, default=0, help="episode seed (default 0)")
    _add_common(play)
    play.set_defaults(func=_play)
