"""RL through the stack learns, not only runs: `spade-mega train examples/configs/tiny_learn.yaml`, the real loop end to
end (the demo's tiny Megatron model on gloo, GRPO advantages and loss, the in-process engine, the weight sync after
every step, the reward computed by an environment program in sandbox workers), agent-only on
examples/envs/first_char.py, which the random model wins about a fifth of the time. Its win rate must rise clearly
within 20 optimizer steps, and must not with optimizer.lr=0, the same run otherwise (same seeds, same first rollout):
so a rise comes from the updates, and a broken update, advantage sign or weight sync fails the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sandbox_support import strict_missing

from spade_mega.config.errors import ConfigError
from spade_mega.config.loader import load_config
from spade_mega.selfplay.loop import SelfPlay

ROOT = Path(__file__).resolve().parents[1]
LEARN = ROOT / "examples" / "configs" / "tiny_learn.yaml"
SCRIPT = Path(sys.executable).with_name("spade-mega")
QUIET = ["logging.progress=false", "logging.tensorboard=false", "logging.transcripts=false"]


def _isolation() -> list[str]:
    return [] if strict_missing() is None else ["sandbox.isolation=best-effort"]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
def test_the_win_rate_rises_with_training_and_stays_flat_at_lr_0(tmp_path: Path) -> None:
    # the config refuses a learning rate of 0; no update at 1e-12 survives float32 rounding
    runs = {"learn": [], "flat": ["optimizer.lr=1e-12"]}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {name: subprocess.Popen([str(SCRIPT), "train", str(LEARN), f"run.output_dir={tmp_path}",
                                     f"run.name={name}", *QUIET, *_isolation(), *extra],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
             for name, extra in runs.items()}  # side by side: one torch thread each, two cores
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: {stderr[-4000:]}"
    learn, flat = (_records(tmp_path / name) for name in runs)
    for records in (learn, flat):
        assert [r["step"] for r in records] == list(range(1, 21))
        assert all(r["agent/episodes"] == 32 and r["envs/fixed"] == 1 and r["envs/designer"] == 0 for r in records)
        assert all(r["train/steps"] == 1 for r in records)  # one optimizer step per rollout
    # the same weights and sampling seeds before the first update: the runs differ only by what training does
    assert learn[0]["agent/win_rate"] == flat[0]["agent/win_rate"]
    # every step's new weights reached the engine: its log-probs are the trainer's under the same weights
    assert max(r["train/rollout_logprob_abs_diff_max"] for r in learn) < 1e-3
    rate = {name: [r["agent/win_rate"] for r in records] for name, records in (("learn", learn), ("flat", flat))}
    early, late = _mean(rate["learn"][:5]), _mean(rate["learn"][-5:])
    assert 0.1 <= early <= 0.45, rate  # a random policy wins sometimes: GRPO has signal from the start
    assert late >= 0.7 and late - early >= 0.35, rate
    flat_early, flat_late = _mean(rate["flat"][:5]), _mean(rate["flat"][-5:])
    assert abs(flat_late - flat_early) < 0.15 and flat_late < 0.45, rate
    assert late - flat_late >= 0.35, rate


def test_fixed_environments_must_fill_every_slot() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(LEARN, ["rollout.envs_per_rollout=2"])
    assert info.value.path == "rollout.envs_per_rollout" and "selfplay.environments (1)" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(LEARN, ["selfplay.environments=[{path: x.py}]"])
    assert info.value.path == "selfplay.environments[0].skill"


@pytest.mark.parametrize("source, message, entry", [
    (None, "cannot read", 0),
    ("class Env:\n    max_turns = 1\n    def reset(self, seed):\n        return 3\n", "not a valid environment program",
     0),
    # a second copy would be one environment counted twice: its plays grouped with both entries' (the env id is the
    # program's content hash)
    ((ROOT / "examples" / "envs" / "first_char.py").read_text(), "the same program, hint and skill as entry 0", 1)])
def test_a_fixed_program_that_is_missing_invalid_or_repeated_stops_the_run_naming_it(
        tmp_path: Path, source: str | None, message: str, entry: int) -> None:
    program = tmp_path / "broken.py"
    if source is not None:
        program.write_text(source)
    listed = [f"{{path: {ROOT / 'examples' / 'envs' / 'first_char.py'}, skill: logic}}"] * entry + \
        [f"{{path: {program}, skill: logic}}"]
    cfg = load_config(LEARN, [f"run.output_dir={tmp_path}", "selfplay.num_rollouts=1", *QUIET, *_isolation(),
                              f"selfplay.environments=[{', '.join(listed)}]", f"rollout.envs_per_rollout={entry + 1}"])
    with pytest.raises(ConfigError, match=message) as info:
        SelfPlay(cfg).run()
    assert info.value.path == f"selfplay.environments[{entry}].path" and str(program) in str(info.value)
