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


def test_a_program_that_breaks_in_play_is_no_seed_for_the_designer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   tokenizer) -> None:
    """Its hint plays win and its plays without the hint break: a regret of 1, the memory's best seed, while the
    designer is paid the penalty for it and it leaves the environment set. The memory records it invalid (reason
    program_error, as the solvability check's plays would), so no designer prompt shows it as an example (it stayed
    valid and became the first seed)."""
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
    door = EnvProgram(DOOR, "Knock.", "arithmetic")  # the first skill: the one active
    engine = lambda cfg, tok: ScriptedSolverEngine(ChatTurns(PromptBuilder.from_config(cfg, tok)),  # noqa: E731
                                                   [SimpleNamespace(hint=door.hint, oracle=knock)],
                                                   {door.skill: [door]})
    monkeypatch.setattr(inference, "build_engine", engine)
    actor = _Actor(cfg, tmp_path / "run")
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
