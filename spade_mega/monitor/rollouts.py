"""``spade-mega rollouts RUN_DIR``: read what the model wrote in a rollout, beside its reward and advantage.

Prints the transcripts of :mod:`spade_mega.monitor.transcripts` (newest rollout by default): agent episodes turn by
turn, designer outputs with their program, hint, validation verdict and (once released) their reward parts. Model text
is printed as plain text, never as rich markup.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any, Optional

from spade_mega.monitor.transcripts import clip, read_rollout, select

SHOWN_CHARS = 1500  # per text field on the console (the file keeps up to logging.transcript_max_chars)
SHOWN_RECORDS = 20  # a 30B-recipe rollout holds ~800 episodes


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 but newline and tab, DEL, C1


def _printable(value: Any) -> Any:
    """``value`` with the control characters of its strings shown escaped (``\\x1b``): model and program text must
    not drive the reader's terminal (clear what was printed, set the clipboard)."""
    if isinstance(value, str):
        return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", value)
    if isinstance(value, dict):
        return {k: _printable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_printable(v) for v in value]
    return value


def _number(value: Any) -> str:
    return "-" if value is None else f"{value:+.4g}" if isinstance(value, float) else str(value)


def _facts(record: dict[str, Any]) -> str:
    """One line: where it was played or written, what it earned and whether it was trained on."""
    env = str(record.get("env_id", ""))[:16]
    name = f" ({record['env_name']})" if record.get("env_name") else ""
    parts = [f"skill {record.get('skill')}", f"env {env}{name}", f"group {record.get('group')}",
             f"weights v{_number(record.get('weight_version'))}"]
    if record.get("role") == "agent":
        parts += ["hint play" if record.get("hinted") else "no hint", f"seed {record.get('seed')}",
                  f"return {_number(record.get('return'))}"]
    if record.get("role") == "designer" and not record.get("released"):
        parts.append(f"reward pending (released at rollout {record.get('reward_rollout')}), not trained yet")
    else:
        parts += [f"reward {_number(record.get('reward'))}", f"advantage {_number(record.get('advantage'))}",
                  "trained" if record.get("trained") else "not trained (its optimizer step was skipped: gradients "
                  "not finite)" if record.get("step_skipped") else "not trained (filtered: its group's rewards are all "
                  "equal)" if record.get("filtered") else "not trained"]
    tokens = record.get("tokens") or {}
    parts.append(f"tokens {tokens.get('prompt', '?')} prompt + {tokens.get('generated', '?')} generated")
    return " | ".join(parts)


def _print_agent(console: Any, record: dict[str, Any], chars: int) -> None:
    from rich.text import Text

    end = "terminated" if record.get("terminated") else "truncated"
    if record.get("failure"):
        end += f", {record['failure']}: {record.get('failure_detail') or ''}"
    if record.get("measured") is False:
        end += " (its program broke it: no measurement of the agent, in no return, win rate or regret)"
    console.print(Text(f"{_facts(record)} | {end}", style="cyan"))
    _block(console, "prompt", record.get("prompt"), chars, "dim")
    for t, turn in enumerate(record.get("turns") or [], 1):
        console.print(Text(f"turn {t} ({turn.get('finish_reason')}), step reward {_number(turn.get('reward'))}",
                           style="bold"))
        _block(console, "reply", turn.get("reply"), chars)
        if turn.get("action") != turn.get("reply"):
            _block(console, "action", turn.get("action"), chars, "green")
        _block(console, "observation", turn.get("observation"), chars, "dim")


def _print_designer(console: Any, record: dict[str, Any], chars: int) -> None:
    from rich.text import Text

    console.print(Text(_facts(record), style="cyan"))
    verdict = "valid" if record.get("valid") else f"invalid ({record.get('rejection')})"
    if record.get("components"):
        verdict += " | " + ", ".join(f"{k} {_number(v)}" for k, v in record["components"].items())
    if record.get("mask_reason"):
        verdict += f" | masked: {record['mask_reason']}"
    console.print(Text(verdict, style="bold"))
    if "prompt" not in record:
        console.print(Text(f"(its output, rollout {record.get('output_rollout')}, has no transcript)", style="dim"))
        return
    _block(console, "prompt", record.get("prompt"), chars, "dim")
    _block(console, "reply", record.get("reply"), chars)
    if record.get("program") is not None:
        _block(console, "program", record.get("program"), chars, "green")
        _block(console, "hint", record.get("hint"), chars, "green")
    if record.get("parse_error"):
        _block(console, "parse error", f"{record['parse_error']}: {record.get('parse_detail') or ''}", chars, "red")
    validation = record.get("validation")
    if validation and not validation.get("ok"):
        _block(console, "validation", f"{validation.get('reason')}: {validation.get('detail')}\n"
                                      f"{validation.get('output') or ''}".rstrip(), chars, "red")


def _block(console: Any, label: str, text: Optional[str], chars: int, style: str = "") -> None:
    from rich.text import Text

    if text is None:
        return
    console.print(Text(f"{label}:", style="bold"))
    console.print(Text(clip(text, chars) if chars else text, style=style))


def _rollouts(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.text import Text

    rollout, records = read_rollout(args.run_dir, args.rollout)
    order = "best" if args.best else "worst" if args.worst else None
    chosen = select(args.run_dir, records, args.role, args.env, order)
    shown = chosen[:args.limit] if args.limit else chosen
    if args.json:
        for record in shown:
            print(json.dumps(record, ensure_ascii=False))
        return 0
    console = Console(highlight=False, soft_wrap=True)  # long lines (a program's) are left whole, not re-wrapped
    agents = [r for r in records if r.get("role") == "agent"]
    trained, hinted = sum(bool(r.get("trained")) for r in agents), sum(bool(r.get("hinted")) for r in agents)
    console.print(Text(
        f"rollout {rollout} of {args.run_dir}: {len(agents)} agent episode(s) ({trained} trained, {hinted} hint "
        "plays), "
        f"{sum(r.get('kind') == 'output' for r in records)} designer output(s), "
        f"{sum(r.get('kind') == 'reward' for r in records)} designer reward(s) released; showing {len(shown)} of "
        f"{len(chosen)}" + (f" ({order} advantage first)" if order else ""), style="bold"))
    for record in map(_printable, shown):
        title = f"{record.get('role')} {record.get('id')}"
        console.rule(Text(title, style="bold magenta"))
        (_print_agent if record.get("role") == "agent" else _print_designer)(console, record, args.chars)
    if len(shown) < len(chosen):
        console.print(Text(f"{len(chosen) - len(shown)} more: raise --limit", style="dim"))
    return 0


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "rollouts", help="print what the model wrote in a rollout: agent episodes and designer outputs",
        description="Read RUN_DIR/rollouts/rollout_<N>.jsonl.gz (written when logging.transcripts is true) and print "
                    "its agent episodes turn by turn and its designer outputs (program, hint, validation, reward "
                    "parts once released), each with its reward, advantage and whether it was trained on.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (run.output_dir/run.name)")
    parser.add_argument("--rollout", type=int, metavar="N", help="the rollout to show (default: the newest)")
    parser.add_argument("--role", choices=("agent", "designer"), help="only agent episodes, or only designer outputs")
    parser.add_argument("--env", metavar="ID", help="only this environment: a prefix of its id (program hash), its "
                                                    "group (env0, env1, ...) or a library program's name")
    ranking = parser.add_mutually_exclusive_group()
    ranking.add_argument("--best", action="store_true", help="highest advantage first (reward where not trained)")
    ranking.add_argument("--worst", action="store_true", help="lowest advantage first")
    parser.add_argument("--limit", type=_count, default=SHOWN_RECORDS, metavar="K",
                        help=f"show at most K (default {SHOWN_RECORDS}; 0: all)")
    parser.add_argument("--chars", type=_count, default=SHOWN_CHARS, metavar="C",
                        help=f"characters shown per text field, head and tail (default {SHOWN_CHARS}; 0: all)")
    parser.add_argument("--json", action="store_true", help="print the selected records as JSON lines instead")
    parser.set_defaults(func=_rollouts)
