"""``spade-mega train CONFIG [KEY=VALUE ...]``: run (or resume) SPADE self-play, then write the run report."""

from __future__ import annotations

import argparse

from spade_mega.config.loader import load_config


def _train(args: argparse.Namespace) -> int:
    from spade_mega.selfplay.loop import run

    summary = run(load_config(args.config, args.overrides))
    if summary.report is not None:
        start = "a new run" if summary.resumed_from is None else f"resumed at rollout {summary.resumed_from}"
        what = "stopped on SIGUSR1 after" if summary.stopped else "done:"
        print(f"{what} {summary.rollouts} rollouts in {summary.run_dir} ({start}); report: {summary.report}"
              + ("; run the same command to resume" if summary.stopped else ""))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser(
        "train", help="run SPADE self-play (designer + agent, one model) and write the run report",
        description="Run SPADE self-play as CONFIG describes, in run.output_dir/run.name: resumes from the newest "
                    "checkpoint there when run.resume is auto (the default) or must. One process trains on CPU; "
                    "under torchrun or srun every rank runs this command.")
    train.add_argument("config", metavar="CONFIG", help="YAML config file (may extend others with 'base:')")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="dotted overrides, values parsed as YAML: selfplay.num_rollouts=4 run.name=try2")
    train.set_defaults(func=_train)
