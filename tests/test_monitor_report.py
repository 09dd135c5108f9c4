"""``spade-mega report RUN_DIR`` on a realistic run: a few hundred steps in six groups written by MetricsLogger, a NaN
grad norm, the half-written line a crash leaves, and the run's resolved config."""

from __future__ import annotations

import hashlib
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from spade_mega import cli
from spade_mega.config.loader import load_config, save_resolved
from spade_mega.config.schema import LoggingConfig
from spade_mega.monitor import METRICS_FILE, MetricsLogger
from spade_mega.monitor.report import Series, direction, smooth, summarise

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("spade-mega")
GROUPS = ("agent", "designer", "envs", "train", "perf", "gpu")
STEPS = 300


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "tiny"
    save_resolved(load_config(ROOT / "examples" / "configs" / "tiny_cpu.yaml"), run)
    rng = random.Random(0)
    with MetricsLogger(run, LoggingConfig(tensorboard=False, gpu_stats=False)) as logger:
        for step in range(1, STEPS + 1):
            ret = 0.2 + 0.5 * (1 - math.exp(-step / 80)) + rng.gauss(0, 0.08)
            logger.log(step, {"agent/return": ret, "agent/return_hint": ret + 0.15, "designer/regret": 0.15,
                              "designer/reward": 0.5 + rng.gauss(0, 0.1), "envs/valid_rate": 0.6 + step / 1000},
                       commit=False)
            logger.log(step, {"loss": 1 / (1 + step / 50), "grad_norm": math.nan if step == 150 else 0.8},
                       prefix="train", commit=False)
            logger.log(step, {"perf/tokens_per_s": 1200.0 + rng.gauss(0, 50),
                              **{f"gpu/{i}/memory_used_gib": 60.0 + i for i in range(2)}})
    with open(run / METRICS_FILE, "ab") as f:
        f.write(b'{"step":301,"time":1795000000.1,"agent/ret')  # the crash hit while this line was written
    return run


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_report_command_writes_plots_table_and_config(run_dir: Path, tmp_path: Path) -> None:
    before = digest(run_dir / METRICS_FILE)
    out = tmp_path / "report"
    proc = subprocess.run([str(SCRIPT), "report", str(run_dir), "--out", str(out)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert f"({STEPS} records, {len(GROUPS)} plots" in proc.stdout
    # the torn last line is named by its number and skipped; the user's file is left as it was
    assert f"line {STEPS + 1}: not valid JSON" in proc.stderr and "Traceback" not in proc.stderr
    assert digest(run_dir / METRICS_FILE) == before and not (run_dir / "report.html").exists()
    for group in GROUPS:
        with Image.open(out / "plots" / f"{group}.png") as image:
            image.verify()
            assert image.format == "PNG" and image.size[0] >= 400 and image.size[1] >= 300
    page = (out / "report.html").read_text()
    for group in GROUPS:
        assert f'<h2 id="{group}">' in page and f'<img alt="{group}" src="data:image/png;base64,' in page
        assert f'href="plots/{group}.png"' in page
    assert f"line {STEPS + 1}: not valid JSON" in page
    assert "<td>train/grad_norm</td><td>300</td><td>1</td>" in page  # one non-finite value, counted
    assert f"{STEPS} records, steps 1 to {STEPS}" in page
    assert "tiny" in page and "<h2>Config</h2><pre>" in page  # the resolved config.yaml


def test_report_defaults_to_the_run_directory(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["report", str(run_dir)]) == 0
    assert (run_dir / "report.html").is_file() and len(list((run_dir / "plots").glob("*.png"))) == len(GROUPS)
    assert str(run_dir / "report.html") in capsys.readouterr().out


@pytest.mark.parametrize("setup, words", [
    (None, "no such run directory"),
    (b"", "no metrics recorded"),
    (b'{"step":1,"time":1.0}\n{"step":2,"ti', "holds no metric values (2 line(s), 1 problem(s))"),
])
def test_nothing_to_report_is_one_line_saying_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          setup: bytes | None, words: str) -> None:
    run = tmp_path / "run"
    if setup is not None:
        run.mkdir()
        if setup:
            (run / METRICS_FILE).write_bytes(setup)
    assert cli.main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("spade-mega: error: ") and words in err[0]


def test_summary_first_last_best() -> None:
    series = Series(steps=[1, 2, 3, 4, 5], values=[0.5, math.nan, 0.9, 0.1, 0.9])
    up = summarise("agent/return", series)
    assert (up.count, up.non_finite, up.first, up.last, up.low, up.high) == (5, 1, 0.5, 0.9, 0.1, 0.9)
    assert up.best == (0.9, 3)  # the first time the best value was reached
    assert summarise("train/loss", series).best == (0.1, 4)
    assert summarise("designer/regret", series).best is None  # no "better" direction for regret
    assert [direction(n) for n in ("perf/tokens_per_s", "perf/step_time_s", "envs/valid_rate", "envs/invalid_rate",
                                   "agent/win_rate")] == [1, -1, 1, -1, 1]


def test_smoothing_skips_non_finite_values() -> None:
    assert smooth([2.0, 2.0, math.nan, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0, 2.0])
    assert math.isnan(smooth([math.nan, 1.0], 0.5)[0]) and smooth([math.nan, 1.0], 0.5)[1] == pytest.approx(1.0)
    rising = smooth([float(i) for i in range(100)], 0.9)
    assert all(a < b for a, b in zip(rising, rising[1:])) and rising[-1] < 99  # follows the trend, lags behind


def test_odd_lines_and_an_unwritable_target_never_end_in_a_traceback(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / METRICS_FILE).write_bytes(b'{"step":1,"time":1.0,"agent/return":0.5,"agent/\\ud800":1.0}\n'
                                     b'{"step":2,"time":2.0,"agent/return":0.7,"<b>x</b>/\\"y":2.0}\n')
    assert cli.main(["report", str(run)]) == 0  # a name that is not text (a lone surrogate) crashed the plotting
    captured = capsys.readouterr()
    assert "line 1: metric name 'agent/\\ud800' is not valid text" in captured.err
    page = (run / "report.html").read_text(encoding="utf-8")
    assert "<td>&lt;b&gt;x&lt;/b&gt;/&quot;y</td>" in page and "<b>x</b>" not in page  # names are escaped
    target = tmp_path / "a-file"
    target.write_text("not a folder")
    assert cli.main(["report", str(run), "--out", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(target) in err[0] and "cannot write the report" in err[0]
    assert target.read_text() == "not a folder"


def test_a_metric_logged_once_is_drawn(tmp_path: Path) -> None:
    """An evaluation logged at one step only: a line through one point draws nothing, so its panel was empty."""
    with MetricsLogger(tmp_path, LoggingConfig(tensorboard=False, gpu_stats=False)) as logger:
        for step in range(1, 101):
            logger.log(step, {"train/loss": 1 / step, **({"eval/aime": 0.3} if step == 50 else {})})
    assert cli.main(["report", str(tmp_path)]) == 0
    with Image.open(tmp_path / "plots" / "eval.png") as image:
        pixels = image.convert("RGB").getcolors(maxcolors=1 << 20)
    line_colour = (0x1F, 0x77, 0xB4)  # matplotlib's C0, the first series
    assert sum(n for n, rgb in pixels if all(abs(a - b) < 40 for a, b in zip(rgb, line_colour))) >= 10
    assert "<td>eval/aime</td><td>1</td>" in (tmp_path / "report.html").read_text()


def test_values_near_the_float_limit_are_marked_not_fatal(tmp_path: Path) -> None:
    """A sentinel such as sys.float_info.max next to ordinary values: matplotlib cannot size an axis whose span
    overflows ('arange: cannot compute length'), which ended the whole report."""
    with MetricsLogger(tmp_path, LoggingConfig(tensorboard=False, gpu_stats=False)) as logger:
        for step, value in enumerate([0.5, sys.float_info.max, 0.25, -sys.float_info.max, 0.125], start=1):
            logger.log(step, {"train/loss": value, "agent/return": 0.5})
    assert cli.main(["report", str(tmp_path)]) == 0
    with Image.open(tmp_path / "plots" / "train.png") as image:
        image.verify()
    page = (tmp_path / "report.html").read_text()
    assert "<td>train/loss</td><td>5</td><td></td><td>0.5</td><td>0.125</td><td>-1.798e+308</td>" in page
