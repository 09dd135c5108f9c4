"""`spade-mega eval --checkpoint` converts the checkpoint through a Megatron trainer, which the engine then serves
from: the trainer (its model, optimizer shell and process groups: memory on a GPU beside the engine's) is closed once
the engine holds the weights, before the engine generates, and when the checkpoint cannot be loaded. Real components:
the tiny demo model's checkpoint, the in-process hf engine, one greedy suite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spade_mega.cli import main
from spade_mega.config.loader import load_config
from spade_mega.inference.hf import HFEngine
from spade_mega.megatron import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"


@pytest.mark.slow
def test_eval_closes_the_trainer_before_the_engine_generates_and_when_the_checkpoint_is_bad(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = tmp_path / "checkpoints"
    trainer = Trainer(load_config(TINY))
    trainer.save(str(checkpoint))
    trainer.close()
    suite = tmp_path / "echo.jsonl"
    suite.write_text(json.dumps({"question": "Say yes.", "answer": "yes"}) + "\n")
    overrides = [f"run.output_dir={tmp_path}", "logging.progress=false",
                 f"eval.suites=[{{name: echo, path: '{suite}', scorer: exact, samples: 1, temperature: 0.0, "
                 "max_response_tokens: 2}]"]

    events: list[str] = []
    close, generate = Trainer.close, HFEngine.generate

    def closing(self: Trainer) -> None:
        events.append("trainer closed")
        close(self)

    def generating(self: HFEngine, requests):  # type: ignore[no-untyped-def]
        events.append("engine generates")
        return generate(self, requests)

    monkeypatch.setattr(Trainer, "close", closing)
    monkeypatch.setattr(HFEngine, "generate", generating)
    out = tmp_path / "result.json"
    assert main(["eval", str(TINY), *overrides, "--checkpoint", str(checkpoint), "-o", str(out)]) == 0
    assert events[0] == "trainer closed" and events.count("trainer closed") == 1 and "engine generates" in events
    assert json.loads(out.read_text())["step"] == 0

    events.clear()
    (tmp_path / "not-a-checkpoint").mkdir()
    assert main(["eval", str(TINY), *overrides, "--checkpoint", str(tmp_path / "not-a-checkpoint")]) == 2
    assert "not-a-checkpoint" in capsys.readouterr().err
    assert events == ["trainer closed"]  # built, its load refused, closed; no engine
