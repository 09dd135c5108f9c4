"""The LLM solvability check (validation's last step, on in the tool-use recipe) with real sandbox workers: the tiny
demo model in the real HF engine solves nothing, so it refuses programs at a bounded cost; a policy that wins (the
scripted solver engine: an LLM that solves environments cannot run here) lets solvable programs through; the loop
records a refusal as a validation failure (memory, metrics, the designer's invalid-program penalty)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from spade_mega.config.loader import load_config
from spade_mega.curriculum.memory import EnvMemory
from spade_mega.curriculum.rewards import designer_reward
from spade_mega.curriculum.prompts import PromptBuilder
from spade_mega.envs import library
from spade_mega.envs.program import EnvProgram
from spade_mega.envs.validate import Reason
from spade_mega.inference.hf import HFEngine
from spade_mega.rollout import AgentPlay, ChatTurns, DesignerSlot, PlayedSolvability, Rollout

from sandbox_support import strict_missing
from solver_engine import GIVE_UP, ScriptedSolverEngine

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"
CHECK = ["validation.solvability.enabled=true", "validation.solvability.attempts=2"]

# Plays like a working program until the policy gives up, then raises: the sandbox checks' probe and random actions
# never send that exact text, so only the solvability check's plays reach the bug.
BREAKS_ON_GIVING_UP = textwrap.dedent(f'''
    class Fussy:
        max_turns = 4

        def reset(self, seed):
            self.turn = 0
            return "Say the magic word."

        def step(self, action):
            if action == {GIVE_UP!r}:
                raise ValueError("cannot handle giving up")
            self.turn += 1
            return "No.", 0.0, action == "please", self.turn >= 4, {{}}
''')

# The same, but it hangs past sandbox.call_timeout_s instead of raising; and one whose step() always hangs, which the
# sandbox checks find.
HANGS_ON_GIVING_UP = BREAKS_ON_GIVING_UP.replace("class Fussy", "class Stubborn").replace(
    'raise ValueError("cannot handle giving up")', "while True: pass")
ALWAYS_HANGS = BREAKS_ON_GIVING_UP.replace("class Fussy", "class Sleepy").replace(
    "self.turn += 1", "while True: pass")
# Room for whole programs after the designer prompt (no model is built: the engine is scripted).
DESIGNER_ROOM = ["model.max_position_embeddings=16384", "parallel.max_tokens_per_gpu=16384",
                 "rollout.max_context_tokens=12000", "rollout.max_designer_tokens=4096"]


# Partial credit: each "up" pays 0.3 (two climb to the top: 0.6, a win), anything else 0.3 and the episode ends.
STAIRS = textwrap.dedent('''
    class Stairs:
        max_turns = 2

        def reset(self, seed):
            self.turn = 0
            return "Two steps up to the top."

        def step(self, action):
            self.turn += 1
            if action.strip() == "up":
                return "You climb a step.", 0.3, self.turn >= 2, False, {}
            return "You sit down on the stairs.", 0.3, True, False, {}
''')


def climb(observation: str):
    """The oracle of STAIRS."""
    while True:
        observation = yield "up"


@pytest.fixture(scope="module")
def pool_warm_workers() -> int:
    """``pool`` (tests/conftest.py) with a warm worker for each of the 4 programs played at once."""
    return 4


def solver(cfg, tokenizer, entries, designs=None) -> ScriptedSolverEngine:
    return ScriptedSolverEngine(ChatTurns(PromptBuilder.from_config(cfg, tokenizer)), entries, designs)


def test_the_check_is_off_by_default_and_on_in_the_tool_use_recipe(pool, tokenizer) -> None:
    cfg = load_config(TINY)
    assert not cfg.validation.solvability.enabled
    assert Rollout.from_config(cfg, None, pool, tokenizer).validator.solvability is None
    tool_use = load_config(ROOT / "examples" / "configs" / "qwen3_30b_a3b_tool_use.yaml").validation.solvability
    assert tool_use.enabled and tool_use.temperature == 0.3  # the reference validator's temperature
    assert not load_config(ROOT / "examples" / "configs" / "qwen3_30b_a3b_games.yaml").validation.solvability.enabled


def test_env_validate_says_it_did_not_run_the_check_a_config_enables(tmp_path) -> None:
    """``spade-mega env validate`` has no policy to ask: with a config that enables the check (the tool-use recipe),
    its "ok" covers the sandbox checks alone, and it says so instead of passing for the whole validation."""
    import subprocess
    import sys

    path = tmp_path / "stairs.py"
    path.write_text(STAIRS)
    script = Path(sys.executable).with_name("spade-mega")
    common = ["env", "validate", str(path), "-c", str(TINY), "-s", "sandbox.isolation=best-effort"]
    for extra in ([], ["-s", "validation.solvability.enabled=true"]):
        proc = subprocess.run([str(script), *common, *extra], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr
        said = "validation.solvability is enabled but was not run" in proc.stderr
        assert said == bool(extra), proc.stderr


def test_a_policy_that_wins_passes_solvable_programs_and_refuses_the_rest(pool, tokenizer) -> None:
    """One batch: every attempt of every program played in lockstep (one engine call per turn), at the check's
    temperature; a program is refused when no attempt with its hint wins, or when it breaks under the policy."""
    cfg = load_config(TINY, [*CHECK, "validation.solvability.temperature=0.2", "rollout.max_turns=12",
                             "rollout.max_response_tokens=256"])
    entries = [library.get("calendar_booking"), library.get("running_total")]
    engine = solver(cfg, tokenizer, entries)
    rollout = Rollout.from_config(cfg, engine, pool, tokenizer)
    booking, total = (e.program() for e in entries)
    hintless = EnvProgram(booking.source, "Book something.", booking.skill)  # the solver does not know this hint
    fussy = EnvProgram(BREAKS_ON_GIVING_UP, "Be polite.", "logic")
    reports = rollout.validator.validate_many([booking, hintless, total, fussy])

    assert [r.reason for r in reports] == [None, Reason.UNSOLVABLE, None, Reason.PROGRAM_ERROR]
    assert reports[1].detail.startswith("0 of 2 attempts with the hint won (reward >= rewards.win_threshold 0.5")
    assert "cannot handle giving up" in reports[3].detail
    costs = [r.stats["solvability"] for r in reports]
    assert [c["plays"] for c in costs] == [2.0] * 4 and [c["wins"] for c in costs] == [2.0, 0.0, 2.0, 0.0]
    assert all(c["generated_tokens"] > 0 and c["prompt_tokens"] > c["generated_tokens"] for c in costs)
    check = rollout.validator.solvability
    assert isinstance(check, PlayedSolvability)
    assert engine.temperatures == {0.2}
    longest = max(c["turns"] for c in costs) / 2
    assert len(engine.calls) == check.stats.engine_calls <= cfg.rollout.max_turns
    assert engine.calls[0] == 8 and sum(engine.calls) == sum(c["turns"] for c in costs)  # 8 plays at once
    assert check.stats.engine_calls >= longest
    # min_wins counts wins: both attempts must win now, and they do for the solvable programs
    strict = load_config(TINY, [*CHECK, "validation.solvability.min_wins=2", "rollout.max_turns=12",
                                "rollout.max_response_tokens=256"])
    assert Rollout.from_config(strict, engine, pool, tokenizer).validator.validate(total).ok


def test_a_timeout_costs_the_designer_the_same_wherever_it_is_found(pool, tokenizer) -> None:
    """SPADE pays a designer whose program's step() times out a bounded penalty (the reference: -0.5): a program that
    hangs under the solvability check's plays, or under the sandbox checks, is paid rewards.step_timeout_penalty as
    the same hang met in training's play is, and one that raises the invalid-program penalty. (A timeout in
    validation was paid the invalid-program penalty, 0 by default: hanging cost the designer less when caught early.)"""
    cfg = load_config(TINY, [*CHECK, *DESIGNER_ROOM, "rollout.max_turns=4", "rollout.max_response_tokens=64"])
    stubborn, fussy, sleepy = (EnvProgram(source, "Be polite.", "arithmetic")
                               for source in (HANGS_ON_GIVING_UP, BREAKS_ON_GIVING_UP, ALWAYS_HANGS))
    engine = solver(cfg, tokenizer, [], {"arithmetic": [stubborn, fussy, sleepy]})
    rollout = Rollout.from_config(cfg, engine, pool, tokenizer)
    outcomes = rollout.design([DesignerSlot("arithmetic") for _ in range(3)]).outcomes
    reports = [outcome.validation for outcome in outcomes]
    assert [r.reason for r in reports] == [Reason.TIMEOUT, Reason.PROGRAM_ERROR, Reason.TIMEOUT]
    assert "solvability" in reports[0].stats and "solvability" not in reports[2].stats  # found by the check / not
    (played,) = rollout.play([AgentPlay("stubborn", stubborn, seed=0)]).episodes
    assert played.designer_failure == "step_timeout"
    assert [o.failure for o in outcomes] == ["step_timeout", "invalid_program", "step_timeout"]
    paid = [designer_reward(cfg.rewards, {}, failure=o.failure).value for o in outcomes]
    assert paid == [cfg.rewards.step_timeout_penalty, cfg.rewards.invalid_program_penalty,
                    cfg.rewards.step_timeout_penalty] == [-0.5, 0.0, -0.5]


def test_a_random_model_solves_nothing_so_programs_are_refused_at_a_bounded_cost(pool, tokenizer) -> None:
    """The real engine and model: each program costs at most attempts x turns x max_response_tokens tokens."""
    cfg = load_config(TINY, [*CHECK, "rollout.max_turns=2", "rollout.max_response_tokens=8"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = HFEngine(cfg.model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      device="cpu", seed=0)
    try:
        rollout = Rollout.from_config(cfg, engine, pool, tokenizer)
        programs = [library.render("calendar_booking"), library.render("running_total")]
        reports = rollout.validator.validate_many(programs)
    finally:
        engine.close()
        torch.set_num_threads(threads)
    for report in reports:
        assert report.reason is Reason.UNSOLVABLE, report.detail
        assert report.detail.startswith("0 of 2 attempts with the hint won")
        cost = report.stats["solvability"]
        assert cost["plays"] == 2 and cost["wins"] == 0 and 2 <= cost["turns"] <= 2 * 2
        assert 0 < cost["generated_tokens"] <= 2 * 2 * 8
    stats = rollout.validator.solvability.stats
    assert stats.sequences == 4 and stats.engine_calls <= 2  # both programs' attempts in one batch per turn


def scripted_designer_actor(tmp_path, monkeypatch, *extra: str):
    """Rank 0's loop side (_Actor) with the solvability check on, its designer scripted (the tiny model writes no valid
    program) to write a shaped-reward program with the hint that wins it (``good``) and the same program with a
    useless hint (``useless``), played by a scripted solver in the real sandbox: (actor, good, useless)."""
    from spade_mega import inference
    from spade_mega.selfplay.loop import _Actor

    overrides = [*CHECK, *DESIGNER_ROOM, "rollout.envs_per_rollout=2", "rollout.agent_trajectories_per_env=2",
                 "rollout.hint_plays_per_env=2", "rollout.max_response_tokens=64", "selfplay.designer_delay=1",
                 "curriculum.active_skills=1", "selfplay.library_fallback=false", f"run.output_dir={tmp_path}", *extra]
    if strict_missing() is not None:
        overrides.append("sandbox.isolation=best-effort")
    cfg = load_config(TINY, overrides)
    good = EnvProgram(STAIRS, "Say up at every step.", "arithmetic")  # the first skill: the one active
    useless = EnvProgram(STAIRS, "Think hard.", "arithmetic")
    climber = SimpleNamespace(hint=good.hint, oracle=climb)
    monkeypatch.setattr(inference, "build_engine", lambda cfg, tok: solver(cfg, tok, [climber],
                                                                            {good.skill: [good, useless]}))
    return _Actor(cfg, tmp_path / "run"), good, useless


def test_the_loop_refuses_unsolvable_designs_and_counts_wins_of_shaped_rewards(tmp_path, monkeypatch,
                                                                              tokenizer) -> None:
    """Regeneration with the check on: the designer (scripted: the tiny model writes no valid program) writes a
    shaped-reward program with the hint that wins it and the same program with a useless hint. The useless one is
    refused as unsolvable (its attempts only earn partial credit): memory records the reason, metrics count the
    refusal and the check's cost, its designer sample carries the invalid-program penalty, and only the other one
    enters the environment set. Its plays then count wins, not returns: alone the agent earns 0.3 (partial credit,
    no win), with the hint 0.6 (a win), so memory holds win rates 0 and 1 and regret 0.3 (mean returns), and the
    designer's plateau reads win rate 0 (mean return 0.3 would read as 'nearly right')."""
    actor, good, useless = scripted_designer_actor(tmp_path, monkeypatch)
    cfg = actor.cfg
    try:
        metrics = actor.rollout(1).metrics
        later = actor.rollout(2).metrics
        memory_path = actor.memory.path
    finally:
        actor.close()
    assert metrics["designer/valid_rate"] == 0.5 and metrics["designer/rejected/validate_unsolvable"] == 1
    assert metrics["validation/solvability_plays"] == 4 and metrics["validation/solvability_wins"] == 2
    assert metrics["validation/solvability_generated_tokens"] > 0
    assert [env.program.content_hash for env in actor.environments] == [good.content_hash]
    assert metrics["agent/return"] == pytest.approx(0.3) and metrics["agent/win_rate"] == 0.0
    assert metrics["agent/hint_return"] == pytest.approx(0.6) and metrics["agent/hint_win_rate"] == 1.0
    assert metrics["designer/regret"] == pytest.approx(0.3)
    with EnvMemory(memory_path, create=False) as memory:
        rows = {r.content_hash: r for r in memory.iter_records()}
    assert (rows[useless.content_hash].status, rows[useless.content_hash].reason) == ("invalid", "unsolvable")
    row = rows[good.content_hash]
    assert (row.status, row.win_rate, row.win_rate_hint) == ("valid", 0.0, 1.0)
    assert row.regret == pytest.approx(0.3) and row.outcome == "frontier"
    # rollout 2 paid rollout 1's designer: the refused program its penalty, the other the blend of its win rate
    assert later["designer/released"] == 2 and later["designer/penalised"] == 1
    paid = (0.4 * 1.0 + cfg.rewards.invalid_program_penalty) / 2  # plateau(0) = 0, regret 0.3 / 0.15 capped at 1
    assert later["designer/reward"] == pytest.approx(paid)
