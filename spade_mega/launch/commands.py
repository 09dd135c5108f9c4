"""``spade-mega launch slurm|local``: render (and submit) the SLURM job of a config, or run its ranks here."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from spade_mega.config.loader import load_config
from spade_mega.errors import SpadeError


class SubmitError(SpadeError):
    """sbatch is missing or refused the job."""


def _check_overwrite(target: Path) -> None:
    """Re-rendering replaces an earlier script; any other file (the config itself, given as -o) is kept."""
    from spade_mega.launch.sbatch import RENDERED_BY

    try:
        with target.open("rb") as existing:
            head = existing.read(4096).decode(errors="replace")
    except FileNotFoundError:
        return
    except OSError as exc:
        raise SubmitError(f"cannot write the script to {target}: {exc.strerror or exc}") from None
    if RENDERED_BY not in head:
        raise SubmitError(f"{target} exists and is not a script rendered by spade-mega launch slurm: give another "
                          "-o FILE (or remove it first)")


def _slurm(args: argparse.Namespace) -> int:
    from spade_mega.launch.sbatch import render_sbatch

    cfg = load_config(args.config, args.overrides)
    script = render_sbatch(cfg, args.config)
    job = cfg.launch.job_name or cfg.run.name
    if args.output == "-":
        if args.submit:
            raise SubmitError("--submit needs the script in a file: give -o FILE (not -o -)")
        sys.stdout.write(script)
        return 0
    target = Path(args.output or f"{job}.sbatch")
    _check_overwrite(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(script)
    except OSError as exc:
        raise SubmitError(f"cannot write the script to {target}: {exc.strerror or exc}") from None
    target.chmod(0o755)
    print(f"wrote {target}", file=sys.stderr)
    if not args.submit:
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise SubmitError(f"sbatch not found on PATH: submit {target} from a SLURM login node")
    # SLURM opens the job's output file before the script runs: its folder must exist.
    workdir = Path(cfg.launch.workdir or ".")
    (workdir / cfg.launch.log_dir).mkdir(parents=True, exist_ok=True)
    result = subprocess.run([sbatch, "--parsable", str(target)], capture_output=True, text=True)
    if result.returncode != 0:
        reason = (result.stderr.strip() or result.stdout.strip() or f"exit status {result.returncode}").splitlines()
        raise SubmitError(f"sbatch refused {target}: {reason[-1]}")
    job_id = result.stdout.strip().split(";")[0]
    print(job_id)
    return 0


def _local(args: argparse.Namespace) -> int:
    from spade_mega.launch.local import local_command, run_local

    cfg = load_config(args.config, args.overrides)
    return run_local(local_command(cfg, args.config, args.overrides, args.nproc, args.script))


def register(subparsers: argparse._SubParsersAction) -> None:
    launch = subparsers.add_parser("launch", help="run a config on a SLURM cluster or on this machine",
                                   description="Render the SLURM job of a config (and submit it), or start its "
                                               "ranks on this machine under torchrun.")
    actions = launch.add_subparsers(title="actions", metavar="ACTION", required=True)
    slurm = actions.add_parser(
        "slurm", help="write the sbatch script of a config (the launch section), optionally submit it",
        description="Write a self-contained sbatch script: SBATCH directives, environment, the resolved config, "
                    "engine servers and one torchrun per node. The layout is checked against launch.nodes x "
                    "launch.gpus_per_node first.")
    slurm.add_argument("config", metavar="CONFIG", help="YAML config file")
    slurm.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. launch.nodes=2")
    slurm.add_argument("-o", "--output", metavar="FILE", help="script path (default: JOB_NAME.sbatch; - for stdout)")
    slurm.add_argument("--submit", action="store_true", help="submit with sbatch and print the job id")
    slurm.set_defaults(func=_slurm)
    local = actions.add_parser(
        "local", help="run the trainer's ranks on this machine under torchrun",
        description="Start torchrun here with one process per rank (gloo on CPU): by default the fewest the "
                    "parallel layout fits.")
    local.add_argument("config", metavar="CONFIG", help="YAML config file")
    local.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
    local.add_argument("--nproc", type=int, default=None, help="processes (default: the layout's minimum)")
    local.add_argument("--script", metavar="FILE", default=None,
                       help="run this Python script on every rank instead of the trainer (gets CONFIG and overrides)")
    local.set_defaults(func=_local)
