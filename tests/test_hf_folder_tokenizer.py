"""A Hugging Face folder whose weights a run or an evaluation starts from (inference.hf_weights) was trained with the
tokenizer it carries: another model.tokenizer gives every token id another meaning, so it is refused before anything
is built or written, as convert from-hf refuses it. Real tokenizer folders, the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spade_mega.cli import main
from spade_mega.tokenizer import TokenizerError, byte_tokenizer, check_folder_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"
SCRIPT = Path(sys.executable).with_name("spade-mega")


@pytest.fixture
def foreign(tmp_path: Path) -> Path:
    """A model folder carrying another tokenizer than the tiny config's (the byte tokenizer plus one special token,
    so ids 0..258 still agree and nothing else would notice)."""
    other = byte_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    folder = tmp_path / "foreign_model"
    other.save_pretrained(str(folder))
    return folder


def test_train_from_a_folder_with_another_tokenizer_fails_at_start_and_writes_nothing(tmp_path: Path,
                                                                                     foreign: Path) -> None:
    proc = subprocess.run([str(SCRIPT), "train", str(TINY), f"run.output_dir={tmp_path / 'runs'}",
                           f"inference.hf_weights={foreign}"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert f"{foreign} holds the tokenizer" in last and "260 tokens" in last and "built-in byte tokenizer" in last, last
    assert f"Set model.tokenizer={foreign}" in last, last
    assert not (tmp_path / "runs").exists()


def test_eval_of_a_folder_with_another_tokenizer_is_refused(foreign: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", str(TINY), "--hf-weights", str(foreign)]) == 2
    err = capsys.readouterr().err
    assert f"{foreign} holds the tokenizer" in err and "260 tokens" in err, err


def test_a_folder_with_the_same_tokenizer_or_none_passes(tmp_path: Path, foreign: Path) -> None:
    copy = tmp_path / "copy"
    byte_tokenizer().save_pretrained(str(copy))
    check_folder_tokenizer(copy, None)  # the run's tokenizer, saved elsewhere
    check_folder_tokenizer(foreign, str(foreign))
    bare = tmp_path / "bare"
    bare.mkdir()
    check_folder_tokenizer(bare, None)  # weights only: nothing to compare
    with pytest.raises(TokenizerError, match="their token ids mean different things"):
        check_folder_tokenizer(copy, str(foreign))
