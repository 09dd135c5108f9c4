"""The ``spade-mega`` command as a user runs it: the installed console script, its output and exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "configs" / "tiny_cpu.yaml")
SCRIPT = Path(sys.executable).with_name("spade-mega")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, f"expected one clear line, got:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_console_script_is_installed() -> None:
    assert SCRIPT.is_file(), "pip install -e . should install the spade-mega console script"


def test_help_lists_commands() -> None:
    proc = run("--help")
    assert proc.returncode == 0
    assert "config" in proc.stdout and "hint-based regret" in proc.stdout


def test_config_show_applies_override() -> None:
    proc = run("config", "show", "--config", TINY, "model.num_layers=3")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["model"]["num_layers"] == 3


def test_config_check_ok() -> None:
    proc = run("config", "check", "--config", TINY)
    assert proc.returncode == 0 and proc.stdout.startswith("ok:")


def test_typo_exits_2_with_suggestion() -> None:
    line = one_error_line(run("config", "show", "--config", TINY, "rollout.temprature=1"))
    assert "rollout.temprature" in line and "temperature" in line


def test_wrong_type_exits_2_with_path_and_type() -> None:
    line = one_error_line(run("config", "check", "--config", TINY, "model.num_layers=abc"))
    assert "model.num_layers" in line and "expected int" in line


def test_missing_file_exits_2_naming_it() -> None:
    line = one_error_line(run("config", "show", "--config", "does/not/exist.yaml"))
    assert "exist.yaml" in line and "not found" in line


@pytest.mark.parametrize("args", [("nosuchcommand",), ("config",), ("config", "show", "--bogus")])
def test_bad_arguments_exit_2_in_one_line(args: tuple[str, ...]) -> None:
    assert "see 'spade-mega" in one_error_line(run(*args))


def test_debug_shows_traceback() -> None:
    proc = run("--debug", "config", "show", "--config", TINY, "rollout.temprature=1")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "ConfigError" in proc.stderr


def test_kernels_folder_is_spade_mega_kernels_not_top_level() -> None:
    code = ("import importlib.util, spade_mega.kernels as k; "
            "print(k.__name__, importlib.util.find_spec('kernels') is None or "
            "'spade_mega' not in (importlib.util.find_spec('kernels').origin or ''))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["spade_mega.kernels", "True"]
