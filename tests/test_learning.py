"""RL through the stack learns, not only runs: `spade-mega train examples/configs/tiny_learn.yaml`, the real loop end to
end (the demo's tiny Megatron model on gloo, GRPO advantages and loss, the in-process engine, the weight sync after
every step, the reward computed by an environment program in sandbox workers), agent-only on
examples/envs/first_char.py, which the random model wins about a fifth of the time. Its win rate must rise clearly
within 20 optimizer steps, and must not at optimizer.lr=1e-12 (0 is refused), the same run otherwise (same seeds, same
first rollout): so a rise comes from the updates, and a broken update, advantage sign or weight sync fails the test."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sandbox_support import strict_missing

from spade_mega.config.errors import ConfigError
from spade_mega.config.loader import load_config
from spade_mega.envs.program import EnvProgram
from spade_mega.selfplay.loop import SelfPlay
from spade_mega.selfplay.state import ActiveEnv

ROOT = Path(__file__).resolve().parents[1]
LEARN = ROOT / "examples" / "configs" / "tiny_learn.yaml"
FIRST_CHAR = ROOT / "examples" / "envs" / "first_char.py"
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
    try:
        for name, proc in procs.items():
            _, stderr = proc.communicate(timeout=600)
            assert proc.returncode == 0, f"{name}: {stderr[-4000:]}"
    finally:  # one failed or hung: the other run is not left training on CI's two cores
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
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


def test_a_resume_plays_the_listed_programs_as_they_are_now_and_says_what_changed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The checkpoint's environment set is played on until the next regeneration (every 20 rollouts here), so a resume
    whose program was edited on disk went on with the checkpoint's copy, silently. It sets the listed programs as they
    are now at once and says so; the checkpoint's program keeps its record in the memory."""
    from spade_mega.curriculum.memory import EnvMemory
    from spade_mega.selfplay.state import CheckpointStore

    mine = tmp_path / "mine.py"
    mine.write_text(FIRST_CHAR.read_text())
    listed = [*QUIET, *_isolation(), "rollout.agent_trajectories_per_env=4", "selfplay.global_batch_size=4",
              "selfplay.save_interval=1", f"selfplay.environments=[{{path: {mine}, hint: h, skill: logic}}]"]

    def run(rollouts: int) -> list[ActiveEnv]:
        SelfPlay(load_config(LEARN, [f"run.output_dir={tmp_path}", *listed, f"selfplay.num_rollouts={rollouts}"])).run()
        store = CheckpointStore(tmp_path / "tiny_learn")
        return store.read_state(store.latest()).environments

    (first,) = run(1)
    mine.write_text(FIRST_CHAR.read_text().replace("Reply with a word", "Reply with one word"))
    with caplog.at_level(logging.WARNING, logger="spade_mega.selfplay"):
        (now,) = run(2)
    warned = [r.getMessage() for r in caplog.records if "resume:" in r.getMessage()]
    assert len(warned) == 1 and f"selfplay.environments[0] ({mine}): its program, hint or skill changed" in warned[0]
    assert (now.origin, now.iteration, now.program.source) == ("fixed", 2, mine.read_text())  # set at rollout 2
    with EnvMemory.for_run(load_config(LEARN).curriculum.memory, tmp_path / "tiny_learn") as memory:
        kept = memory.get(first.env_id)  # the checkpoint's program and its plays stay recorded
    assert kept.plays == 4 and kept.last_iteration == 1
    # no hint plays, so no regret was measured: none is logged (0 was), and nothing is NaN without a designer
    records = _records(tmp_path / "tiny_learn")
    assert [r["step"] for r in records] == [1, 2] and not any("designer/regret" in r for r in records)
    assert all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))


def test_a_resume_says_how_the_listed_programs_differ_from_the_checkpoints_set() -> None:
    from spade_mega.selfplay.loop import _fixed_set_change
    from spade_mega.selfplay.state import LoopState

    def program(path: str, source: str = "class A:\n    pass\n", origin: str = "fixed") -> EnvProgram:
        return EnvProgram(source, "h", "logic", {"origin": origin, "path": path})

    a, b, c = program("a.py"), program("b.py"), program("c.py", "class C:\n    pass\n")
    designed = program("", "class D:\n    pass\n", "designer")

    def change(played: list[EnvProgram], listed: list[EnvProgram]) -> str | None:
        environments = [ActiveEnv(p, p.provenance["origin"], i, 1) for i, p in enumerate(played)]
        return _fixed_set_change(LoopState(rollout=3, environments=environments), listed)

    assert change([a, c], [b, c]) is None  # the same programs, hints and skills, wherever their files now are
    assert change([designed], []) is None
    edited = program("a.py", "class A2:\n    pass\n")
    assert change([a, c], [edited, c]) == ("selfplay.environments[0] (a.py): its program, hint or skill changed since "
                                          "the checkpoint: the listed programs are validated and set at rollout 4 (the "
                                          "checkpoint's keep their plays in the memory)")
    said = change([a, c], [c])
    assert said is not None and said.startswith("the checkpoint's fixed environment a.py is no longer listed:")
    said = change([designed], [a])
    assert said is not None and said.startswith(f"selfplay.environments[0] (a.py) is new; the checkpoint's designer "
                                                f"environment {designed.content_hash[:12]} is no longer listed:")
    said = change([a, c], [c, a])
    assert said is not None and said.startswith("selfplay.environments lists its programs in another order:")
    assert change([a, c], []) == ("the checkpoint's environment set is selfplay.environments, which the config no "
                                  "longer lists: the designer writes a new set at rollout 4")


def test_a_listed_program_that_breaks_in_play_stays_in_the_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A designer's program that breaks in play leaves the set until the next regeneration; a listed one is the whole
    set, so the run trained on nothing until then (up to 19 rollouts of tiny_learn.yaml), saying so once. It stays,
    its broken plays are not trained on, and each rollout it breaks in names it. Real sandbox; the scripted engine
    answers every play with GIVE_UP, which the program refuses (the validator never sends it)."""
    from solver_engine import GIVE_UP, ScriptedSolverEngine

    from spade_mega import inference
    from spade_mega.curriculum.prompts import PromptBuilder
    from spade_mega.rollout import ChatTurns
    from spade_mega.selfplay.loop import _Actor

    door = tmp_path / "door.py"
    door.write_text("class Door:\n    max_turns = 1\n\n    def reset(self, seed):\n        return 'A door.'\n\n"
                    f"    def step(self, action):\n        if action == {GIVE_UP!r}:\n"
                    "            raise ValueError('nobody gives up at this door')\n"
                    "        return 'Open.', 1.0, True, False, {}\n")
    cfg = load_config(LEARN, [f"run.output_dir={tmp_path}", *QUIET, *_isolation(), "rollout.max_response_tokens=64",
                              "rollout.agent_trajectories_per_env=2", "selfplay.global_batch_size=2",
                              f"selfplay.environments=[{{path: {door}, hint: Knock., skill: logic}}]"])
    monkeypatch.setattr(inference, "build_engine", lambda cfg, tok: ScriptedSolverEngine(
        ChatTurns(PromptBuilder.from_config(cfg, tok)), []))
    actor = _Actor(cfg, tmp_path / "run")
    try:
        with caplog.at_level(logging.WARNING, logger="spade_mega.selfplay"):
            played = actor.rollout(1)
            samples, first = played.samples, played.metrics
            second = actor.rollout(2).metrics
    finally:
        actor.close()
    assert samples == [] and first["agent/failed_episodes"] == 2
    assert second["envs/fixed"] == 1 and second["agent/episodes"] == 2 and second["agent/failed_episodes"] == 2
    broke = [r.getMessage() for r in caplog.records if str(door) in r.getMessage()]
    assert len(broke) == 2 and "selfplay.environments[0]" in broke[0] and "nobody gives up" in broke[0], broke


def test_a_listed_path_is_read_from_the_working_directory_and_a_missing_one_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spade_mega.config.schema import FixedEnvConfig
    from spade_mega.selfplay.loop import _fixed_programs

    relative = FixedEnvConfig("examples/envs/first_char.py", "h", "logic")  # tiny_learn.yaml's, from the repository
    monkeypatch.chdir(ROOT)
    assert _fixed_programs([relative])[0].source == FIRST_CHAR.read_text()
    monkeypatch.chdir(tmp_path)  # run from elsewhere
    with pytest.raises(ConfigError) as info:
        _fixed_programs([relative])
    assert info.value.path == "selfplay.environments[0].path"
    assert f"relative to the working directory {tmp_path}" in str(info.value)


def test_hint_plays_need_every_listed_program_to_have_a_hint() -> None:
    # a hint play of a program without a hint is another play without it: its regret would be noise
    with pytest.raises(ConfigError) as info:
        load_config(LEARN, ["rollout.hint_plays_per_env=2", "selfplay.environments=[{path: a.py, skill: logic}]"])
    assert info.value.path == "selfplay.environments[0].hint" and "rollout.hint_plays_per_env" in str(info.value)
    load_config(LEARN, ["selfplay.environments=[{path: a.py, skill: logic}]"])  # no hint plays: none needed


def test_the_schedule_horizon_of_agent_only_training_counts_no_designer_samples() -> None:
    # 32 plays in batches of 32: one optimizer step per rollout. Counting a designer sample per slot made it two, so a
    # cosine or linear schedule had decayed only half way at the run's end.
    cfg = load_config(LEARN, ["optimizer.lr_schedule=cosine"])
    assert SelfPlay(cfg)._steps_estimate() == cfg.selfplay.num_rollouts == 20


def test_the_learning_bench_never_reports_an_earlier_invocations_runs(tmp_path: Path) -> None:
    """``--out`` keeps the two runs; a second invocation into the same folder (another --seed, say) resumed the finished
    runs there, trained nothing and printed their curves as its own. It is refused before anything runs."""
    from tools.bench import learning

    (tmp_path / "trained").mkdir()
    with pytest.raises(SystemExit) as info:
        learning.main(["--rollouts", "1", "--seed", "7", "--out", str(tmp_path)])
    assert f"{tmp_path} already holds trained" in str(info.value)


def test_agent_only_training_neither_reads_nor_needs_the_corpus(tmp_path: Path) -> None:
    """The corpus grounds designer prompts; with selfplay.environments there are none, so the actor does not build it
    (it was read, deduplicated and indexed at every start for nothing, and a corpus path that does not exist on the
    cluster stopped an agent-only run). A designer run with the same corpus still stops, naming it."""
    from spade_mega.curriculum.corpus import CorpusError
    from spade_mega.selfplay.loop import _Actor

    corpus = [f"curriculum.corpus.sources=[{{path: {tmp_path / 'nowhere.jsonl'}, domain: maths}}]"]
    base = [f"run.output_dir={tmp_path}", *QUIET, *_isolation(), *corpus]
    actor = _Actor(load_config(LEARN, base), tmp_path / "agent_only")
    try:
        assert actor.sampler is None and actor.fixed
    finally:
        actor.close()
    designer = load_config(LEARN, [*base, "selfplay.environments=[]", "rollout.hint_plays_per_env=1"])
    with pytest.raises(CorpusError, match="nowhere.jsonl"):
        _Actor(designer, tmp_path / "designer").close()
