"""A Hugging Face folder whose weights a run or an evaluation starts from (inference.hf_weights) was trained with the
tokenizer it carries: another model.tokenizer gives every token id another meaning, so it is refused before anything
is built or written, as convert from-hf refuses it. Real tokenizer folders, the real CLI."""

from __future__ import annotations

import logging
import os
import shutil
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
    assert check_folder_tokenizer(copy, None)  # the run's tokenizer, saved elsewhere
    assert check_folder_tokenizer(foreign, str(foreign))
    bare = tmp_path / "bare"
    bare.mkdir()
    assert not check_folder_tokenizer(bare, None)  # weights only: nothing to compare
    with pytest.raises(TokenizerError, match="their token ids mean different things"):
        check_folder_tokenizer(copy, str(foreign))


IDENTITY = ("import sys; from spade_mega.tokenizer import tokenizer_identity; "
            "print(tokenizer_identity(sys.argv[1])['sha256'])")


def test_a_folder_tokenizer_keeps_its_identity_through_saves_orders_and_processes(tmp_path: Path) -> None:
    """A Hugging Face tokenizer folder (added tokens, special and not) hashes the same after a save and reload (what
    convert to-hf writes), with its JSON objects in another order, and in other processes (another str hash seed):
    a resume or an export is never refused for a tokenizer that gives every id the same meaning. Its copy encodes
    the same ids."""
    import json

    from transformers import AutoTokenizer

    from spade_mega.tokenizer import load_tokenizer, tokenizer_identity

    tok = byte_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    first, again, shuffled = tmp_path / "first", tmp_path / "again", tmp_path / "shuffled"
    tok.save_pretrained(str(first))
    load_tokenizer(str(first)).save_pretrained(str(again))  # as convert to-hf writes model.tokenizer's files
    first_copy = AutoTokenizer.from_pretrained(str(again))
    text = "<think>héllo 🎉</think><|tool|>{\"a\": 1}<|im_end|>"
    assert first_copy.encode(text) == tok.encode(text) and first_copy.decode(tok.encode(text)) == text
    shuffled.mkdir()
    for path in first.iterdir():
        data = json.loads(path.read_text()) if path.suffix == ".json" else None
        if path.name == "tokenizer.json":
            data["model"]["vocab"] = dict(reversed(list(data["model"]["vocab"].items())))
        if isinstance(data, dict):
            data = dict(reversed(list(data.items())))
        (shuffled / path.name).write_text(json.dumps(data) if data is not None else path.read_text())
    digest = tokenizer_identity(str(first))["sha256"]
    assert tokenizer_identity(str(first))["vocab_size"] == 262
    assert {tokenizer_identity(str(p))["sha256"] for p in (again, shuffled)} == {digest}
    seeds = {subprocess.run([sys.executable, "-c", IDENTITY, str(first)], capture_output=True, text=True, check=True,
                            env=dict(os.environ, PYTHONHASHSEED=seed)).stdout.strip() for seed in ("1", "2")}
    assert seeds == {digest}
    # the added tokens' order in tokenizer.json is no formatting: the tokenizers library numbers them by it
    renumbered = tmp_path / "renumbered"
    shutil.copytree(first, renumbered)
    reordered = json.loads((first / "tokenizer.json").read_text())
    reordered["added_tokens"].reverse()
    (renumbered / "tokenizer.json").write_text(json.dumps(reordered))
    assert AutoTokenizer.from_pretrained(str(renumbered)).encode("<think>") != tok.encode("<think>")
    assert tokenizer_identity(str(renumbered))["sha256"] != digest


# The tiny model's weights as a Hugging Face folder without tokenizer files (save_hf given no tokenizer writes none).
BARE_WEIGHTS = """
import sys
from spade_mega.bridge import save_hf
from spade_mega.config.loader import load_config
from spade_mega.megatron import Trainer
save_hf(Trainer(load_config(sys.argv[1])), sys.argv[2])
"""


def test_from_hf_of_a_folder_without_a_tokenizer_records_the_pairing_as_assumed(tmp_path: Path,
                                                                                foreign: Path) -> None:
    """A weights-only folder (its tokenizer kept elsewhere) cannot be checked: convert from-hf takes model.tokenizer
    as the weights' tokenizer, says so, and the manifest records it as assumed for that folder. Later conversions
    are held to it like any checkpoint's tokenizer, and the refusal names the from-hf assumption and its remedy."""
    bare = tmp_path / "bare_hf"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    made = subprocess.run([sys.executable, "-c", BARE_WEIGHTS, str(TINY), str(bare)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)
    assert made.returncode == 0, made.stderr[-3000:]
    assert not any((bare / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))
    proc = subprocess.run([str(SCRIPT), "convert", "from-hf", "--config", str(TINY), "--hf", str(bare),
                           "--out", str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{bare} has no tokenizer files" in proc.stderr and "built-in byte tokenizer" in proc.stderr, proc.stderr
    from spade_mega.megatron.checkpoint import read_manifest, resolve_checkpoint

    manifest = read_manifest(resolve_checkpoint(tmp_path / "ckpt"))
    assert manifest["tokenizer"]["name"] is None and manifest["tokenizer"]["assumed_for"] == str(bare)
    refused = subprocess.run([str(SCRIPT), "convert", "to-hf", "--config", str(TINY), f"model.tokenizer={foreign}",
                              "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")],
                             capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert refused.returncode == 2, refused.stderr[-3000:]
    last = refused.stderr.strip().splitlines()[-1]
    assert "their token ids mean different things" in last, last
    assert f"convert from-hf took model.tokenizer for {bare}, which has no tokenizer files" in last, last
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_folder_without_tokenizer_files_is_named_once_per_job(tmp_path: Path, rank: str,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """Every rank of a job checks inference.hf_weights before it joins the others (so each raises a mismatch), but the
    warning that a weights-only folder is taken unchecked is the job's: rank 0 says it, not each of 8 or 512 ranks."""
    monkeypatch.setenv("RANK", rank)  # what torchrun and spade-mega launch slurm export, before torch.distributed
    bare = tmp_path / "bare"
    bare.mkdir()
    with caplog.at_level(logging.WARNING, logger="spade_mega"):
        assert not check_folder_tokenizer(bare, None)
    said = [r.getMessage() for r in caplog.records if "has no tokenizer files" in r.getMessage()]
    assert len(said) == (1 if rank == "0" else 0), said
