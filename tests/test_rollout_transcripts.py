"""Rollout transcripts: what a real loop run writes under run_dir/rollouts, that a resumed run rewrites it exactly,
that a crash while writing never tears a file, and `spade-mega rollouts` / the report on it."""

from __future__ import annotations

import gzip
import html
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sandbox_support import strict_missing

from spade_mega.cli import main
from spade_mega.config.errors import ConfigError
from spade_mega.config.loader import load_config
from spade_mega.curriculum.rewards import DesignerReward
from spade_mega.envs import library
from spade_mega.monitor.transcripts import (
    BackgroundWriter,
    TranscriptError,
    clip,
    discard_after,
    read_rollout,
    report_section,
    rollouts_written,
    select,
    transcript_path,
    write_rollout,
)
from spade_mega.rl.delayed import DesignerSample, ReleasedDesignerSample
from spade_mega.rollout.records import AgentEpisode
from spade_mega.selfplay.batch import Trajectory, advantages, train_samples
from spade_mega.selfplay.state import ActiveEnv, CheckpointStore
from spade_mega.selfplay.transcripts import RolloutTranscript
from spade_mega.tokenizer import byte_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}
# Two rollouts: the designer writes at rollout 1 (two invalid outputs: a random model) and is paid at once (delay 0:
# the resumed rollout 2 then trains no 3.6k-token designer sample, the costly part); two library environments, each
# played twice without the hint and once with it. A reward released rollouts later is tested on hand-written files.
RUN = ["selfplay.num_rollouts=2", "selfplay.regen_interval=2", "selfplay.designer_delay=0", "selfplay.save_interval=1",
       "selfplay.keep_checkpoints=null", "selfplay.global_batch_size=4", "rollout.envs_per_rollout=2",
       "rollout.agent_trajectories_per_env=2", "rollout.hint_plays_per_env=1", "rollout.max_turns=2",
       "rollout.max_response_tokens=16", "rollout.max_designer_tokens=48", "curriculum.corpus.token_budget=64",
       "rewards.invalid_program_penalty=-0.5", "logging.tensorboard=false", "logging.progress=false",
       "logging.transcript_max_chars=2000"]
# The straight run, with every sample the trainer receives recorded (role, tokens, advantage) per rollout.
PROBE = """
import json, sys
from spade_mega.selfplay import loop
trained = {}
original = loop.SelfPlay._train
def _train(self, trainer, samples, r):
    trained[r] = [[s.role, int(s.tokens.numel()), float(s.advantages[s.loss_mask][0])] for s in samples]
    return original(self, trainer, samples, r)
loop.SelfPlay._train = _train
from spade_mega.cli import main
code = main(["train", *sys.argv[2:]])
with open(sys.argv[1], "w") as f:
    json.dump(trained, f)
sys.exit(code)
"""


# --- the file format (fast) --------------------------------------------------------------------------------------


def test_clip_keeps_head_and_tail_and_says_how_much_was_cut() -> None:
    text = "HEAD-" + "x" * 5000 + "-TAIL"
    cut = clip(text, 300)
    assert cut is not None and len(cut) <= 300
    head, rest = cut.split("\n[... ")
    count, tail = rest.split(" characters cut ...]\n")
    assert head.startswith("HEAD-") and tail.endswith("-TAIL") and abs(len(head) - len(tail)) <= 1
    assert text.startswith(head) and text.endswith(tail) and len(head) + int(count) + len(tail) == len(text)
    assert clip("short", 300) == "short" and clip(None, 300) is None


def test_a_crash_while_writing_leaves_the_previous_file_whole(tmp_path: Path) -> None:
    """In-process (an exception in the middle of the records) and a real kill -9 of a writing process: the file of
    that rollout is still the previous complete one, readable; the temporary file the kill left is discarded."""
    first = [{"id": f"r1-{i}", "text": "a" * 100} for i in range(50)]
    path = write_rollout(tmp_path, 1, first)
    before = path.read_bytes()

    def torn():
        yield {"id": "new"}
        raise RuntimeError("crash")

    with pytest.raises(RuntimeError, match="crash"):
        write_rollout(tmp_path, 1, torn())
    assert path.read_bytes() == before and not list(path.parent.glob("*.tmp"))

    writer = subprocess.Popen([sys.executable, "-c", f"""
import os, time
from spade_mega.monitor.transcripts import write_rollout
def slow():
    for i in range(100_000):
        yield {{"id": i, "text": os.urandom(4096).hex()}}
        time.sleep(0.001)
write_rollout({str(tmp_path)!r}, 1, slow())
"""])
    tmp = path.with_name(path.name + ".tmp")
    deadline = time.monotonic() + 60
    while not (tmp.exists() and tmp.stat().st_size > 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert tmp.exists() and path.read_bytes() == before
    assert read_rollout(tmp_path, 1) == (1, first)
    assert discard_after(tmp_path, 1) == [] and not tmp.exists()


def test_the_background_writer_writes_one_rollout_at_a_time_and_raises_its_errors_on_wait() -> None:
    writer, events = BackgroundWriter(), []

    def slow(name: str) -> None:
        events.append(f"{name} started")
        time.sleep(0.2)
        events.append(f"{name} done")

    writer.submit(slow, "r1")
    writer.submit(slow, "r2")  # waits for r1's write first
    writer.wait()
    assert events == ["r1 started", "r1 done", "r2 started", "r2 done"]

    def broken() -> None:
        raise KeyError("a bug in a write")

    writer.submit(broken)
    with pytest.raises(KeyError, match="a bug in a write"):
        writer.wait()
    writer.wait()  # raised once


def test_discard_after_deletes_later_rollouts_only(tmp_path: Path) -> None:
    for r in (1, 2, 3):
        write_rollout(tmp_path, r, [{"rollout": r}])
    assert discard_after(tmp_path, 1) == [2, 3]
    assert rollouts_written(tmp_path) == [1]


def test_reading_a_run_without_transcripts_or_a_missing_rollout_says_what_exists(tmp_path: Path) -> None:
    with pytest.raises(TranscriptError, match="no rollout transcripts"):
        read_rollout(tmp_path)
    for r in (1, 2, 3, 5):
        write_rollout(tmp_path, r, [])
    with pytest.raises(TranscriptError, match="the run has rollouts 1-3, 5"):
        read_rollout(tmp_path, 4)
    transcript_path(tmp_path, 5).write_bytes(b"not gzip")
    with pytest.raises(TranscriptError, match="cannot read this transcript"):
        read_rollout(tmp_path)
    # a gzip header over a corrupt deflate stream (zlib.error, no OSError), and lines that are JSON but no record
    corrupt = bytearray(gzip.compress(b'{"id": "r5-env0-play0"}\n' * 100, mtime=0))
    corrupt[10] = 0x07  # the first block's type: 3, which deflate does not have
    for content in (bytes(corrupt), gzip.compress(b'{"id": "r5-env0-play0"}\n[1, 2]\n')):
        transcript_path(tmp_path, 5).write_bytes(content)
        with pytest.raises(TranscriptError, match="rollout_000005.jsonl.gz: cannot read this transcript"):
            read_rollout(tmp_path)
        assert main(["rollouts", str(tmp_path)]) == 2
        assert "cannot read this transcript" in report_section(tmp_path)  # the report says so, and is written


def test_a_designer_output_reads_beside_the_reward_a_later_rollout_released(tmp_path: Path) -> None:
    output = {"role": "designer", "kind": "output", "reward_rollout": 3, "program": "class Env: ...", "valid": True,
              "trained": False}
    write_rollout(tmp_path, 1, [{**output, "rollout": 1, "id": "r1-s0"}, {**output, "rollout": 1, "id": "r1-s1"}])
    write_rollout(tmp_path, 3, [{"rollout": 3, "role": "designer", "kind": "reward", "id": "r1-s0", "reward": 0.8,
                                 "components": {"regret": 0.3}, "advantage": 1.5, "trained": True, "output_rollout": 1},
                                {"rollout": 3, "role": "agent", "kind": "episode", "id": "r3-env0-play0",
                                 "advantage": -2.0, "trained": True, "group": "env0", "env_id": "abc"}])
    at_output = select(tmp_path, read_rollout(tmp_path, 1)[1], order="best")
    assert [(e["id"], e["released"], e.get("advantage")) for e in at_output] == [("r1-s0", True, 1.5),
                                                                                 ("r1-s1", False, None)]
    at_reward = select(tmp_path, read_rollout(tmp_path, 3)[1], order="worst")
    assert [(e["id"], e.get("program")) for e in at_reward] == [("r3-env0-play0", None), ("r1-s0", "class Env: ...")]
    assert at_reward[1]["components"] == {"regret": 0.3} and at_reward[1]["output_rollout"] == 1
    assert [e["id"] for e in select(tmp_path, read_rollout(tmp_path, 3)[1], env="ab")] == ["r3-env0-play0"]
    transcript_path(tmp_path, 1).unlink()  # its output's rollout has no transcript (written before it was on)
    [alone] = select(tmp_path, read_rollout(tmp_path, 3)[1], role="designer")
    assert (alone["id"], alone["output_rollout"], alone["reward_rollout"], alone["reward"]) == ("r1-s0", 1, 3, 0.8)
    assert "prompt" not in alone


def test_the_report_says_a_designer_reward_is_pending_and_shows_a_lone_episode_once(tmp_path: Path) -> None:
    """Right after a regeneration no output has its (delayed) reward: none is 'best'. One trained episode is both the
    highest and the lowest: it is shown once."""
    output = {"role": "designer", "kind": "output", "rollout": 1, "reward_rollout": 3, "program": "class Env: ...",
              "valid": True, "trained": False}
    episode = {"rollout": 1, "role": "agent", "kind": "episode", "advantage": 0.5, "trained": True, "group": "env0",
               "env_id": "abc", "prompt": "play", "turns": []}
    write_rollout(tmp_path, 1, [{**output, "id": "r1-s0"}, {**output, "id": "r1-s1"},
                                {**episode, "id": "r1-env0-play0"}])
    section = report_section(tmp_path)
    assert "best designer output" not in section and "designer output, reward pending (rollout 1)" in section
    assert section.count("id r1-env0-play0") == 1 and "advantage" not in section.split("<h3>")[1].split("</h3>")[0]
    write_rollout(tmp_path, 2, [{**output, "rollout": 2, "id": "r2-s0", "reward": 0.25, "advantage": 1.0},
                                {**episode, "rollout": 2, "id": "r2-env0-play0"},
                                {**episode, "rollout": 2, "id": "r2-env0-play1", "advantage": -0.5}])
    section = report_section(tmp_path)
    assert "best designer output (rollout 2)" in section and "highest-advantage agent episode (rollout 2)" in section
    assert "lowest-advantage agent episode (rollout 2)" in section and section.count("id r2-env0-play1") == 1


def test_transcript_max_chars_is_checked() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["logging.transcript_max_chars=10"])
    assert info.value.path == "logging.transcript_max_chars"


def _episode(env: ActiveEnv, tokenizer, hinted: bool, reward: float) -> AgentEpisode:
    ep = AgentEpisode(env.env_id, env.skill, env.env_id, hinted, seed=1, sampling_seed=2)
    ep.sequence.append_context(tokenizer.encode("the prompt"))
    start = len(ep.sequence)
    ep.sequence.append_generated(tokenizer.encode("<action>up</action>"), [-0.5] * 19, version=3)
    ep.turn_spans.append((start, len(ep.sequence)))
    ep.observations += ["first observation", "second observation"]
    ep.actions.append("up")
    ep.finish_reasons.append("stop")
    ep.replies.append("<action>up</action>")
    ep.step_rewards.append(reward)
    ep.terminated, ep.reward = True, reward
    return ep


def test_each_record_carries_the_advantage_its_train_sample_carries(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The loop's wiring on hand-made episodes with different rewards: the advantage a record states is the one
    the trainer's sample of that trajectory holds; hint plays and the masked designer reward are not trained."""
    cfg = load_config(TINY, [])
    tokenizer = byte_tokenizer()
    envs = [ActiveEnv(library.get(name).program(), "library", i, 1) for i, name in enumerate(("grid_maze",
                                                                                                 "running_total"))]
    episodes = [_episode(envs[0], tokenizer, False, r) for r in (1.0, 0.0, 0.5)] + \
        [_episode(envs[0], tokenizer, True, 1.0)] + [_episode(envs[1], tokenizer, False, r) for r in (0.2, 0.9)]
    transcript = RolloutTranscript(cfg, 4, tokenizer)
    transcript.episodes(envs, episodes)
    released = []
    for i, (value, mask) in enumerate(((0.7, None), (0.1, None), (0.0, "no_plays"))):
        sample = DesignerSample(f"r2-s{i}", f"env-{i}", "logic", 2, 1, [5, 6, 7, 8], [0, 0, 1, 1], [0, 0, -1.0, -1.0])
        released.append(ReleasedDesignerSample(sample, DesignerReward(value, mask, {"win_rate": 0.5})))
    transcript.released(released)
    trajectories = [Trajectory(ep.sequence.token_ids, ep.sequence.loss_mask, ep.sequence.behaviour_logprobs, "agent",
                               ep.reward, f"env{[e.env_id for e in envs].index(ep.env_id)}")
                    for ep in episodes if ep.trainable]
    trajectories += [Trajectory(item.sample.token_ids, item.sample.loss_mask, item.sample.behaviour_logprobs,
                                "designer", item.reward.value, item.sample.skill, valid=not item.reward.masked)
                     for item in released]
    values = advantages(trajectories, 2.0, cfg.rl, cfg.kernels)
    samples = train_samples(trajectories, values)
    transcript.settle(trajectories, values, [True] * len(samples))

    trained = [r for r in transcript.records if r["trained"]]
    assert [r["id"] for r in trained] == ["r4-env0-play0", "r4-env0-play1", "r4-env0-play2", "r4-env1-play0",
                                          "r4-env1-play1", "r2-s0", "r2-s1"]
    assert [r["advantage"] for r in trained] == [float(s.advantages[s.loss_mask][0]) for s in samples]
    assert len({r["advantage"] for r in trained}) > 3  # the groups differ: not a constant
    hint = next(r for r in transcript.records if r["hinted"])
    assert hint["id"] == "r4-env0-hint0" and hint["advantage"] is None and hint["reward"] == 1.0
    masked = next(r for r in transcript.records if r["id"] == "r2-s2")
    assert masked["trained"] is False and masked["mask_reason"] == "no_plays" and masked["advantage"] is None
    turn = transcript.records[0]["turns"][0]
    assert turn == {"reply": "<action>up</action>", "action": "up", "finish_reason": "stop", "reward": 1.0,
                    "observation": "second observation"}
    assert transcript.records[0]["prompt"] == "the prompt" and transcript.records[0]["weight_version"] == 3

    (Path(tmp_path) / "rollouts").write_text("a file where the folder goes")
    with caplog.at_level("WARNING", logger="spade_mega.selfplay"):
        assert transcript.write(tmp_path) is None  # a transcript that cannot be written does not stop training
    assert "rollout 4: transcript not written to" in caplog.text
    off = RolloutTranscript(load_config(TINY, ["logging.transcripts=false"]), 4, tokenizer)
    off.episodes(envs, episodes)
    assert off.records == [] and off.write(Path("/nonexistent")) is None


# --- a real run, straight and resumed (slow) ---------------------------------------------------------------------


def _train(out: Path, probe: Path | None = None) -> None:
    isolation = [] if strict_missing() is None else ["sandbox.isolation=best-effort"]
    args = [str(TINY), f"run.output_dir={out}", *RUN, *isolation]
    command = [sys.executable, "-c", PROBE, str(probe), *args] if probe else \
        [str(Path(sys.executable).with_name("spade-mega")), "train", *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """A straight run of two rollouts (with the samples its trainer received), and a copy of it as if it had died
    after the checkpoint of rollout 1 while writing rollout 2's transcript (a stale rollout 3 file and a temporary
    file left too), resumed."""
    base = tmp_path_factory.mktemp("transcripts")
    _train(base / "a", probe=base / "trained.json")
    straight, resumed = base / "a" / "tiny_cpu", base / "b" / "tiny_cpu"
    shutil.copytree(straight, resumed)
    store = CheckpointStore(resumed)
    for ckpt in sorted(store.root.glob("step_*")):
        if store.read_state(ckpt).rollout > 1:
            shutil.rmtree(ckpt)
    write_rollout(resumed, 2, [{"rollout": 2, "role": "agent", "id": "from the crashed attempt"}])
    write_rollout(resumed, 3, [{"rollout": 3}])
    transcript_path(resumed, 2).with_suffix(".gz.tmp").write_bytes(b"torn")
    _train(base / "b")
    return straight, resumed, json.loads((base / "trained.json").read_text())


@pytest.mark.slow
def test_each_rollout_has_one_file_with_every_trajectory(runs: tuple[Path, Path, dict]) -> None:
    straight, _, trained = runs
    assert rollouts_written(straight) == [1, 2]
    _, first = read_rollout(straight, 1)
    _, second = read_rollout(straight, 2)
    outputs = [r for r in first if r["kind"] == "output"]
    assert [(r["role"], r["id"], r["reward_rollout"]) for r in outputs] == [("designer", "r1-s0", 1),
                                                                            ("designer", "r1-s1", 1)]
    for r in outputs:
        assert r["valid"] is False and r["failure"] == "invalid_program" and r["trained"] is False
        assert r["weight_version"] == 0 and r["tokens"]["generated"] == 48 and r["finish_reasons"] == ["length"]
        assert r["reply"] and r["parse_error"] == "truncated" and isinstance(r["seed"], int)
        # the ~3.6k-character prompt, clipped to logging.transcript_max_chars: its head and its tail
        assert len(r["prompt"]) <= 2000 and "characters cut ...]" in r["prompt"]
        assert r["prompt"].startswith("<|im_start|>system") and r["prompt"].endswith("<|im_start|>assistant\n")
    for records, version in ((first, 0), (second, 2)):  # rollout 1 trained 4 + 2 samples: 2 steps of 4
        episodes = [r for r in records if r["role"] == "agent"]
        assert len(episodes) == 6 and {r["group"] for r in episodes} == {"env0", "env1"}
        for r in episodes:
            assert r["kind"] == "episode" and r["env_origin"] == "library" and r["weight_version"] == version
            assert r["trained"] is (not r["hinted"]) and (r["advantage"] is None) is r["hinted"]
            assert 1 <= len(r["turns"]) <= 2 and r["turns"][0]["reply"] and r["turns"][0]["observation"]
            assert r["prompt"].endswith("<|im_start|>assistant\n") and r["finish_reasons"]
            assert r["return"] == sum(t["reward"] for t in r["turns"]) and r["tokens"]["total"] > r["tokens"]["prompt"]
        assert sum(r["hinted"] for r in episodes) == 2
    rewards = [r for r in first if r["kind"] == "reward"]
    assert [(r["role"], r["id"], r["output_rollout"]) for r in rewards] == [("designer", "r1-s0", 1),
                                                                            ("designer", "r1-s1", 1)]
    assert not [r for r in second if r["role"] == "designer"]
    for r in rewards:
        assert r["reward"] == -0.5 and r["components"] == {"penalty": -0.5} and r["trained"] is True
    # the trained records are exactly the samples the trainer received, with the same advantages
    for rollout, records in ((1, first), (2, second)):
        stated = sorted([r["role"], r["tokens"]["total"], r["advantage"]] for r in records if r["trained"])
        assert stated == sorted(trained[str(rollout)])


@pytest.mark.slow
def test_each_loop_state_records_the_weights_the_engine_serves(runs: tuple[Path, Path, dict]) -> None:
    """The loop state saved with a checkpoint says which weights the engine serves (its policy_version: the trainer
    step, which the next rollout's records carry as their weight version); it said 0 in every state."""
    straight = runs[0]
    store = CheckpointStore(straight)
    states = {state.rollout: (int(ckpt.name.split("_")[1]), state)
              for ckpt in sorted(store.root.glob("step_*")) for state in [store.read_state(ckpt)]}
    assert sorted(states) == [1, 2]
    for step, state in states.values():
        assert state.policy_version == step > 0
    _, second = read_rollout(straight, 2)
    assert {r["weight_version"] for r in second if r["role"] == "agent"} == {states[1][1].policy_version}


@pytest.mark.slow
def test_a_resumed_run_rewrites_the_later_rollouts_as_the_straight_run(runs: tuple[Path, Path, dict]) -> None:
    straight, resumed, _ = runs
    assert rollouts_written(resumed) == [1, 2] and not list((resumed / "rollouts").glob("*.tmp"))
    for r in (1, 2):
        assert transcript_path(resumed, r).read_bytes() == transcript_path(straight, r).read_bytes(), r


@pytest.mark.slow
def test_the_rollouts_command_prints_a_rollout(runs: tuple[Path, Path, dict], capsys: pytest.CaptureFixture) -> None:
    run = str(runs[0])
    assert main(["rollouts", run]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"rollout 2 of {run}: 6 agent episode(s) (4 trained, 2 hint plays), 0 designer output(s), "
                          "0 designer reward(s) released; showing 6 of 6\n")
    for text in ("agent r2-env0-play0", "agent r2-env1-hint0", "hint play", "not trained", "observation:"):
        assert text in out, text

    assert main(["rollouts", run, "--rollout", "1", "--role", "designer", "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert "showing 1 of 2" in out and "designer r1-s0" in out and "designer r1-s1" not in out
    for text in ("penalty -0.5", "parse error:", "reply:", "prompt:", "1 more: raise --limit"):
        assert text in out, text

    assert main(["rollouts", run, "--rollout", "1", "--role", "designer", "--json"]) == 0
    entries = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(e["id"], e["released"], e["reward"], e["reward_rollout"]) for e in entries] == [
        ("r1-s0", True, -0.5, 1), ("r1-s1", True, -0.5, 1)] and all("program" in e for e in entries)

    assert main(["rollouts", run, "--role", "agent", "--env", "env1", "--worst", "--limit", "1", "--json"]) == 0
    [worst] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert worst["group"] == "env1" and worst["trained"]

    assert main(["rollouts", run, "--rollout", "9"]) == 2
    assert "no transcript of rollout 9; the run has rollouts 1-2" in capsys.readouterr().err
    assert main(["rollouts", str(runs[0].parent)]) == 2
    assert "this run has no rollout transcripts" in capsys.readouterr().err


@pytest.mark.slow
def test_the_report_shows_the_newest_rollouts_extremes(runs: tuple[Path, Path, dict]) -> None:
    page = (runs[0] / "report.html").read_text()  # the run's own, written at its end
    section = page[page.index("<h2 id='transcripts'>"):page.index("<h2>Config</h2>")]
    for title in ("highest-advantage agent episode (rollout 2)", "lowest-advantage agent episode (rollout 2)",
                  "best designer output (rollout 1)", "penalty -0.5", "[observation]", "[reply]"):
        assert title in section, title
    assert "&lt;|im_start|&gt;" in section and "<|im_start|>" not in section


# --- a write that fails with an unexpected error (a record json cannot write) ----------------------------------


def _failing_write(cfg, run_dir: Path) -> BackgroundWriter:
    """A writer whose rollout-1 write raises TypeError: a record holding a value json cannot write."""
    writer, transcript = BackgroundWriter(), RolloutTranscript(cfg, 1, byte_tokenizer())
    transcript.records.append({"id": "r1-env0-play0", "reward": object()})
    writer.submit(transcript.write, run_dir)
    return writer


def test_closing_the_actor_after_a_failed_write_still_closes_its_parts(tmp_path: Path) -> None:
    """The write's error is raised, and the memory (the sandbox pool, the engine) is closed all the same."""
    import sqlite3

    from spade_mega.curriculum.memory import EnvMemory
    from spade_mega.selfplay.loop import _Actor

    cfg = load_config(TINY, [])
    memory = EnvMemory.for_run(cfg.curriculum.memory, tmp_path)
    actor = _Actor.__new__(_Actor)  # its close() alone: what __init__ built is what it closes
    actor.writer, actor.closing, actor.executor = _failing_write(cfg, tmp_path), [memory], None
    with pytest.raises(TypeError, match="not JSON serializable"):
        actor.close()
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        memory.conn.execute("SELECT 1")


SAVE_ON_TWO_RANKS = """
import datetime, sys
import torch.distributed as dist
rank, init, config, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
from spade_mega.config.loader import load_config
from spade_mega.selfplay import loop
from test_rollout_transcripts import _failing_write
cfg = load_config(config, [f"run.output_dir={out}"])
actor = None
if rank == 0:  # the actor's rank: rollout 1's transcript write fails
    actor = loop._Actor.__new__(loop._Actor)
    actor.writer = _failing_write(cfg, out)
try:
    loop.SelfPlay(cfg)._save(None, actor, 1)  # never reaches the trainer: the loop state comes first
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}", flush=True)
    from spade_mega.megatron import parallel
    parallel.shutdown()  # as the CLI leaves: gloo's teardown at exit can abort a rank whose peer has gone
    sys.exit(2)
"""


@pytest.mark.multiproc
def test_a_failed_write_at_a_checkpoint_stops_every_rank_naming_it(tmp_path: Path) -> None:
    """Rank 0 waits for the rollout's transcript before the checkpoint; its failure reaches the other ranks,
    which would otherwise wait for rank 0 in the checkpoint's barrier (over NCCL until the collective timeout)."""
    from spade_mega.inference.server import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    env = {**ONE_THREAD, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    ranks = [subprocess.Popen([sys.executable, "-c", SAVE_ON_TWO_RANKS, str(rank), init, str(TINY), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
             for rank in (0, 1)]
    outputs = [proc.communicate(timeout=180)[0] for proc in ranks]
    assert [proc.returncode for proc in ranks] == [2, 2], outputs
    assert "TypeError: Object of type object is not JSON serializable" in outputs[0], outputs[0]
    assert "RankZeroError: rank 0 failed, so rank 1 stops too: TypeError: Object of type object is not JSON " \
           "serializable" in outputs[1], outputs[1]


def test_the_rollouts_command_prints_no_terminal_control_sequence_the_model_wrote(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Replies, programs and observations (a designer program's output) are untrusted text: an escape sequence in
    them must not reach the reader's terminal (clear the screen over what was printed, set the clipboard: OSC 52),
    so control characters are shown escaped; newlines and tabs stay."""
    evil = "ok\x1b[2J\x1b]52;c;cm0gLXJmIH4=\x07\r\x9b31m\tend\nnext line"
    write_rollout(tmp_path, 1, [
        {"rollout": 1, "role": "agent", "kind": "episode", "id": "r1-env0-play0\x1b[8m", "group": "env0",
         "env_id": "abc", "prompt": evil, "turns": [{"reply": evil, "action": "up", "observation": evil}],
         "failure": "env_error", "failure_detail": evil, "trained": True, "advantage": 1.0},
        {"rollout": 1, "role": "designer", "kind": "output", "id": "r1-s0", "prompt": "p", "reply": evil,
         "program": evil, "hint": evil, "valid": False, "validation": {"ok": False, "reason": "x", "output": evil}}])
    assert main(["rollouts", str(tmp_path), "--chars", "0"]) == 0
    out = capsys.readouterr().out
    assert not [c for c in out if c not in "\n\t" and (ord(c) < 32 or 127 <= ord(c) < 160)]
    assert out.count("ok\\x1b[2J\\x1b]52;c;cm0gLXJmIH4=\\x07\\x0d\\x9b31m") == 8 and "end\nnext line" in out
    assert "agent r1-env0-play0\\x1b[8m" in out
    assert main(["rollouts", str(tmp_path), "--json", "--role", "agent"]) == 0  # JSON as written: for programs
    assert json.loads(capsys.readouterr().out)["prompt"] == evil


def test_the_report_section_carries_no_markup_from_a_transcript(tmp_path: Path) -> None:
    """Every value a transcript file holds is shown escaped, model text and facts alike (a report is opened in a
    browser: a program holding '</script><img onerror>' must stay text)."""
    evil = "</script><img src=x onerror=alert(1)>"
    write_rollout(tmp_path, 1, [
        {"rollout": 1, "role": "agent", "kind": "episode", "id": evil, "skill": evil, "env_id": evil, "prompt": evil,
         "turns": [{"reply": evil, "observation": evil, "reward": evil}], "trained": True, "advantage": 1.0},
        {"rollout": 1, "role": "designer", "kind": "output", "id": "r1-s0", "program": evil, "hint": evil,
         "reward_rollout": 1, "valid": evil},
        {"rollout": 1, "role": "designer", "kind": "reward", "id": "r1-s0", "components": {evil: 1.0}, "reward": 0.5,
         "trained": True, "advantage": 0.3}])
    section = report_section(tmp_path)
    assert "best designer output (rollout 1)" in section and f"valid {html.escape(evil)}" in section
    assert "<img" not in section and "</script>" not in section


def test_an_episode_whose_return_overflows_is_recorded(tmp_path: Path) -> None:
    """Two finite step rewards of 1e308 (a designer program's): the record's return is null (JSON has no inf), its
    reward the clipped one the trainer uses, and the file is written (math.fsum raised OverflowError, in the run)."""
    from spade_mega.curriculum.rewards import episode_reward

    cfg = load_config(TINY, [])
    tokenizer = byte_tokenizer()
    env = ActiveEnv(library.get("grid_maze").program(), "library", 0, 1)
    ep = _episode(env, tokenizer, False, 1e308)
    ep.step_rewards.append(1e308)
    ep.reward = episode_reward(ep.step_rewards, True, cfg.rewards)
    transcript = RolloutTranscript(cfg, 1, tokenizer)
    transcript.episodes([env], [ep])
    assert transcript.write(tmp_path) is not None
    [record] = read_rollout(tmp_path, 1)[1]
    assert record["return"] is None and record["reward"] == cfg.rewards.agent_reward_max
