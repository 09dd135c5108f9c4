"""Start-up of the ``spade-mega`` command: registering the commands (every ``--help``) imports none of the heavy
packages (torch, transformers, Megatron-Core, Triton, wandb); the handlers import what they need. Each check runs in a
fresh process: a module imported by an earlier test would hide an import here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("spade-mega")
HEAVY = ("torch", "transformers", "megatron", "triton", "wandb")

# Every command path of the parser (``launch``, ``launch slurm``, ...) through cli.main, as the console script calls
# it; after each --help, the heavy packages imported so far.
EVERY_HELP = f"""
import argparse, contextlib, io, json, sys
from spade_mega.cli import build_parser, main

def paths(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,)
                yield from paths(sub, prefix + (name,))

loaded = {{}}
for path in [(), *paths(build_parser())]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*path, "--help"])
        except SystemExit as exc:
            assert exc.code == 0, (path, exc.code)
    assert "usage:" in out.getvalue(), path
    loaded[" ".join(path)] = sorted({{name.split(".")[0] for name in sys.modules}} & set({HEAVY!r}))
print(json.dumps(loaded))
"""


def test_help_of_the_console_script_imports_no_heavy_package() -> None:
    """``spade-mega --help`` itself: Python lists every module it imports (PYTHONPROFILEIMPORTTIME)."""
    proc = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    assert proc.returncode == 0 and "usage: spade-mega" in proc.stdout, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    # the listing is real (modules imported with importlib.import_module, as the command modules are, are not in it)
    assert {"spade_mega.cli", "spade_mega.config.loader"} <= imported
    assert sorted({name.split(".")[0] for name in imported} & set(HEAVY)) == []


def test_help_of_every_command_imports_no_heavy_package() -> None:
    proc = subprocess.run([sys.executable, "-c", EVERY_HELP], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout)
    assert {"", "train", "launch", "launch slurm", "convert", "memory", "report"} <= set(loaded)
    assert {path: heavy for path, heavy in loaded.items() if heavy} == {}
