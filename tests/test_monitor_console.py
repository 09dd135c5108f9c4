"""What a run shows while it runs: NVML GPU stats (and their absence on this CPU machine), the progress bar on a real
pseudo-terminal and plain lines elsewhere, and console logging per rank."""

from __future__ import annotations

import io
import logging
import os
import pty
from pathlib import Path

import pytest

from spade_mega.config.schema import LoggingConfig
from spade_mega.monitor import (METRICS_FILE, GpuReading, GpuStats, MetricsLogger, RunProgress, gpu_metrics, scan,
                                setup_logging)


def nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:  # pynvml.NVMLError without a driver (LibraryNotFound here)
        return False


HAS_NVML = nvml_works()


@pytest.mark.skipif(HAS_NVML, reason="NVML works on this machine; the degraded path needs a machine without a driver")
def test_without_a_driver_gpu_stats_are_absent_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="spade_mega.monitor")
    stats = GpuStats()
    assert [stats.sample() for _ in range(3)] == [{}, {}, {}]
    with MetricsLogger(tmp_path, LoggingConfig(gpu_stats=True, tensorboard=False)) as logger:
        for step in range(3):
            logger.log(step, {"agent/return": 1.0})
    assert [line.record.metrics for line in scan(tmp_path / METRICS_FILE)] == [{"agent/return": 1.0}] * 3
    said = [r.getMessage() for r in caplog.records if "GPU stats" in r.getMessage()]
    assert len(said) == 2 and all("NVML is unavailable" in m and "no GPU stats" in m for m in said)  # one per stats


@pytest.mark.gpu
def test_gpu_stats_on_a_gpu_host() -> None:
    stats = GpuStats()
    try:
        metrics = stats.sample()
    finally:
        stats.close()
    assert 0 < metrics["gpu/0/memory_used_gib"] <= metrics["gpu/0/memory_total_gib"] < 1024
    assert all(name.startswith("gpu/") for name in metrics)


def test_nvml_readings_become_gpu_metrics() -> None:
    readings = [GpuReading(0, memory_used_bytes=3 << 30, memory_total_bytes=80 << 30, utilization_pct=97.0,
                           power_mw=612_500, temperature_c=71),
                GpuReading(1, memory_used_bytes=1 << 29, memory_total_bytes=80 << 30)]  # power etc. not supported
    assert gpu_metrics(readings) == {
        "gpu/0/memory_used_gib": 3.0, "gpu/0/memory_total_gib": 80.0, "gpu/0/utilization_pct": 97.0,
        "gpu/0/power_w": 612.5, "gpu/0/temperature_c": 71.0,
        "gpu/1/memory_used_gib": 0.5, "gpu/1/memory_total_gib": 80.0}
    assert gpu_metrics([]) == {}


def test_plain_lines_every_log_interval_when_not_a_terminal() -> None:
    out = io.StringIO()
    cfg = LoggingConfig(log_interval=3, progress=True, progress_metrics=["agent/return", "train/loss"])
    with RunProgress(10, "steps", cfg=cfg, stream=out) as bar:
        for step in range(1, 11):
            bar.update(step, {"agent/return": step / 10, "designer/regret": 0.2} if step != 9 else {})
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["steps 3/10 (30%)", "steps 6/10 (60%)", "steps 9/10 (90%)",
                                                        "steps 10/10 (100%)"]
    assert all("elapsed, eta " in line for line in lines)
    assert lines[0].endswith("| agent/return 0.3") and lines[2].endswith("| agent/return 0.8")  # latest known
    assert "regret" not in out.getvalue()  # only the chosen metrics


def test_a_resumed_run_counts_from_its_start_and_validation_advances() -> None:
    out = io.StringIO()
    with RunProgress(8, "steps", cfg=LoggingConfig(log_interval=2), start=4, stream=out) as bar:
        assert out.getvalue() == ""
        bar.update(5)
        bar.update(6)
    assert out.getvalue().startswith("steps 6/8 (75%)") and "eta 0:0" in out.getvalue()
    out = io.StringIO()
    with RunProgress(3, "validating", fields=[], stream=out) as bar:
        for _ in range(3):
            bar.advance()
    assert [line.split(" | ")[0] for line in out.getvalue().splitlines()] == [
        "validating 1/3 (33%)", "validating 2/3 (67%)", "validating 3/3 (100%)"]


def test_other_ranks_print_nothing() -> None:
    out = io.StringIO()
    with RunProgress(2, stream=out, rank=1) as bar:
        bar.update(2, {"agent/return": 1.0})
    assert out.getvalue() == ""


def _on_a_terminal(cfg: LoggingConfig, monkeypatch: pytest.MonkeyPatch, each_step=lambda step: None) -> str:
    """Run a short progress on a real pseudo-terminal (calling ``each_step`` before each update); what the terminal
    received."""
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("COLUMNS", "100")  # rich sizes itself from the standard streams, which are not this terminal
    for name in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    master, slave = pty.openpty()
    with os.fdopen(slave, "w") as terminal:
        with RunProgress(3, "steps", cfg=cfg, stream=terminal) as bar:
            for step in range(1, 4):
                each_step(step)
                bar.update(step, {"agent/return": 0.5})
    os.set_blocking(master, False)
    received = b""
    try:
        while chunk := os.read(master, 65536):
            received += chunk
    except (BlockingIOError, OSError):
        pass
    os.close(master)
    return received.decode("utf-8", errors="replace")


def test_a_terminal_gets_a_progress_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    shown = _on_a_terminal(LoggingConfig(), monkeypatch)
    assert "━" in shown and "3/3" in shown and "agent/return 0.5" in shown and "eta" in shown
    assert "elapsed, eta" not in shown  # not the plain lines


def test_progress_false_prints_plain_lines_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    shown = _on_a_terminal(LoggingConfig(progress=False), monkeypatch)
    assert "━" not in shown and "steps 3/3 (100%)" in shown


def test_log_lines_go_above_the_progress_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    """The console handler writes to the stderr of the moment, which the bar takes over while it shows: a handler
    holding the stderr it was made with wrote past the bar, gluing each log line to a stale copy of it."""
    logger = logging.getLogger("spade_mega")
    level, handlers = logger.level, list(logger.handlers)
    try:
        setup_logging(LoggingConfig(level="info"), rank=0)
        shown = _on_a_terminal(LoggingConfig(), monkeypatch,
                               lambda step: logging.getLogger("spade_mega.test").info("checkpoint %d saved", step))
    finally:
        for handler in logger.handlers[len(handlers):]:
            logger.removeHandler(handler)
        logger.setLevel(level)
    for step in (1, 2, 3):
        before, found, _ = shown.partition(f"checkpoint {step} saved")
        assert found and "━" not in before.replace("\n", "\r").rsplit("\r", 1)[-1]  # its own line, not after a bar
    assert "3/3" in shown.rsplit("checkpoint 3 saved", 1)[1]  # the bar is drawn again below


def test_console_logging_per_rank_is_set_once() -> None:
    logger = logging.getLogger("spade_mega")
    level, handlers = logger.level, list(logger.handlers)
    # a run earlier in this process (an in-process SelfPlay.run) has set its console handler already
    others = [h for h in handlers if not getattr(h, "_spade_console", False)]
    try:
        setup_logging(LoggingConfig(level="debug"), rank=0)
        setup_logging(LoggingConfig(level="debug"), rank=0)
        assert logger.level == logging.DEBUG and logger.handlers[:-1] == others
        setup_logging(LoggingConfig(level="info"), rank=2)
        assert logger.level == logging.WARNING and logger.handlers[:-1] == others
        assert "[rank 2]" in logger.handlers[-1].formatter._fmt  # type: ignore[union-attr]
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)


def test_progress_metrics_must_be_metric_names() -> None:
    from spade_mega.config.errors import ConfigError
    from spade_mega.config.loader import load_config

    assert load_config(None, ["logging.progress_metrics=[agent/return, gpu/0/power_w]"]).logging.progress_metrics \
        == ["agent/return", "gpu/0/power_w"]
    with pytest.raises(ConfigError, match=r"logging\.progress_metrics\[1\].*group/name"):
        load_config(None, ["logging.progress_metrics=[agent/return, loss]"])


def test_a_driver_that_fails_after_init_costs_no_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """NVML that starts but cannot count its GPUs (a GPU lost from the bus, a driver being reloaded). No driver runs
    on this machine, so a stand-in pynvml module plays that driver: it raised NVMLError out of MetricsLogger.log,
    losing the record being written and stopping the run."""
    import types

    class NVMLError(Exception):
        pass

    def lost() -> int:
        raise NVMLError("Unknown Error")

    nvml = types.ModuleType("pynvml")
    nvml.NVMLError, nvml.nvmlDeviceGetCount = NVMLError, lost
    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None
    monkeypatch.setitem(__import__("sys").modules, "pynvml", nvml)
    caplog.set_level(logging.INFO, logger="spade_mega.monitor")
    with MetricsLogger(tmp_path, LoggingConfig(gpu_stats=True, tensorboard=False)) as logger:
        for step in (1, 2):
            logger.log(step, {"agent/return": 1.0})
    assert [line.record.metrics for line in scan(tmp_path / METRICS_FILE)] == [{"agent/return": 1.0}] * 2
    said = [r.getMessage() for r in caplog.records if "GPU stats" in r.getMessage()]
    assert len(said) == 1 and "Unknown Error" in said[0]
