"""What a checkpoint is for: the tokenizer its token ids belong to is recorded and checked wherever it is loaded
(resume, convert to-hf), an export reads the weights alone and carries the tokenizer, and a Hugging Face folder's
own tokenizer must be the run's (convert from-hf). Real checkpoints of a real Megatron model, the real CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from megatron_launch import worker_command, worker_env
from megatron_worker import config

from spade_mega.config.loader import to_dict
from spade_mega.megatron.checkpoint import read_manifest
from spade_mega.tokenizer import byte_tokenizer, tokenizer_identity

pytestmark = pytest.mark.multiproc

SCRIPT = Path(sys.executable).with_name("spade-mega")
STEP1 = "reference/step_00000001"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, reference_run) -> Path:
    """A step-0 (model only) and a step-1 (model and Adam state) checkpoint of the worker's model and config, its
    config as a YAML file for the CLI, and two tokenizer folders: a copy of the byte tokenizer, and one with an extra
    special token (another tokenizer, whose ids 0..258 still agree)."""
    out = reference_run(tmp_path_factory.mktemp("identity"))
    (out / "run.yaml").write_text(yaml.safe_dump(to_dict(config([]))))
    byte_tokenizer().save_pretrained(str(out / "byte_copy"))
    other = byte_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    other.save_pretrained(str(out / "other_tok"))
    return out


def convert(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), "convert", *args], capture_output=True, text=True, env=worker_env(),
                          timeout=300, cwd=out)


def test_the_manifest_records_the_tokenizer(saved: Path) -> None:
    for step in (STEP1, "init/step_00000000"):
        recorded = read_manifest(saved / step)["tokenizer"]
        assert recorded == tokenizer_identity(None) and recorded["vocab_size"] == 259


def test_resuming_with_another_tokenizer_is_refused_naming_both(saved: Path) -> None:
    """Another vocabulary (one added special token) under the same model: every id past 258 would mean something
    else, silently; refused before anything is loaded, naming both tokenizers."""
    proc = subprocess.run(worker_command(1, "resume", saved, "--load", str(saved / STEP1),
                                         f"model.tokenizer={saved / 'other_tok'}"),
                          capture_output=True, text=True, env=worker_env(), timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "CheckpointError" in last and "built-in byte tokenizer" in last and "259 tokens" in last, last
    assert str(saved / "other_tok") in last and "260 tokens" in last and "Set model.tokenizer" in last, last


def test_convert_to_hf_reads_the_weights_alone_and_writes_the_tokenizer(saved: Path) -> None:
    """The export loads no optimizer state, so a run configured with the other optimizer kind (whose state would
    not load) exports too; a copy of the tokenizer elsewhere is the same tokenizer. The folder holds the tokenizer's
    files, which transformers (and so vLLM / SGLang) load as the run's tokenizer."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    proc = convert(saved, "to-hf", "-c", "run.yaml", "optimizer.distributed=false",
                   f"model.tokenizer={saved / 'byte_copy'}", "--checkpoint", str(saved / STEP1), "--out", "hf")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 1" in proc.stdout
    tokenizer = AutoTokenizer.from_pretrained(str(saved / "hf"))
    assert tokenizer.encode("a+b=<|im_end|>") == byte_tokenizer().encode("a+b=<|im_end|>")
    assert tokenizer_identity(str(saved / "hf")) == {**tokenizer_identity(None), "name": str(saved / "hf")}
    assert (saved / "hf" / "config.json").is_file() and list((saved / "hf").glob("model-*.safetensors"))
    # generate() stops where the run's completions end (the config had no eos: it ran to max_new_tokens)
    hf_config = AutoConfig.from_pretrained(str(saved / "hf"))
    assert (hf_config.eos_token_id, hf_config.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id) \
        == (byte_tokenizer().eos_token_id, byte_tokenizer().pad_token_id)
    assert GenerationConfig.from_model_config(hf_config).eos_token_id == tokenizer.eos_token_id


def test_convert_with_another_tokenizer_is_refused_both_ways(saved: Path) -> None:
    """to-hf of a checkpoint under another model.tokenizer, and from-hf of a folder whose own tokenizer is not
    model.tokenizer: one line naming both, exit 2, nothing written."""
    proc = convert(saved, "to-hf", "-c", "run.yaml", f"model.tokenizer={saved / 'other_tok'}",
                   "--checkpoint", str(saved / STEP1), "--out", "hf_other")
    assert proc.returncode == 2 and "built-in byte tokenizer" in proc.stderr and "260 tokens" in proc.stderr, \
        proc.stderr[-3000:]
    assert not (saved / "hf_other").exists()
    foreign = saved / "hf_foreign"
    foreign.mkdir()
    for path in (saved / "hf").iterdir():
        if "tokenizer" not in path.name and "chat_template" not in path.name:
            (foreign / path.name).symlink_to(path)
    for path in (saved / "other_tok").iterdir():
        shutil.copy(path, foreign)
    proc = convert(saved, "from-hf", "-c", "run.yaml", "--hf", str(foreign), "--out", "from_foreign")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{foreign} holds the tokenizer" in proc.stderr and "260 tokens" in proc.stderr
    assert f"Set model.tokenizer={foreign}" in proc.stderr and not (saved / "from_foreign").exists()


def test_eval_of_a_checkpoint_reads_the_weights_alone(saved: Path) -> None:
    """spade-mega eval scores the weights: a run configured with the other optimizer kind (whose Adam state would
    not load; it was refused with 'set it back to resume') evaluates the checkpoint, as convert to-hf exports it."""
    suite = "eval.suites=[{name: arithmetic, max_items: 2, temperature: 0.0, max_response_tokens: 4}]"
    proc = subprocess.run([str(SCRIPT), "eval", "run.yaml", "optimizer.distributed=false", suite,
                           "--checkpoint", str(saved / STEP1), "-o", "eval.json"],
                          capture_output=True, text=True, env=worker_env(), timeout=300, cwd=saved)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((saved / "eval.json").read_text())["step"] == 1


def test_a_checkpoint_saved_before_tokenizers_were_recorded_still_converts(saved: Path) -> None:
    """A manifest without the tokenizer (written before d9171e6) is taken as model.tokenizer's, said once."""
    old = saved / "old" / "step_00000001"
    shutil.copytree(saved / STEP1, old)
    manifest = json.loads((old / "spade_checkpoint.json").read_text())
    del manifest["tokenizer"]
    (old / "spade_checkpoint.json").write_text(json.dumps(manifest))
    proc = convert(saved, "to-hf", "-c", "run.yaml", "--checkpoint", str(old), "--out", "hf_old")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "does not record its tokenizer; model.tokenizer is assumed" in proc.stderr
    assert (saved / "hf_old" / "tokenizer.json").is_file()
