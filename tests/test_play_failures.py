"""What the loop keeps of an environment program that breaks while training plays it (its step() raises or hangs
on actions the validator never sent): the designer's penalty, and a memory record that never offers it to the designer
as an example to follow. Real sandbox workers; the policy is the scripted solver engine (it wins with the hint and
gives up without it), since no model that plays environments runs here."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from sandbox_support import strict_missing
from solver_engine import GIVE_UP, ScriptedSolverEngine

from spade_mega.cli import main
from spade_mega.config.loader import load_config
from spade_mega.curriculum.memory import EnvMemory
from spade_mega.curriculum.prompts import PromptBuilder
from spade_mega.envs.program import EnvProgram
from spade_mega.rollout import ChatTurns

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"

# Any action opens the door (reward 1), but giving up raises: the validator's probe and random actions never send
# that text, the hint plays (which knock) never do, the agent's plays without the hint always do.
DOOR = textwrap.dedent(f'''
    class Door:
        max_turns = 2

        def reset(self, seed):
            return "A closed door."

        def step(self, action):
            if action == {GIVE_UP!r}:
                raise ValueError("nobody gives up at this door")
            return "It opens.", 1.0, True, False, {{}}
''')


def knock(observation: str):
    while True:
        observation = yield "knock"


def _actor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, door: EnvProgram, designs: list[EnvProgram] | None = None,
           extra: tuple[str, ...] = ()) -> tuple[object, object]:
    """The loop's actor whose designer writes ``door`` (or ``designs``, in order; their skill the one active) and
    whose policy knocks with the hint and gives up without it; and the config."""
    from spade_mega import inference
    from spade_mega.selfplay.loop import _Actor

    overrides = ["rollout.envs_per_rollout=1", "rollout.agent_trajectories_per_env=2", "rollout.hint_plays_per_env=2",
                 "rollout.max_response_tokens=64", "selfplay.designer_delay=1", "curriculum.active_skills=1",
                 "selfplay.library_fallback=false", "model.max_position_embeddings=16384",
                 "parallel.max_tokens_per_gpu=16384", "rollout.max_context_tokens=12000",
                 "rollout.max_designer_tokens=4096", f"run.output_dir={tmp_path}", *extra]
    if strict_missing() is not None:
        overrides.append("sandbox.isolation=best-effort")
    cfg = load_config(TINY, overrides)
    engine = lambda cfg, tok: ScriptedSolverEngine(ChatTurns(PromptBuilder.from_config(cfg, tok)),  # noqa: E731
                                                   [SimpleNamespace(hint=door.hint, oracle=knock)],
                                                   {door.skill: designs or [door]})
    monkeypatch.setattr(inference, "build_engine", engine)
    return _Actor(cfg, tmp_path / "run"), cfg


def test_a_program_that_breaks_in_play_is_no_seed_for_the_designer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   tokenizer) -> None:
    """Its hint plays win and its plays without the hint break: counted as scoring 0, a regret of 1, the memory's
    best seed, while the designer is paid the penalty for it and it leaves the environment set. The memory records it
    invalid (reason program_error, as the solvability check's plays would), so no designer prompt shows it as an
    example (it stayed valid and became the first seed), and records no evaluation: no play measured the agent."""
    door = EnvProgram(DOOR, "Knock.", "arithmetic")  # the first skill: the one active
    actor, cfg = _actor(tmp_path, monkeypatch, door)
    try:
        metrics = actor.rollout(1).metrics
        environments = list(actor.environments)
        seeds = actor.memory.seeds(door.skill, 5)
        memory_path = actor.memory.path
        later = actor.rollout(2).metrics
    finally:
        actor.close()
    assert metrics["designer/valid_rate"] == 1.0 and metrics["agent/failed_episodes"] == 2
    # nothing to average: absent (not 0) from the record, as README says
    assert not {"agent/return", "agent/win_rate", "designer/regret"} & set(metrics), metrics
    assert metrics["agent/hint_return"] == 1.0 and metrics["agent/broken_plays"] == 2
    assert environments == []  # it left the set
    assert later["designer/penalised"] == 1 and later["designer/reward"] == cfg.rewards.invalid_program_penalty
    with EnvMemory(memory_path, create=False) as memory:
        (row,) = [r for r in memory.iter_records() if r.content_hash == door.content_hash]
    assert (row.status, row.reason) == ("invalid", "program_error")
    assert row.evaluations == () and row.regret is None  # a regret of 1 before, from plays that measured nothing
    assert [s.content_hash for s in seeds] == []


def test_a_resume_from_before_the_break_finds_the_program_valid_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     tokenizer) -> None:
    """The door breaks only in rollout 2 (its reset seed), after rollout 1 found it valid: a run resumed from the
    checkpoint of rollout 1 replays rollout 2 from the memory as it was then, the program valid (it stayed invalid:
    the replay's designer prompts could differ from the uninterrupted run's)."""
    from spade_mega.selfplay.state import derive_seed

    cfg = load_config(TINY)
    assert cfg.selfplay.regen_interval == 2  # rollout 2 plays rollout 1's set
    second = derive_seed(cfg.run.seed, "reset", 2, 0)
    reset = "    def reset(self, seed):\n"
    source = DOOR.replace(reset, reset + "        self.seed = seed\n").replace(
        "        if action == ", f"        if self.seed == {second} and action == ")
    assert source.count("self.seed") == 2
    door = EnvProgram(source, "Knock.", "arithmetic")
    actor, _ = _actor(tmp_path, monkeypatch, door)
    try:
        first = actor.rollout(1).metrics
        broke = actor.rollout(2).metrics
        memory = actor.memory
        assert (first["agent/failed_episodes"], broke["agent/failed_episodes"]) == (0, 2)
        assert memory.get(door.content_hash).status == "invalid"
        memory.discard_after(1)
        record = memory.get(door.content_hash)
        assert (record.status, record.reason, record.last_iteration) == ("valid", None, 1)
    finally:
        actor.close()


# Giving up wins on the mat in its second turn, knocking breaks it: its plays without the hint are measured (two turns
# each, where every other play of the test takes one), its hint plays broken.
MAT = textwrap.dedent('''
    class Mat:
        max_turns = 2

        def reset(self, seed):
            self.wiped = False
            return "A doormat."

        def step(self, action):
            if action == "knock":
                raise ValueError("nobody knocks on a doormat")
            if not self.wiped:
                self.wiped = True
                return "Wipe them again.", 0.0, False, False, {}
            return "You wipe your feet.", 1.0, True, False, {}
''')


def test_a_play_its_program_broke_is_no_measurement_of_the_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  tokenizer, capsys: pytest.CaptureFixture) -> None:
    """A broken play's reward is what the episode held when the program raised, not the agent's score: it is left
    out of agent/return, the win rates, regret, the skill trackers, the memory's evaluation and the designer buffer's
    plays, counted in agent/broken_plays and marked in the transcript. The door breaks every play without the hint
    (its hint plays win), the doormat every hint play (its plays without the hint win): all four measured plays of
    each kind are wins. Before, the broken ones counted as scoring 0: agent/return and agent/win_rate 0.5, a regret
    of 1 for the door and -1 for the doormat in the memory and designer/regret 0, the trackers fed 0.5. agent/turns
    averages the same plays (every episode's before, hint plays and broken ones too). The doormat's evaluation has no
    win rate with the hint and no regret (before: the agent's win rate copied, a regret of 0)."""
    door, mat = EnvProgram(DOOR, "Knock.", "arithmetic"), EnvProgram(MAT, "Knock.", "arithmetic")
    actor, cfg = _actor(tmp_path, monkeypatch, door, [door, mat], ["rollout.envs_per_rollout=2"])
    try:
        played = actor.rollout(1)
        samples, metrics = played.samples, played.metrics
        actor.trained(played, [True] * len(samples))  # the transcript, written
        plays = actor.buffer.state_dict()["plays"]
        tracker = actor.trackers.trackers["arithmetic"]
        records = [r for r in played.transcript.records if r["kind"] == "episode"]
        with EnvMemory(actor.memory.path, create=False) as memory:
            rows = {r.content_hash: r for r in memory.iter_records()}
    finally:
        actor.close()
    assert metrics["designer/valid_rate"] == 1.0 and metrics["designer/outputs"] == 2  # both played (both leave)
    assert metrics["agent/episodes"] == 4  # the plays without the hint, broken or not
    assert metrics["agent/broken_plays"] == 4 and metrics["agent/failed_episodes"] == 4
    assert metrics["agent/return"] == 1.0 and metrics["agent/win_rate"] == 1.0  # the doormat's two plays
    assert metrics["agent/turns"] == 2.0  # theirs (1.25 over every episode before)
    assert metrics["agent/hint_return"] == 1.0 and metrics["agent/hint_win_rate"] == 1.0  # the door's two
    assert "designer/regret" not in metrics  # no environment measured with and without the hint
    assert (tracker.mu_slow, tracker.updates) == (1.0, 1)
    assert rows[door.content_hash].evaluations == ()  # nothing of the agent measured on it
    (evaluation,) = rows[mat.content_hash].evaluations
    assert (evaluation.plays, evaluation.hint_plays, evaluation.win_rate) == (2, 0, 1.0)
    assert (evaluation.win_rate_hint, evaluation.regret) == (None, None)  # not measured with the hint (1.0, 0.0)
    assert sorted((env == door.content_hash, role, returns) for env, role, _, returns in plays) == [
        (False, "agent", [1.0, 1.0]), (True, "hint", [1.0, 1.0])]
    measured = {(r["env_id"] == door.content_hash, r["hinted"]): r["measured"] for r in records}
    assert measured == {(True, False): False, (True, True): True, (False, False): True, (False, True): False}
    assert main(["rollouts", str(tmp_path / "run"), "--role", "agent"]) == 0
    assert capsys.readouterr().out.count("its program broke it: no measurement of the agent") == 4
