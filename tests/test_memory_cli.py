"""`spade-mega memory stats|export|show` over a run's memory database."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spade_mega.cli import main
from spade_mega.config import load_config, prepare_run_dir
from spade_mega.curriculum.memory import EnvMemory
from spade_mega.envs.program import EnvProgram

SOURCE = "class G:\n    max_turns = 2\n    def reset(self, seed):\n        return 'o'\n" \
         "    def step(self, a):\n        return 'o', 1.0, True, False, {}\n"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.name=r1", "curriculum.memory.path=mem/env.sqlite"])
    run = prepare_run_dir(cfg)
    with EnvMemory(run / "mem" / "env.sqlite") as mem:
        for i in range(3):
            p = EnvProgram(SOURCE.replace("'o'", f"'o{i}'"), f"hint {i}", "logic", {"iteration": i})
            mem.propose(p)
            mem.set_validation(p.content_hash, i != 2, None if i != 2 else "reset_not_deterministic")
            if i != 2:
                mem.record_evaluation(p.content_hash, i, 0.25 * (i + 1), 0.75, 4, 4, designer_reward=0.1)
    return run


def test_stats_reads_the_path_from_the_run_config(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["memory", "stats", "--run", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "environments  3 (3 proposals" in out and "invalid       reset_not_deterministic 1" in out
    assert "played        2 (last iteration 1)" in out
    assert main(["memory", "stats", "--run", str(run_dir / "mem" / "env.sqlite"), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["by_status"] == {"invalid": 1, "valid": 2} and stats["learnable_fraction"] == 1.0


def test_export_writes_jsonl(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "export.jsonl"
    assert main(["memory", "export", "--run", str(run_dir), "-o", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and rows[0]["hint"] == "hint 0" and rows[1]["evaluations"][0]["win_rate"] == 0.5
    assert "exported 3 environments" in capsys.readouterr().err
    assert main(["memory", "export", "--run", str(run_dir)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_show_by_prefix(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    p = EnvProgram(SOURCE.replace("'o'", "'o1'"), "hint 1", "logic")
    assert main(["memory", "show", p.content_hash[:8], "--run", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert p.content_hash in out and "hint          hint 1" in out and "class G:" in out
    assert "        1     0.500      0.750   0.250            0.100      4           4" in out
    assert main(["memory", "show", p.content_hash, "--run", str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["content_hash"] == p.content_hash


def test_errors_are_one_line_exit_2(tmp_path: Path, run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["memory", "stats", "--run", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no memory database here" in err
    assert main(["memory", "show", "ffff", "--run", str(run_dir)]) == 2
    assert "no environment with hash 'ffff'" in capsys.readouterr().err


def test_export_into_a_pipe_closed_early_exits_quietly(tmp_path: Path) -> None:
    # `spade-mega memory export | head -1`: the reader closes the pipe; no traceback, the shell's SIGPIPE status.
    import subprocess
    import sys

    with EnvMemory(tmp_path / "memory.sqlite") as mem:
        mem.propose_many([EnvProgram(SOURCE.replace("'o'", f"'o{i}'") + "# padding\n" * 300, "h", "logic")
                          for i in range(40)])  # ~160 kB of JSON: more than a pipe buffer
    proc = subprocess.Popen([sys.executable, "-m", "spade_mega.cli", "memory", "export", "--run", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and json.loads(first)["skill"] == "logic"
    assert "Traceback" not in err and "Exception ignored" not in err


def test_a_damaged_database_is_one_line_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # Pages damaged in the middle of the file: the header opens fine, the queries then fail. One line, exit 2.
    import sqlite3

    db = tmp_path / "memory.sqlite"
    with EnvMemory(db) as mem:
        mem.propose_many([EnvProgram(SOURCE.replace("'o'", f"'o{i}'") + "# padding\n" * 300, "h", "logic")
                          for i in range(40)])
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()
    data = bytearray(db.read_bytes())
    third = len(data) // 3
    data[third:2 * third] = b"\x07" * third
    db.write_bytes(bytes(data))
    for action in (["stats"], ["export", "-o", str(tmp_path / "out.jsonl")]):
        assert main(["memory", *action, "--run", str(db)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(db) in err and "damaged" in err and "integrity_check" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory.sqlite"]  # no half-written export left behind


def test_export_never_overwrites_a_database(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # `memory export -o mem/env.sqlite` (the database itself, its -wal, or another run's memory): replacing it with
    # JSON lines would destroy the history the trainer writes into. Refused, one line, nothing touched.
    db = run_dir / "mem" / "env.sqlite"
    other = tmp_path / "other.sqlite"
    EnvMemory(other).close()
    with EnvMemory(db) as trainer:  # running: its -wal file exists
        for target in (db, Path(str(db) + "-wal"), other):
            before = target.read_bytes()
            assert main(["memory", "export", "--run", str(run_dir), "-o", str(target)]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "refusing to overwrite" in err and str(target) in err
            assert target.read_bytes() == before
        trainer.propose(EnvProgram(SOURCE, "a later hint", "logic"))
    with EnvMemory(db, create=False) as mem:
        assert len(mem) == 4


def test_a_run_saved_with_a_since_removed_key_is_still_inspected(run_dir: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """A run from before a key was removed (rewards.solve_threshold) keeps its config.yaml: the memory commands read
    only curriculum.memory from it, so its memory stays readable; a bad memory path is still named."""
    import yaml

    config = run_dir / "config.yaml"
    saved = yaml.safe_load(config.read_text())
    saved["rewards"]["solve_threshold"] = 0.5
    config.write_text(yaml.safe_dump(saved, sort_keys=False))
    assert main(["memory", "stats", "--run", str(run_dir)]) == 0
    assert "environments  3 (3 proposals" in capsys.readouterr().out
    saved["curriculum"]["memory"]["path"] = ""
    config.write_text(yaml.safe_dump(saved, sort_keys=False))
    assert main(["memory", "stats", "--run", str(run_dir)]) == 2
    assert "curriculum.memory.path" in capsys.readouterr().err


def test_show_and_stats_of_an_evaluation_no_hint_play_measured(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """No hint play measured the agent (none configured, or every one broken): the memory holds no win rate with the
    hint and no regret (NULL), shown as '-' by show and left out of the stats' means, not a crash formatting None."""
    p = EnvProgram(SOURCE.replace("'o'", "'o0'"), "hint 0", "logic")
    with EnvMemory(run_dir / "mem" / "env.sqlite") as mem:
        mem.record_evaluation(p.content_hash, 5, 0.5, None, 4, 0)
    assert main(["memory", "show", p.content_hash, "--run", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "        0     0.250      0.750   0.500            0.100      4           4" in out
    assert "        5     0.500          -       -                -      4           0" in out
    assert main(["memory", "stats", "--run", str(run_dir), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    # environment 0's last evaluation has no hint rate: environment 1's alone is averaged
    assert (stats["mean_win_rate"], stats["mean_win_rate_hint"], stats["mean_regret"]) == (0.5, 0.75, 0.25), stats
    assert stats["outcomes"] == {"frontier": 1, "other": 1}, stats
