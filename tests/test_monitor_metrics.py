"""MetricsLogger as the self-play loop uses it: real metrics.jsonl files, real TensorBoard event files read back with
tensorboard's EventAccumulator, a real crashed process and a resume from an earlier checkpoint step."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from spade_mega.config.schema import LoggingConfig
from spade_mega.monitor import METRICS_FILE, MetricError, MetricsLogger, current_rank, scan

CFG = LoggingConfig(gpu_stats=False)  # GPU stats would add gpu/... keys on a GPU host; they have their own tests
ROOT = Path(__file__).resolve().parents[1]


def strict_lines(path: Path) -> list[dict]:
    """Every line parsed by a JSON parser that refuses NaN/Infinity literals (what jq and JavaScript accept)."""

    def refuse(literal: str) -> None:
        raise AssertionError(f"invalid JSON literal {literal} in {path}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def steps_values(path: Path, name: str) -> list[tuple[int, float]]:
    return [(line.record.step, line.record.metrics[name]) for line in scan(path)
            if line.record is not None and name in line.record.metrics]


def tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(event.step, event.value) for event in acc.Scalars(tag)]


def test_values_round_trip_through_strict_json(tmp_path: Path) -> None:
    metrics = {"agent/return": 0.25, "train/loss": torch.tensor(1.5), "train/tokens": 7,
               "envs/valid_rate": np.float32(0.5), "designer/regret": torch.tensor([0.125]),
               "train/grad_norm": math.nan, "perf/max": math.inf, "perf/min": -math.inf, "envs/all_valid": True}
    before = time.time()
    with MetricsLogger(tmp_path, CFG) as logger:
        logger.log(3, metrics)
    (line,) = strict_lines(tmp_path / METRICS_FILE)
    assert line["step"] == 3 and before - 1 <= line["time"] <= time.time() + 1
    assert line["train/grad_norm"] == "NaN" and line["perf/max"] == "Infinity" and line["perf/min"] == "-Infinity"
    (parsed,) = scan(tmp_path / METRICS_FILE)
    values = parsed.record.metrics
    assert values["agent/return"] == 0.25 and values["train/loss"] == 1.5 and values["train/tokens"] == 7
    assert values["envs/valid_rate"] == 0.5 and values["designer/regret"] == 0.125 and values["envs/all_valid"] == 1
    assert math.isnan(values["train/grad_norm"]) and values["perf/max"] == math.inf and values["perf/min"] == -math.inf
    assert not parsed.problems


def test_commit_false_gathers_a_step_and_prefix_names_the_group(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, CFG) as logger:
        logger.log(1, {"agent/return": 0.5}, commit=False)
        logger.log(1, {"loss": 2.0, "entropy": 1.0}, prefix="train")
        logger.log(2, {"agent/return": 0.7}, commit=False)
        logger.log(3, {"agent/return": 0.9}, commit=False)  # another step commits the pending one
        logger.log(3, {"designer/regret": 0.1}, commit=False)  # close commits what is left
    lines = strict_lines(tmp_path / METRICS_FILE)
    assert [{k: v for k, v in line.items() if k != "time"} for line in lines] == [
        {"step": 1, "agent/return": 0.5, "train/loss": 2.0, "train/entropy": 1.0},
        {"step": 2, "agent/return": 0.7},
        {"step": 3, "agent/return": 0.9, "designer/regret": 0.1}]


def test_each_record_is_on_disk_before_the_next_step(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, CFG) as logger:
        for step in (1, 2):
            logger.log(step, {"agent/return": float(step)})
            assert steps_values(tmp_path / METRICS_FILE, "agent/return")[-1] == (step, float(step))
            assert tensorboard_scalars(tmp_path / "tensorboard", "agent/return")[-1] == (step, float(step))


@pytest.mark.parametrize("value, words", [
    ("0.5", "expected a number"), (None, "expected a number"), ([1.0], "expected a number"),
    ({"a": 1}, "expected a number"), (torch.ones(2), "shape (2,)"), (np.zeros((1, 3)), "shape (1, 3)")])
def test_a_bad_value_names_the_metric_and_writes_nothing(tmp_path: Path, value: object, words: str) -> None:
    with MetricsLogger(tmp_path, CFG) as logger:
        logger.log(1, {"agent/return": 1.0})
        with pytest.raises(MetricError) as info:
            logger.log(2, {"agent/win_rate": 0.5, "train/loss": value})
    assert "'train/loss'" in str(info.value) and words in str(info.value)
    assert [line["step"] for line in strict_lines(tmp_path / METRICS_FILE)] == [1]  # not half a record


@pytest.mark.parametrize("name", ["loss", "agent/", "/loss", "agent//return", "agent/win rate", 3])
def test_a_bad_name_is_refused_by_name(tmp_path: Path, name: object) -> None:
    with MetricsLogger(tmp_path, CFG) as logger, pytest.raises(MetricError, match="group/name") as info:
        logger.log(1, {name: 1.0})
    assert repr(name) in str(info.value)


def test_steps_never_go_back(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, CFG) as logger:
        logger.log(5, {"agent/return": 1.0})
        logger.log(5, {"train/loss": 1.0})  # the same step again is fine (two records of step 5)
        with pytest.raises(MetricError, match="step 4 is before step 5.*resume_step"):
            logger.log(4, {"agent/return": 1.0})
        with pytest.raises(MetricError, match="step must be an int"):
            logger.log(6.0, {"agent/return": 1.0})  # type: ignore[arg-type]


def test_only_the_writing_rank_touches_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    with MetricsLogger(run, CFG, rank=1) as logger:
        assert not logger.active
        logger.log(2, {"agent/return": 1.0})
        # checked like on the writing rank, so every rank fails alike instead of rank 0 alone
        with pytest.raises(MetricError, match="not a name"):
            logger.log(3, {"not a name": 1.0})
        with pytest.raises(MetricError, match="step 1 is before step 2"):
            logger.log(1, {"agent/return": 1.0})
    assert not run.exists()
    monkeypatch.setenv("RANK", "3")
    assert current_rank() == 3
    with MetricsLogger(run, CFG) as logger:
        assert not logger.active
    with MetricsLogger(run, CFG, writer_rank=3) as logger:
        logger.log(1, {"agent/return": 1.0})
    assert steps_values(run / METRICS_FILE, "agent/return") == [(1, 1.0)]


def test_sinks_follow_the_config(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path / "tb", LoggingConfig(jsonl=False, gpu_stats=False)) as logger:
        logger.log(1, {"agent/return": 1.0})
    assert not (tmp_path / "tb" / METRICS_FILE).exists()
    assert tensorboard_scalars(tmp_path / "tb" / "tensorboard", "agent/return") == [(1, 1.0)]
    with MetricsLogger(tmp_path / "json", LoggingConfig(tensorboard=False, gpu_stats=False)) as logger:
        logger.log(1, {"agent/return": 1.0})
    assert sorted(p.name for p in (tmp_path / "json").iterdir()) == [METRICS_FILE]


CRASHING_RUN = textwrap.dedent("""
    import os, sys
    from spade_mega.config.schema import LoggingConfig
    from spade_mega.monitor import MetricsLogger

    logger = MetricsLogger(sys.argv[1], LoggingConfig(gpu_stats=False))
    for step in range(1, 6):
        logger.log(step, {"agent/return": float(step), "train/loss": 1.0 / step})
    os._exit(1)  # killed: no close(), no flush at exit
""")


def _next_second() -> None:
    """Event files are named after the second they were opened in and read in name order; a resumed run's file
    must sort after the crashed run's, as it does outside a test where a restart takes longer than a second."""
    time.sleep(1.02 - time.time() % 1)


def test_crash_then_resume_from_an_earlier_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", CRASHING_RUN, str(run)], cwd=ROOT, capture_output=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    metrics, events = run / METRICS_FILE, run / "tensorboard"
    # the crash lost nothing already logged, in either sink
    assert steps_values(metrics, "agent/return") == [(s, float(s)) for s in range(1, 6)]
    assert tensorboard_scalars(events, "agent/return") == [(s, float(s)) for s in range(1, 6)]
    torn = b'{"step":6,"time":17'  # the record being written when a crash hit
    with open(metrics, "ab") as f:
        f.write(torn)
    kept_bytes = b"".join(metrics.read_bytes().splitlines(keepends=True)[:3])

    _next_second()
    with MetricsLogger(run, CFG, resume_step=3) as logger:  # the last checkpoint was step 3
        with pytest.raises(MetricError, match="before step 3"):
            logger.log(2, {"agent/return": 0.0})
        for step in range(4, 8):
            logger.log(step, {"agent/return": 100.0 + step})

    curve = [(s, float(s)) for s in range(1, 4)] + [(s, 100.0 + s) for s in range(4, 8)]
    assert steps_values(metrics, "agent/return") == curve  # one curve, not two interleaved
    assert metrics.read_bytes().startswith(kept_bytes)  # the records up to the checkpoint, byte for byte
    assert tensorboard_scalars(events, "agent/return") == curve  # purge_step hid the interrupted run's 4, 5
    aside = run / "metrics.aside-1.jsonl"
    lines = aside.read_bytes().splitlines()
    assert [json.loads(raw)["step"] for raw in lines[:2]] == [4, 5] and lines[2] == torn  # nothing lost
    assert [line.number for line in scan(aside) if line.problems] == [3]


def test_a_new_run_sets_earlier_metrics_aside(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, CFG) as logger:
        for step in range(1, 4):
            logger.log(step, {"agent/return": float(step)})
    first = (tmp_path / METRICS_FILE).read_bytes()
    _next_second()
    with MetricsLogger(tmp_path, CFG) as logger:  # not a resume: the run starts over
        logger.log(1, {"agent/return": 10.0})
    assert steps_values(tmp_path / METRICS_FILE, "agent/return") == [(1, 10.0)]
    assert (tmp_path / "metrics.aside-1.jsonl").read_bytes() == first
    assert tensorboard_scalars(tmp_path / "tensorboard", "agent/return") == [(1, 10.0)]


def test_resume_step_must_be_a_step(tmp_path: Path) -> None:
    with pytest.raises(MetricError, match="resume_step"):
        MetricsLogger(tmp_path, CFG, resume_step=-1)


def test_resume_after_a_record_that_lost_only_its_newline(tmp_path: Path) -> None:
    (tmp_path / METRICS_FILE).write_bytes(b'{"step":1,"time":1.0,"agent/return":1.0}\n'
                                          b'{"step":2,"time":2.0,"agent/return":2.0}')
    with MetricsLogger(tmp_path, LoggingConfig(tensorboard=False, gpu_stats=False), resume_step=2) as logger:
        logger.log(3, {"agent/return": 3.0})
    assert steps_values(tmp_path / METRICS_FILE, "agent/return") == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert not list(tmp_path.glob("metrics.aside-*"))


def test_a_value_no_float_holds_is_refused_and_such_a_line_never_blocks_a_resume(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, CFG) as logger:
        logger.log(1, {"train/tokens": 7})
        with pytest.raises(MetricError, match="'train/tokens'.*too large"):
            logger.log(2, {"train/tokens": 10 ** 400})  # would be written, then break every later resume
        with pytest.raises(MetricError, match="too large"):
            logger.log(2, {"train/tokens": 10 ** 5000})  # past the digits Python turns into text
    huge, deep = b'{"step":2,"time":2.0,"train/tokens":' + b"9" * 400 + b"}", b"[" * 100_000 + b"]" * 100_000
    longest = b'{"step":2,"time":2.0,"train/tokens":' + b"9" * 5000 + b"}"
    with open(tmp_path / METRICS_FILE, "ab") as f:
        f.write(huge + b"\n" + deep + b"\n" + longest + b"\n")  # another tool's or a hand edit's lines
    problems = {line.number: line.problems for line in scan(tmp_path / METRICS_FILE)}
    assert "too large" in problems[2][0] and "nested" in problems[3][0] and "digits" in problems[4][0]
    with MetricsLogger(tmp_path, LoggingConfig(tensorboard=False, gpu_stats=False), resume_step=2) as logger:
        logger.log(3, {"train/tokens": 9})
    assert steps_values(tmp_path / METRICS_FILE, "train/tokens") == [(1, 7.0), (3, 9.0)]
    assert (tmp_path / "metrics.aside-1.jsonl").read_bytes() == deep + b"\n" + longest + b"\n"  # verbatim


SECOND_LAUNCH = textwrap.dedent("""
    import sys
    from spade_mega.config.schema import LoggingConfig
    from spade_mega.monitor import MetricsLogger

    with MetricsLogger(sys.argv[1], LoggingConfig(gpu_stats=False), resume_step=1) as logger:
        logger.log(2, {"agent/return": -1.0})
""")


def test_a_second_process_on_a_live_run_directory_is_refused(tmp_path: Path) -> None:
    """A run launched twice (or a SLURM requeue while the old job still runs): the second one's resume replaced
    metrics.jsonl under the first, whose later records went to the replaced file and were lost."""
    with MetricsLogger(tmp_path, CFG) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"agent/return": float(step)})
        proc = subprocess.run([sys.executable, "-c", SECOND_LAUNCH, str(tmp_path)], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode != 0 and "MetricError" in proc.stderr and "another process" in proc.stderr
        logger.log(4, {"agent/return": 4.0})
    assert steps_values(tmp_path / METRICS_FILE, "agent/return") == [(s, float(s)) for s in range(1, 5)]
    assert not list(tmp_path.glob("metrics.aside-*"))
    proc = subprocess.run([sys.executable, "-c", SECOND_LAUNCH, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # once the first has closed, a resume goes ahead
    assert proc.returncode == 0, proc.stderr
    assert steps_values(tmp_path / METRICS_FILE, "agent/return") == [(1, 1.0), (2, -1.0)]


def test_a_logger_that_failed_to_start_leaves_the_run_directory_unlocked(tmp_path: Path) -> None:
    (tmp_path / METRICS_FILE).mkdir()  # a folder where the metrics file goes: the JSONL sink cannot start
    with pytest.raises(IsADirectoryError) as info:
        MetricsLogger(tmp_path, CFG)
    (tmp_path / METRICS_FILE).rmdir()
    with MetricsLogger(tmp_path, CFG) as logger:  # while `info` still holds the failed logger
        logger.log(1, {"agent/return": 1.0})
    assert info.value is not None and steps_values(tmp_path / METRICS_FILE, "agent/return") == [(1, 1.0)]
