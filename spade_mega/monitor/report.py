"""The run report: ``metrics.jsonl`` (and ``config.yaml``) of a run directory as ``report.html`` plus ``plots/*.png``.

One figure per metric group (the name's first part: agent, designer, envs, train, perf, gpu, ...), one panel per
metric (its last part), one line per series in between (``gpu/<i>/power_w``: one line per GPU); each line is the raw
values, faint, under an exponential moving average. The summary table gives first, last, min, max and, where the
name says which way is better, the best value and its step. A line of the metrics file that does not parse (the
half-written last line after a crash) is reported with its number and skipped; the file is only read.
"""

from __future__ import annotations

import base64
import html
import io
import math
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from spade_mega.config.loader import RESOLVED_NAME
from spade_mega.errors import SpadeError
from spade_mega.monitor.records import METRICS_FILE, Record, scan
from spade_mega.monitor.transcripts import report_section

REPORT_FILE, PLOTS_DIR = "report.html", "plots"
GROUP_ORDER = ("agent", "designer", "eval", "envs", "train", "perf", "gpu")
SPARSE = 50  # a series with fewer values is drawn with a marker at each
OFF_SCALE = 1e300  # beyond this an axis's span can overflow a float, which matplotlib cannot draw
# which way is better, from the metric's last name part; anything else gets no "best"
_HIGHER = re.compile(r"return|reward|win_rate|valid_rate|accuracy|solve|tokens_per_s|throughput")
_LOWER = re.compile(r"loss|error|invalid|timeout|latency|(^|_)time(_|$)|_seconds$")  # checked first


@dataclass
class Series:
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass
class Run:
    """A run directory as read for the report."""

    run_dir: Path
    records: list[Record]
    problems: list[str]  # "line N: what is wrong", in file order
    config_text: Optional[str]
    aside_files: list[str]

    def metrics(self) -> dict[str, Series]:
        out: dict[str, Series] = defaultdict(Series)
        for record in self.records:
            for name, value in record.metrics.items():
                out[name].steps.append(record.step)
                out[name].values.append(value)
        return dict(out)


def load_run(run_dir: str | Path) -> Run:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SpadeError(f"{run_dir}: no such run directory; give the run's folder (run.output_dir/run.name), "
                         f"the one holding {METRICS_FILE}")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise SpadeError(f"{path}: no metrics recorded in this run directory; is logging.jsonl true, and has the run "
                         "logged its first step?")
    lines = scan(path)
    records = [line.record for line in lines if line.record is not None]
    problems = [f"line {line.number}: {problem}" for line in lines for problem in line.problems]
    if not any(record.metrics for record in records):
        raise SpadeError(f"{path}: holds no metric values ({len(lines)} line(s), {len(problems)} problem(s)); "
                         "wait for the run to log a step, or check logging.jsonl")
    config = run_dir / RESOLVED_NAME
    return Run(run_dir, records, problems, config.read_text(errors="replace") if config.is_file() else None,
               sorted(p.name for p in run_dir.glob("metrics.aside-*.jsonl")))


def _split(name: str) -> tuple[str, str, str]:
    """``group``, ``series`` (middle parts, '' if none) and ``panel`` (last part) of a metric name."""
    parts = name.split("/")
    if len(parts) == 1:
        return "other", "", name
    return parts[0], "/".join(parts[1:-1]), parts[-1]


def _group_key(group: str) -> tuple[int, str]:
    return (GROUP_ORDER.index(group) if group in GROUP_ORDER else len(GROUP_ORDER), group)


def smooth(values: list[float], weight: float) -> list[float]:
    """TensorBoard's debiased exponential moving average; non-finite values are skipped (the average carries on)."""
    out, last, norm = [], 0.0, 0.0
    for value in values:
        if math.isfinite(value):
            last = weight * last + (1 - weight) * value
            norm = weight * norm + (1 - weight)
        out.append(last / norm if norm > 0 else math.nan)
    return out


def _weight(n: int) -> float:
    """Smoothing over about a thirtieth of the run, so the trend reads the same at 100 steps or 100,000."""
    return 1.0 - 1.0 / max(1.0, n / 30.0)


def direction(name: str) -> int:
    leaf = name.rsplit("/", 1)[-1]
    return -1 if _LOWER.search(leaf) else 1 if _HIGHER.search(leaf) else 0


def plot_group(group: str, metrics: dict[str, Series]) -> bytes:
    """One PNG: a panel per metric leaf of ``group``, a raw + smoothed line per series."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels: dict[str, dict[str, Series]] = defaultdict(dict)
    for name, series in metrics.items():
        _, label, panel = _split(name)
        panels[panel][label] = series
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(4.6 * cols, 3.0 * rows + 0.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(group, fontsize=13, fontweight="bold")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (panel, lines) in zip(axes, sorted(panels.items())):
        non_finite = 0
        for i, (label, series) in enumerate(sorted(lines.items(), key=lambda kv: (len(kv[0]), kv[0]))):
            color = f"C{i % 10}"
            raw = [v if math.isfinite(v) and abs(v) <= OFF_SCALE else math.nan for v in series.values]
            ax.plot(series.steps, raw, color=color, alpha=0.25, linewidth=0.8)
            # a sparse metric (an evaluation now and then) shows its points: a line through one point draws nothing
            ax.plot(series.steps, smooth(raw, _weight(len(series.values))), color=color,
                    linewidth=1.6, label=f"{group}/{label}" if label else None,
                    marker="o" if len(series.values) < SPARSE else None, markersize=3.5)
            bad = [s for s, v in zip(series.steps, raw) if not math.isfinite(v)]
            non_finite += len(bad)
            # NaN/inf (and off-scale) steps as red crosses along the bottom edge (x in data, y in axes coordinates)
            ax.plot(bad, [0.03] * len(bad), "x", color="red", markersize=5, transform=ax.get_xaxis_transform())
        ax.set_title(panel + (f"  ({non_finite} non-finite or off-scale: red x)" if non_finite else ""), fontsize=10)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        if len(lines) > 1:
            ax.legend(fontsize=7, ncols=2 if len(lines) > 4 else 1)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax in axes[-cols:]:
        ax.set_xlabel("step", fontsize=9)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


@dataclass(frozen=True)
class Summary:
    name: str
    count: int
    non_finite: int
    first: float
    last: float
    low: float
    high: float
    best: Optional[tuple[float, int]]  # value and step, where the direction is known


def summarise(name: str, series: Series) -> Summary:
    finite = [(v, s) for v, s in zip(series.values, series.steps) if math.isfinite(v)]
    values = [v for v, _ in finite] or [math.nan]
    way = direction(name)
    best = max(finite, key=lambda vs: way * vs[0]) if finite and way else None  # its first occurrence
    return Summary(name, len(series.values), len(series.values) - len(finite), values[0], values[-1],
                   min(values), max(values), best)


def _fmt(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else "n/a"


def _seconds(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "unknown"
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours} h {rest // 60:02d} min {rest % 60:02d} s" if hours else f"{rest // 60} min {rest % 60:02d} s"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "_"


_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1500px}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left;font-family:monospace}th{background:#f3f3f3}
img{max-width:100%;border:1px solid #eee}pre{background:#f7f7f7;padding:1em;font-size:12px;overflow:auto}
.problems{color:#a33}"""


def _evaluation_table(metrics: dict[str, Series]) -> str:
    """The held-out scores (``eval/<suite>/<metric>``, spade_mega/evaluation) in one table: a row per suite and
    evaluation, a column per metric; empty when the run has none."""
    rows: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    columns: list[str] = []
    for name, series in metrics.items():
        group, suite, leaf = _split(name)
        if group != "eval" or not suite:
            continue
        columns += [] if leaf in columns else [leaf]
        for step, value in zip(series.steps, series.values):
            rows[(suite, step)][leaf] = value
    if not rows:
        return ""
    e = html.escape
    body = "".join(f"<tr><td>{e(suite)}</td><td>{step}</td>"
                   + "".join(f"<td>{_fmt(values[c]) if c in values else ''}</td>" for c in columns) + "</tr>"
                   for (suite, step), values in sorted(rows.items()))
    return ('<h2 id="evaluation">Evaluation</h2><p>Held-out suites, scored after the rollout of each step (step 0: '
            "before training).</p><table><tr><th>suite</th><th>step</th>"
            + "".join(f"<th>{e(c)}</th>" for c in columns) + f"</tr>{body}</table>")


def _html(run: Run, figures: list[tuple[str, str, bytes]], summaries: list[Summary]) -> str:
    e = html.escape
    records = run.records
    times = [r.time for r in records if math.isfinite(r.time)]
    head = [f"<h1>Run report: {e(run.run_dir.name)}</h1>",
            f"<p>{e(str(run.run_dir.resolve()))}<br>{len(records)} records, steps {min(r.step for r in records)} to "
            f"{max(r.step for r in records)}, run time {_seconds(max(times) - min(times) if times else math.nan)} "
            f"(first to last record); report made {time.strftime('%Y-%m-%d %H:%M:%S')}</p>",
            "<p>Groups: " + ", ".join(f'<a href="#{e(g)}">{e(g)}</a>' for g, _, _ in figures) + "</p>"]
    head.append(_evaluation_table(run.metrics()))
    if run.problems:
        head.append(f'<div class="problems"><h2>Skipped in {METRICS_FILE}</h2><ul>'
                    + "".join(f"<li>{e(p)}</li>" for p in run.problems) + "</ul></div>")
    if run.aside_files:
        head.append("<p>Records set aside by a resume or a new run (not plotted): "
                    + ", ".join(e(n) for n in run.aside_files) + "</p>")
    plots = [f'<h2 id="{e(group)}">{e(group)}</h2><img alt="{e(group)}" src="data:image/png;base64,'
             f'{base64.b64encode(png).decode()}"><p><a href="{e(rel)}">{e(rel)}</a></p>' for group, rel, png in figures]
    rows = "".join(
        f"<tr><td>{e(s.name)}</td><td>{s.count}</td><td>{s.non_finite or ''}</td><td>{_fmt(s.first)}</td>"
        f"<td>{_fmt(s.last)}</td><td>{_fmt(s.low)}</td><td>{_fmt(s.high)}</td>"
        f"<td>{'' if s.best is None else f'{_fmt(s.best[0])} (step {s.best[1]})'}</td></tr>" for s in summaries)
    table = ("<h2>Summary</h2><table><tr><th>metric</th><th>records</th><th>non-finite</th><th>first</th>"
             f"<th>last</th><th>min</th><th>max</th><th>best</th></tr>{rows}</table>")
    config = (f"<h2>Config</h2><pre>{e(run.config_text)}</pre>" if run.config_text is not None
              else f"<h2>Config</h2><p>no {RESOLVED_NAME} in the run directory</p>")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{e(run.run_dir.name)}: spade-mega report"
            f"</title><style>{_STYLE}</style></head><body>{''.join(head)}{''.join(plots)}{table}"
            f"{report_section(run.run_dir)}{config}"
            "</body></html>\n")


@dataclass(frozen=True)
class Report:
    html: Path
    plots: list[Path]
    run: Run


def build_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Report:
    """Write ``report.html`` and ``plots/<group>.png`` into ``out_dir`` (default: the run directory)."""
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.run_dir
    try:
        return _write_report(run, out)
    except OSError as exc:
        raise SpadeError(f"{out}: cannot write the report there ({exc.strerror or exc}); give --out a folder "
                         "you can write to") from exc


def _write_report(run: Run, out: Path) -> Report:
    (out / PLOTS_DIR).mkdir(parents=True, exist_ok=True)
    metrics = run.metrics()
    groups: dict[str, dict[str, Series]] = defaultdict(dict)
    for name, series in metrics.items():
        groups[_split(name)[0]][name] = series
    figures, paths = [], []
    for group in sorted(groups, key=_group_key):
        png = plot_group(group, groups[group])
        path = out / PLOTS_DIR / f"{_safe(group)}.png"
        path.write_bytes(png)
        figures.append((group, f"{PLOTS_DIR}/{path.name}", png))
        paths.append(path)
    names = sorted(metrics, key=lambda n: (_group_key(_split(n)[0]), n))
    page = out / REPORT_FILE
    page.write_text(_html(run, figures, [summarise(n, metrics[n]) for n in names]), encoding="utf-8")
    return Report(page, paths, run)
