"""``spade-mega config show|check``: resolve a config file with overrides, print it or just validate it."""

from __future__ import annotations

import argparse

from spade_mega.config.loader import load_config, to_yaml


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", metavar="FILE", help="YAML config file (may extend others with 'base:')")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, values parsed as YAML: model.num_layers=3 parallel.tensor=2")


def _show(args: argparse.Namespace) -> int:
    print(to_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def _check(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    print(f"ok: {args.config or '(defaults)'} is valid (model {cfg.model.name}, "
          f"TP{cfg.parallel.tensor} EP{cfg.parallel.expert} PP{cfg.parallel.pipeline})")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    config = subparsers.add_parser("config", help="show or check a resolved configuration",
                                   description="Resolve a config (base files, then overrides) and show or check it.")
    actions = config.add_subparsers(title="actions", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="print the resolved config as YAML",
                              description="Print the fully resolved config as YAML.")
    _add_config_args(show)
    show.set_defaults(func=_show)
    check = actions.add_parser("check", help="validate a config; exit 2 with the offending key if it is wrong",
                               description="Validate a config without printing it.")
    _add_config_args(check)
    check.set_defaults(func=_check)
