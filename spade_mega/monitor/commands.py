"""``spade-mega report RUN_DIR [--out DIR]``: a run's metrics as an HTML page with plots and a summary table."""

from __future__ import annotations

import argparse
import sys


def _report(args: argparse.Namespace) -> int:
    from spade_mega.monitor.records import METRICS_FILE
    from spade_mega.monitor.report import PLOTS_DIR, build_report

    report = build_report(args.run_dir, args.out)
    for problem in report.run.problems:
        print(f"warning: {report.run.run_dir / METRICS_FILE} {problem}", file=sys.stderr)
    print(f"report: {report.html} ({len(report.run.records)} records, {len(report.plots)} plots in "
          f"{report.html.parent / PLOTS_DIR})")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    report = subparsers.add_parser(
        "report", help="write a run's report: plots of its metrics, a summary table, its config",
        description="Read RUN_DIR/metrics.jsonl (and config.yaml) and write report.html with one plot per metric "
                    "group (also as plots/<group>.png), a summary table and the resolved config. Unreadable lines "
                    "are reported by number and skipped; the run's files are not changed.")
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (run.output_dir/run.name)")
    report.add_argument("--out", metavar="DIR", help="where to write report.html and plots/ (default: RUN_DIR)")
    report.set_defaults(func=_report)
