"""The ``spade-mega`` command. Subcommands are registered by the modules that own them (see ``COMMAND_MODULES``).

Every user error (a :class:`~spade_mega.errors.SpadeError`, or bad arguments) prints one line and exits with status 2;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn, Sequence

from spade_mega import __version__
from spade_mega.errors import SpadeError

# Each module defines ``register(subparsers)`` adding its command with ``set_defaults(func=handler)``;
# a handler takes the parsed namespace and returns an exit status.
COMMAND_MODULES = ("spade_mega.config.commands", "spade_mega.curriculum.commands", "spade_mega.envs.commands",
                   "spade_mega.monitor.commands", "spade_mega.bridge.commands", "spade_mega.launch.commands",
                   "spade_mega.selfplay.commands", "spade_mega.monitor.rollouts", "spade_mega.evaluation.commands")

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line that says where to get help (exit 2), not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="spade-mega",
        description="SPADE self-play at Megatron scale: one LLM designs executable environments "
        "and learns to solve them; the designer is paid by hint-based regret.",
        epilog="Run 'spade-mega COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return USAGE_ERROR
    try:
        return int(args.func(args) or 0)
    except SpadeError as exc:
        if args.debug:
            raise
        print(f"spade-mega: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("spade-mega: interrupted", file=sys.stderr)
        return 130
    finally:
        _leave_process_group()


def _leave_process_group() -> None:
    """Destroy the process group a command joined, before the interpreter exits: left to exit-time destructors,
    the rank hosting the rendezvous store (rank 0) dies of SIGABRT ("terminate called without an active exception")
    in about one exit in five, so a job that failed cleanly (exit 2) or finished (exit 0) reported a crash. torch is
    not imported here when the command did not use it."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        from spade_mega.megatron.parallel import shutdown

        shutdown()


if __name__ == "__main__":
    sys.exit(main())
