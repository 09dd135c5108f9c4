"""``spade-mega memory stats|export|show HASH``: inspect a run's environment memory (read while a run writes it)."""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # imported by the handlers: registering the command must not load numpy
    from spade_mega.curriculum.memory import EnvMemory


def memory_path(target: str) -> Path:
    """A memory database file, or a run directory (its config.yaml names the database, default memory.sqlite).

    Only ``curriculum.memory`` of the saved config is read and checked: a run saved before a key was removed or
    renamed (which the full config now refuses) must keep its memory inspectable."""
    path = Path(target)
    if not path.is_dir():
        return path
    config = path / "config.yaml"
    if config.is_file():
        from spade_mega.config.loader import build, load_raw
        from spade_mega.config.errors import ConfigError
        from spade_mega.config.schema import CurriculumConfig

        curriculum = load_raw(config).get("curriculum") or {}
        if not isinstance(curriculum, dict):
            raise ConfigError(f"{config}: curriculum", "must be a mapping of keys")
        memory = build(CurriculumConfig, {"memory": curriculum.get("memory") or {}}, "curriculum").memory
        memory.check()
        return path / memory.path
    return path / "memory.sqlite"


def _guarded(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A damaged database file is one line naming it (the header may open fine and a query fail later), and
    ``spade-mega memory export | head`` stops quietly with the shell's SIGPIPE status (128 + 13) when the reader
    closes the pipe, instead of a traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            status = handler(args)
            sys.stdout.flush()
            return status
        except sqlite3.DatabaseError as exc:
            from spade_mega.curriculum.memory import EnvMemoryError

            path = memory_path(args.run)
            raise EnvMemoryError(f"{path}: the memory database is damaged ({exc}); check it with sqlite3 {path} "
                                 f"'PRAGMA integrity_check', recover what is left with sqlite3 {path} .recover")
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit-time flush must not fail again
            return 128 + 13

    return run


def _open(args: argparse.Namespace) -> EnvMemory:
    from spade_mega.curriculum.memory import EnvMemory

    return EnvMemory(memory_path(args.run), create=False)


def _stats(args: argparse.Namespace) -> int:
    with _open(args) as memory:
        stats = memory.stats()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    fmt = (lambda v: "n/a" if v is None else f"{v:.3f}")
    print(f"memory        {stats['path']}")
    print(f"environments  {stats['environments']} ({stats['proposals']} proposals, "
          f"{stats['near_duplicates']} near-duplicates of earlier ones)")
    print("status        " + ", ".join(f"{k} {v}" for k, v in sorted(stats["by_status"].items())))
    print("skills        " + ", ".join(f"{k} {v}" for k, v in sorted(stats["by_skill"].items())))
    if stats["invalid_reasons"]:
        print("invalid       " + ", ".join(f"{k} {v}" for k, v in stats["invalid_reasons"].items()))
    print(f"played        {stats['played']} (last iteration {stats['last_iteration']})")
    if stats["played"]:
        print("outcomes      " + ", ".join(f"{k} {v}" for k, v in sorted(stats["outcomes"].items())))
        print(f"win rate      {fmt(stats['mean_win_rate'])} alone, {fmt(stats['mean_win_rate_hint'])} with hint, "
              f"mean regret {fmt(stats['mean_regret'])}")
        d = stats["difficulty"]
        print(f"learnable     {fmt(stats['learnable_fraction'])} (0 < win rate < 1), positive regret "
              f"{fmt(stats['positive_regret_fraction'])}; easy {fmt(d['easy'])} medium {fmt(d['medium'])} "
              f"hard {fmt(d['hard'])}")
    return 0


def _refuse_database(target: Path, database: Path) -> None:
    """An export replaces its target: never let that be the memory itself (or its WAL), or any SQLite file."""
    live = {Path(str(database.resolve()) + suffix) for suffix in ("", "-wal", "-shm", "-journal")}
    try:
        with target.open("rb") as fh:
            is_sqlite = fh.read(16) == b"SQLite format 3\x00"
    except OSError:
        is_sqlite = False
    if target.resolve() in live or is_sqlite:
        from spade_mega.curriculum.memory import EnvMemoryError

        raise EnvMemoryError(f"{target}: refusing to overwrite a database (or its WAL) with the export; give a new "
                             "file name, e.g. memory.jsonl")


def _export(args: argparse.Namespace) -> int:
    with _open(args) as memory:
        if args.output in (None, "-"):
            count = memory.export_jsonl(sys.stdout)
        else:
            target = Path(args.output)
            _refuse_database(target, memory.path)
            tmp = target.with_name(target.name + ".tmp")
            try:
                with tmp.open("w", encoding="utf-8") as out:
                    count = memory.export_jsonl(out)
                    out.flush()
                    os.fsync(out.fileno())
            except BaseException:  # the target keeps its old content; no half-written file left beside it
                tmp.unlink(missing_ok=True)
                raise
            tmp.replace(target)
    print(f"exported {count} environments", file=sys.stderr)
    return 0


def _show(args: argparse.Namespace) -> int:
    with _open(args) as memory:
        record = memory.get(args.hash)
    if args.json:
        print(json.dumps(record.to_dict(), indent=2, sort_keys=True))
        return 0
    print(f"environment   {record.content_hash}")
    print(f"skill         {record.skill}    status {record.status}" + (f" ({record.reason})" if record.reason else ""))
    print(f"provenance    {json.dumps(record.provenance, sort_keys=True)}")
    print(f"proposed      {record.proposals} time(s)" + (f"; near-duplicate of {record.duplicate_of[:12]} "
                                                         f"(similarity {record.similarity:.2f})"
                                                         if record.duplicate_of else ""))
    if record.evaluations:
        print("iteration  win rate  with hint  regret  designer reward  plays  hint plays")
        for e in record.evaluations:
            reward = "-" if e.designer_reward is None else f"{e.designer_reward:.3f}"
            hint = "-" if e.win_rate_hint is None else f"{e.win_rate_hint:.3f}"  # no hint play measured the agent
            regret = "-" if e.regret is None else f"{e.regret:.3f}"
            print(f"{e.iteration:9d}  {e.win_rate:8.3f}  {hint:>9}  {regret:>6}  "
                  f"{reward:>15}  {e.plays:5d}  {e.hint_plays:10d}")
    print(f"hint          {record.hint}")
    print("source:")
    print(record.source.rstrip())
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    memory = subparsers.add_parser("memory", help="inspect a run's environment memory",
                                   description="Inspect the environment memory (SQLite) of a run. Safe beside "
                                   "the running trainer on the same node; from another host, read a copy made on "
                                   "that node (sqlite3 memory.sqlite '.backup copy.sqlite'), not the live file.")
    actions = memory.add_subparsers(title="actions", metavar="ACTION", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        parser = actions.add_parser(name, help=help_text, description=help_text)
        parser.add_argument("--run", "-r", default=".", metavar="PATH",
                            help="run directory or memory database file (default: current directory)")
        return parser

    stats = add("stats", "totals: environments, validity, outcomes, win rates, learnable fraction")
    stats.add_argument("--json", action="store_true", help="print JSON")
    stats.set_defaults(func=_guarded(_stats))
    export = add("export", "write every environment with its evaluations as JSON lines")
    export.add_argument("--output", "-o", metavar="FILE", help="output file (default: standard output)")
    export.set_defaults(func=_guarded(_export))
    show = add("show", "one environment: provenance, evaluations, hint and source")
    show.add_argument("hash", metavar="HASH", help="content hash, or a unique prefix of at least 4 characters")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=_guarded(_show))

