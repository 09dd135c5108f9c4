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


def _actor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, door: EnvProgram) -> tuple[object, object]:
    """The loop's actor whose designer writes ``door`` (its skill the one active) and whose policy knocks with the
    hint and gives up without it; and the config."""
    from spade_mega import inference
    from spade_mega.selfplay.loop import _Actor

    overrides = ["rollout.envs_per_rollout=1", "rollout.agent_trajectories_per_env=2", "rollout.hint_plays_per_env=2",
                 "rollout.max_response_tokens=64", "selfplay.designer_delay=1", "curriculum.active_skills=1",
                 "selfplay.library_fallback=false", "model.max_position_embeddings=16384",
                 "parallel.max_tokens_per_gpu=16384", "rollout.max_context_tokens=12000",
                 "rollout.max_designer_tokens=4096", f"run.output_dir={tmp_path}"]
    if strict_missing() is not None:
        overrides.append("sandbox.isolation=best-effort")
    cfg = load_config(TINY, overrides)
    engine = lambda cfg, tok: ScriptedSolverEngine(ChatTurns(PromptBuilder.from_config(cfg, tok)),  # noqa: E731
                                                   [SimpleNamespace(hint=door.hint, oracle=knock)],
                                                   {door.skill: [door]})
    monkeypatch.setattr(inference, "build_engine", engine)
    return _Actor(cfg, tmp_path / "run"), cfg


def test_a_program_that_breaks_in_play_is_no_seed_for_the_designer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   tokenizer) -> None:
    """Its hint plays win and its plays without the hint break: a regret of 1, the memory's best seed, while the
    designer is paid the penalty for it and it leaves the environment set. The memory records it invalid (reason
    program_error, as the solvability check's plays would), so no designer prompt shows it as an example (it stayed
    valid and became the first seed)."""
    door = EnvProgram(DOOR, "Knock.", "arithmetic")  # the first skill: the one active
    actor, cfg = _actor(tmp_path, monkeypatch, door)
    try:
        _, metrics = actor.rollout(1)
        environments = list(actor.environments)
        seeds = actor.memory.seeds(door.skill, 5)
        memory_path = actor.memory.path
        _, later = actor.rollout(2)
    finally:
        actor.close()
    assert metrics["designer/valid_rate"] == 1.0 and metrics["agent/failed_episodes"] == 2
    assert environments == []  # it left the set
    assert later["designer/penalised"] == 1 and later["designer/reward"] == cfg.rewards.invalid_program_penalty
    with EnvMemory(memory_path, create=False) as memory:
        (row,) = [r for r in memory.iter_records() if r.content_hash == door.content_hash]
    assert (row.status, row.reason) == ("invalid", "program_error")
    assert row.regret == pytest.approx(1.0)  # what was measured stays recorded
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
        _, first = actor.rollout(1)
        _, broke = actor.rollout(2)
        memory = actor.memory
        assert (first["agent/failed_episodes"], broke["agent/failed_episodes"]) == (0, 2)
        assert memory.get(door.content_hash).status == "invalid"
        memory.discard_after(1)
        record = memory.get(door.content_hash)
        assert (record.status, record.reason, record.last_iteration) == ("valid", None, 1)
    finally:
        actor.close()
