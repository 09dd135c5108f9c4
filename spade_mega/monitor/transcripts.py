"""Rollout transcripts: what the model wrote in each rollout, one gzip JSONL file per rollout under the run directory.

``<run dir>/rollouts/rollout_<N:06d>.jsonl.gz`` holds one JSON object per line, one per trajectory of rollout N
(every agent episode, hint plays included, every designer output, and every designer reward released in that rollout);
:mod:`spade_mega.selfplay.transcripts` builds them and ``spade-mega rollouts`` prints them. This module only knows the
files: it writes them atomically (a temporary file, fsync, rename, so a crash never leaves a torn file under the final
name), reads them back, clips long text fields and discards the rollouts a resumed run plays again.
"""

from __future__ import annotations

import gzip
import html
import json
import re
import threading
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Optional

from spade_mega.errors import SpadeError
from spade_mega.files import replace_atomically

TRANSCRIPTS_DIR = "rollouts"
_NAME = re.compile(r"rollout_(\d{6,})\.jsonl\.gz")
CUT = "\n[... {n} characters cut ...]\n"


class TranscriptError(SpadeError):
    """A run without transcripts, a rollout that has none, or a transcript file that cannot be read."""


def transcript_path(run_dir: str | Path, rollout: int) -> Path:
    return Path(run_dir) / TRANSCRIPTS_DIR / f"rollout_{rollout:06d}.jsonl.gz"


def clip(text: Optional[str], limit: int) -> Optional[str]:
    """``text`` kept whole up to ``limit`` characters, else its head and tail around a marker saying how much was
    cut: a long prompt's head holds the instructions, its tail the latest observation, both worth reading."""
    if text is None or len(text) <= limit:
        return text
    keep = max(limit - len(CUT.format(n=len(text))), 2)
    head = (keep + 1) // 2
    tail = keep - head
    return text[:head] + CUT.format(n=len(text) - keep) + text[len(text) - tail:]


def write_rollout(run_dir: str | Path, rollout: int, records: Iterable[dict[str, Any]]) -> Path:
    """Write rollout ``rollout``'s records, replacing any earlier file of that rollout only once complete."""
    target = transcript_path(run_dir, rollout)
    target.parent.mkdir(parents=True, exist_ok=True)

    def write(raw: BinaryIO) -> None:
        # mtime 0: the same records give the same bytes (a resumed run's file equals the straight run's)
        with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False, allow_nan=False,
                                   separators=(",", ":")).encode("utf-8") + b"\n")

    return replace_atomically(target, write)


class BackgroundWriter:
    """Runs one write at a time on a thread: compressing a large rollout's file takes seconds (tools/bench/transcripts),
    which then overlap the weight sync and the next rollout instead of holding rank 0 while every other rank waits.
    ``submit`` first waits for the previous write; ``wait`` before anything that must find the file (the checkpoint
    of that rollout, the end of the run). An exception of a write is raised by the next ``wait`` or ``submit``."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def _run(self, write: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            write(*args)
        except BaseException as exc:  # raised in the caller's thread by wait()
            self._error = exc

    def submit(self, write: Callable[..., Any], *args: Any) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(write, args), name="spade-transcript", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


def rollouts_written(run_dir: str | Path) -> list[int]:
    """The rollouts that have a transcript file, in order."""
    folder = Path(run_dir) / TRANSCRIPTS_DIR
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _NAME.fullmatch(p.name)))


def discard_after(run_dir: str | Path, rollout: int) -> list[int]:
    """Delete the transcripts of rollouts after ``rollout`` (and temporary files a crash left): a resumed run plays
    those rollouts again. Returns the rollouts deleted."""
    folder = Path(run_dir) / TRANSCRIPTS_DIR
    gone = [r for r in rollouts_written(run_dir) if r > rollout]
    for r in gone:
        transcript_path(run_dir, r).unlink()
    if folder.is_dir():
        for tmp in folder.glob("rollout_*.jsonl.gz.tmp"):
            tmp.unlink()
    return gone


def read_rollout(run_dir: str | Path, rollout: Optional[int] = None) -> tuple[int, list[dict[str, Any]]]:
    """The records of ``rollout`` (default: the newest one written) and its number."""
    if not Path(run_dir).is_dir():
        raise TranscriptError(f"{run_dir}: no such run directory; give the run's folder (run.output_dir/run.name)")
    written = rollouts_written(run_dir)
    if not written:
        raise TranscriptError(f"{Path(run_dir) / TRANSCRIPTS_DIR}: this run has no rollout transcripts (written "
                              "from the first rollout on when logging.transcripts is true)")
    if rollout is None:
        rollout = written[-1]
    if rollout not in written:
        raise TranscriptError(f"{run_dir}: no transcript of rollout {rollout}; the run has rollouts "
                              f"{_ranges(written)}")
    path = transcript_path(run_dir, rollout)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    # zlib.error: a gzip header over a corrupt deflate stream (no OSError)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TranscriptError(f"{path}: cannot read this transcript ({type(exc).__name__}: {exc})") from None
    bad = next((n for n, record in enumerate(records, 1) if not isinstance(record, dict)), None)
    if bad is not None:
        raise TranscriptError(f"{path}: cannot read this transcript (record {bad} is a JSON "
                              f"{type(records[bad - 1]).__name__}, not an object)")
    return rollout, records


def _ranges(values: list[int]) -> str:
    """``1-4, 7`` for [1, 2, 3, 4, 7]."""
    parts, start = [], values[0]
    for prev, cur in zip(values, values[1:] + [None]):
        if cur is None or cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


# --- reading for people: the CLI viewer and the report -----------------------------------------------------------


def score(record: dict[str, Any]) -> Optional[float]:
    """What ranks a record for --best/--worst: its advantage when it was trained on, else its reward (a hint play's,
    a masked designer reward's), None while a designer output waits for its reward."""
    if record.get("trained") and record.get("advantage") is not None:
        return float(record["advantage"])
    return None if record.get("reward") is None else float(record["reward"])


def _find(run_dir: str | Path, rollout: Optional[int], kind: str, ids: set[str]) -> dict[str, dict[str, Any]]:
    """The designer records of ``kind`` with these ids in rollout ``rollout``'s file, if it was written."""
    if rollout is None or not ids or not transcript_path(run_dir, rollout).is_file():
        return {}
    return {r["id"]: r for r in read_rollout(run_dir, rollout)[1]
            if r.get("role") == "designer" and r.get("kind") == kind and r.get("id") in ids}


def designer_entries(run_dir: str | Path, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A rollout's designer records, one entry per designer output: its output record, merged with its reward
    record (from the rollout that released it), so that a program reads beside its regret. The outputs written in
    this rollout come first, then the rewards released in it for outputs of earlier rollouts."""
    outputs = {r["id"]: r for r in records if r.get("role") == "designer" and r.get("kind") == "output"}
    order = list(outputs)
    rewards = {r["id"]: r for r in records if r.get("role") == "designer" and r.get("kind") == "reward"}
    for rollout in {r.get("reward_rollout") for r in outputs.values() if r["id"] not in rewards}:
        rewards.update(_find(run_dir, rollout, "reward", {i for i in outputs if i not in rewards}))
    for rollout in {r.get("output_rollout") for r in rewards.values() if r["id"] not in outputs}:
        outputs.update(_find(run_dir, rollout, "output", {i for i in rewards if i not in outputs}))
    order = list(dict.fromkeys(order + list(rewards)))
    entries = []
    for i in order:
        reward = rewards.get(i, {})
        merged = {**outputs.get(i, {}), **{k: v for k, v in reward.items() if k not in ("kind", "rollout")}}
        output = outputs.get(i)
        merged.update(kind="design", released=bool(reward),
                      output_rollout=output["rollout"] if output else reward.get("output_rollout"),
                      reward_rollout=reward["rollout"] if reward else (output or {}).get("reward_rollout"))
        entries.append(merged)
    return entries


def select(run_dir: str | Path, records: list[dict[str, Any]], role: Optional[str] = None,
           env: Optional[str] = None, order: Optional[str] = None) -> list[dict[str, Any]]:
    """The records to show: agent episodes and designer entries (:func:`designer_entries`), of ``role`` only if
    given, of the environment ``env`` (a prefix of its id, its group env<i>, or a library program's name) only if
    given, ranked by :func:`score` for ``order`` "best" or "worst" (unscored ones last), else in rollout order."""
    chosen = [] if role == "designer" else [r for r in records if r.get("role") == "agent"]
    if role != "agent":
        chosen += designer_entries(run_dir, records)
    if env is not None:
        chosen = [r for r in chosen if str(r.get("env_id", "")).startswith(env) or env in (r.get("group"),
                                                                                              r.get("env_name"))]
    if order is not None:
        sign = -1.0 if order == "best" else 1.0
        chosen.sort(key=lambda r: (score(r) is None, sign * (score(r) or 0.0)))
    return chosen


REPORT_CHARS = 3000  # per text field in the report


REPORT_LOOKBACK = 50  # rollouts searched back for the newest designer outputs (written every regen_interval)


def report_section(run_dir: str | Path) -> str:
    """The report's look at the newest rollout: its highest- and lowest-advantage agent episodes (one, titled so, when
    only one was trained), and the best designer output of the newest rollout that has any (said to be pending while
    none of them has its delayed reward), as escaped HTML ("" for a run without transcripts)."""
    written = rollouts_written(run_dir)
    if not written:
        return ""
    try:
        rollout, records = read_rollout(run_dir)
        agents = select(run_dir, records, "agent", order="best")
        designers: list[dict[str, Any]] = []
        for designed in reversed(written[-REPORT_LOOKBACK:]):
            designers = select(run_dir, records if designed == rollout else read_rollout(run_dir, designed)[1],
                               "designer", order="best")
            if designers:
                break
    except TranscriptError as exc:
        return f"<h2>Rollout transcripts</h2><p class='problems'>{html.escape(str(exc))}</p>"
    trained = [r for r in agents if r.get("trained")] or agents
    if len(trained) == 1:  # both the highest and the lowest
        only = "trained agent episode" if trained[0].get("trained") else "agent episode"
        picks = [(f"the only {only} (rollout {rollout})", trained[0])]
    else:
        picks = [(f"highest-advantage agent episode (rollout {rollout})", trained[0]),
                 (f"lowest-advantage agent episode (rollout {rollout})", trained[-1])] if trained else []
    if designers:  # ranked with the unscored last: none is scored while every reward is still delayed
        best = "best designer output" if score(designers[0]) is not None else "designer output, reward pending"
        picks.append((f"{best} (rollout {designed})", designers[0]))
    parts = [f"<h2 id='transcripts'>Rollout transcripts</h2><p>Newest rollout: {rollout}; every one: "
             f"<code>spade-mega rollouts {html.escape(str(run_dir))} [--rollout N]</code></p>"]
    for title, record in picks:
        facts = ", ".join(f"{k} {html.escape(str(record.get(k)))}" for k in
                          ("id", "skill", "env_id", "reward", "advantage", "trained") if record.get(k) is not None)
        if record.get("role") == "agent":
            text = "\n\n".join([f"[prompt]\n{record.get('prompt')}"] + [
                f"[turn {t}, step reward {turn.get('reward')}]\n{turn.get('reply')}\n[observation]\n"
                f"{turn.get('observation')}" for t, turn in enumerate(record.get("turns") or [], 1)])
        else:
            text = (f"[reply]\n{record.get('reply')}" if record.get("program") is None else
                    f"[program]\n{record.get('program')}\n\n[hint]\n{record.get('hint')}")
            facts += f", valid {html.escape(str(record.get('valid')))}" + "".join(
                f", {html.escape(k)} {v:.4g}" for k, v in (record.get("components") or {}).items())
        parts.append(f"<h3>{html.escape(title)}</h3><p>{facts}</p><pre>{html.escape(clip(text, REPORT_CHARS) or '')}"
                     "</pre>")
    return "".join(parts)
