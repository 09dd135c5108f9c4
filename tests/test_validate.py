"""Validation in real sandboxes: every known-bad program is rejected with its expected reason code (and every code
has such a program), good programs pass, and the solvability hook decides last."""

from __future__ import annotations

import textwrap
from collections import Counter
from pathlib import Path

import pytest

from spade_mega.config.errors import ConfigError
from spade_mega.config.loader import load_config
from spade_mega.config.schema import SolvabilityConfig, ValidationConfig
from spade_mega.envs import library
from spade_mega.envs.program import EnvProgram
from spade_mega.envs.sandbox import SandboxPool
from spade_mega.envs.validate import Reason, SolvabilityVerdict, ValidationReport, Validator

from sandbox_support import GUESS_NUMBER, program, strict_pool

pytestmark = pytest.mark.multiproc

KNOWN_BAD = sorted((Path(__file__).parent / "data" / "known_bad").glob("*.py"))
ROOT = Path(__file__).resolve().parents[1]
TEST_BUDGET_S = 3.0  # validation.time_budget_s for the known-bad programs: the others are rejected well within it


def expected_reason(path: Path) -> Reason:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name} must start with '# expect: <reason>'"
    return Reason(first.removeprefix("# expect: ").strip())


def brute_force_solvable(pool: SandboxPool, actions: list[str], depth: int):
    """A solvability check for tests: does any sequence of ``actions`` (up to ``depth``) earn a positive return?"""

    def one(prog: EnvProgram) -> SolvabilityVerdict:
        with pool.open(prog) as env:
            frontier: list[list[str]] = [[]]
            for _ in range(depth):
                frontier = [path + [a] for path in frontier for a in actions]
                for path in frontier:
                    env.reset(0)
                    total = sum(env.step(a).reward for a in path)
                    if total > 0:
                        return SolvabilityVerdict(True, f"solved by {path}")
        return SolvabilityVerdict(False, f"no sequence of {actions} up to {depth} actions earns a reward")

    return lambda programs: [one(prog) for prog in programs]


@pytest.fixture(scope="module")
def pool():
    with strict_pool(warm_workers=4, call_timeout_s=1.0) as p:
        yield p


@pytest.fixture(scope="module")
def known_bad_reports(pool: SandboxPool) -> dict[str, ValidationReport]:
    unsolvable = KNOWN_BAD[[p.name for p in KNOWN_BAD].index("unsolvable.py")]
    validator = Validator(pool, ValidationConfig(concurrency=4, time_budget_s=TEST_BUDGET_S))
    programs = [program(path.read_text()) for path in KNOWN_BAD if path != unsolvable]
    reports = dict(zip([p.name for p in KNOWN_BAD if p != unsolvable], validator.validate_many(programs)))
    checked = Validator(pool, solvability=brute_force_solvable(pool, ["1", "123456789012"], 2))
    reports[unsolvable.name] = checked.validate(program(unsolvable.read_text()))
    return reports


@pytest.mark.parametrize("path", KNOWN_BAD, ids=[p.stem for p in KNOWN_BAD])
def test_known_bad_program_is_rejected_with_its_reason(known_bad_reports: dict[str, ValidationReport],
                                                       path: Path) -> None:
    report = known_bad_reports[path.name]
    assert not report.ok
    assert report.reason == expected_reason(path), f"{path.name}: {report.reason}: {report.detail}"
    assert report.detail  # a rejection always says what went wrong


def test_every_reason_code_has_a_known_bad_program() -> None:
    assert len(KNOWN_BAD) >= 15
    assert {expected_reason(path) for path in KNOWN_BAD} == set(Reason)


def test_a_good_program_passes_with_stats(pool: SandboxPool) -> None:
    report = Validator(pool).validate(program(GUESS_NUMBER))
    assert report.ok, f"{report.reason}: {report.detail}"
    assert (report.class_name, report.max_turns) == ("GuessNumber", 8)
    assert report.stats["fixed_turns"] == 8 and all(1 <= t <= 8 for t in report.stats["random_turns"])
    assert report.to_dict()["reason"] is None


def test_solvability_hook_runs_last_and_only_on_otherwise_valid_programs(pool: SandboxPool) -> None:
    two_steps = textwrap.dedent("""
        class Door:
            max_turns = 3

            def reset(self, seed):
                self.opened = False
                self.turn = 0
                return "A locked door. Try: knock, open."

            def step(self, action):
                self.turn += 1
                if action == "knock":
                    self.opened = True
                    return "Someone unlocks it.", 0.0, False, self.turn >= 3, {}
                if action == "open" and self.opened:
                    return "You are in!", 1.0, True, False, {}
                return "Nothing happens.", 0.0, False, self.turn >= 3, {}
    """)
    calls: list[list[str]] = []

    def counting(programs: list[EnvProgram]) -> list[SolvabilityVerdict]:
        calls.append([prog.content_hash for prog in programs])
        return brute_force_solvable(pool, ["open", "knock"], 2)(programs)

    validator = Validator(pool, solvability=counting)
    door, broken, guess = program(two_steps), program("class Broken(:\n"), program(GUESS_NUMBER)
    finals: list[ValidationReport] = []
    reports = validator.validate_many([door, broken, guess], finals.append)
    assert [r.reason for r in reports] == [None, Reason.SYNTAX, Reason.UNSOLVABLE]
    assert "no sequence of ['open', 'knock']" in reports[2].detail
    # one call for every program that passed the sandbox checks (batched), none for the one that failed them
    assert calls == [[door.content_hash, guess.content_hash]]
    assert sorted(r.content_hash for r in finals) == sorted(r.content_hash for r in reports)  # each once, final
    assert all(r.stats["solvability"] == {} for r in (reports[0], reports[2]))
    # programs known to be solvable (the library's) skip the check
    assert validator.validate_many([guess], solvability=False)[0].ok and len(calls) == 1


def test_reward_range_comes_from_the_config(pool: SandboxPool) -> None:
    points = (Path(__file__).parent / "data" / "known_bad" / "reward_out_of_range.py").read_text()
    assert Validator(pool, ValidationConfig(reward_min=0.0, reward_max=10.0)).validate(program(points)).ok


def test_reasons_count_for_metrics(known_bad_reports: dict[str, ValidationReport]) -> None:
    counts = Counter(report.reason for report in known_bad_reports.values())
    assert counts[Reason.BAD_MAX_TURNS] == 2 and counts[Reason.STEP_CONTRACT] == 2
    assert all(isinstance(reason, Reason) and reason.value == str(reason.value) for reason in counts)


def test_a_slow_program_is_stopped_at_the_validation_time_budget(
        known_bad_reports: dict[str, ValidationReport]) -> None:
    report = known_bad_reports["time_budget.py"]
    assert report.reason == Reason.TIME_BUDGET
    assert f"over validation.time_budget_s ({TEST_BUDGET_S:g} s)" in report.detail
    took = float(report.detail.split("took ")[1].split(" s")[0])
    assert TEST_BUDGET_S <= took < report.seconds
    # 4 rounds of 100 steps of 0.5 s would hold the validator for 200 s; it stops within a step of the budget
    assert report.seconds < TEST_BUDGET_S + 5


def test_the_time_budget_must_be_positive() -> None:
    ValidationConfig(time_budget_s=0.5).check()
    with pytest.raises(ConfigError, match="validation.time_budget_s"):
        ValidationConfig(time_budget_s=0).check()


def test_the_seed_must_leave_room_for_every_validation_episode() -> None:
    # Episodes run from validation.seed to seed + random_episodes, and the sandbox takes 64-bit seeds: a seed past
    # that crashed validation with a TypeError out of the sandbox pool instead of naming the setting.
    ValidationConfig(seed=-2**63).check()
    ValidationConfig(seed=2**64 - 3, random_episodes=2).check()
    for seed in (2**64 - 2, -2**63 - 1, 10**30):
        with pytest.raises(ConfigError, match=r"validation.seed: must be in \[-2\*\*63, 2\*\*64 - 1 - "
                                              r"validation.random_episodes\]"):
            ValidationConfig(seed=seed).check()
    on = SolvabilityConfig(enabled=True, attempts=4)
    ValidationConfig(seed=2**64 - 4, solvability=on).check()
    with pytest.raises(ConfigError, match=r"validation.seed: must be <= 2\*\*64 - validation.solvability.attempts"):
        ValidationConfig(seed=2**64 - 3, solvability=on).check()


def marathon(ends: bool) -> str:
    """A 40-turn program that ends at its max_turns (``ends``) or never."""
    return textwrap.dedent(f"""
        class Marathon:
            max_turns = 40

            def reset(self, seed):
                self.turn = 0
                return "Run."

            def step(self, action):
                self.turn += 1
                return f"Lap {{self.turn}}.", 0.0, False, {ends} and self.turn >= 40, {{}}
    """)


def test_validation_plays_the_turns_the_rollout_plays(pool: SandboxPool) -> None:
    # The rollout truncates every episode at rollout.max_turns; a program may declare more (up to max_turns_limit).
    validator = Validator(pool, rollout_turns=25)
    report = validator.validate(program(marathon(ends=True)))
    assert report.ok, report.detail
    assert (report.max_turns, report.horizon) == (40, 25) and report.to_dict()["horizon"] == 25
    assert report.stats["fixed_turns"] == 25 and report.stats["random_turns"] == [25, 25]
    # Turns past the horizon never run in training, so only a standalone validation requires the end by max_turns.
    assert validator.validate(program(marathon(ends=False))).ok
    standalone = Validator(pool).validate(program(marathon(ends=False)))
    assert standalone.reason == Reason.EPISODE_TOO_LONG and standalone.horizon == 40
    short = Validator(pool, rollout_turns=25).validate(program(GUESS_NUMBER))
    assert short.ok and (short.max_turns, short.horizon) == (8, 8)
    with pytest.raises(ValueError, match="rollout_turns"):
        Validator(pool, rollout_turns=0)


def test_the_long_library_programs_validate_under_the_reference_config(pool: SandboxPool) -> None:
    cfg = load_config(ROOT / "examples" / "configs" / "qwen3_30b_a3b_games.yaml")
    programs = [e.program(level=level) for e in library.entries() for level in (0.0, None, 1.0)]
    names = [f"{p.provenance['name']}@{p.provenance['difficulty']}" for p in programs]
    long = [(n, p) for n, p in zip(names, programs) if n.split("@")[0] in
            {"grid_maze", "fog_maze", "box_push", "heading_maze", "log_audit", "bank_transfer"}]
    reports = Validator(pool, cfg.validation, rollout_turns=cfg.rollout.max_turns).validate_many([p for _, p in long])
    assert [(n, r.reason, r.detail) for (n, _), r in zip(long, reports) if not r.ok] == []
    assert max(r.max_turns for r in reports) == 66  # fog_maze at its hardest: its episodes are cut at 25 turns
    assert all(r.horizon == min(r.max_turns, cfg.rollout.max_turns) for r in reports)


DICE = textwrap.dedent("""
    import random

    class Dice:
        max_turns = 10

        def reset(self, seed):
            self.rng = random.Random(seed)
            self.total, self.turn = 0, 0
            return "Spin the wheel: say roll, or hold. Reach a total of 3."

        def step(self, action):
            self.turn += 1
            if action.strip() in ("roll", "hold"):
                self.total += random.uniform(0, 1)  # the bug: the global RNG, seeded differently in every process
            if self.total >= 3:
                return f"Total {self.total:.6f}. You win.", 1.0, True, False, {}
            return f"Total {self.total:.6f}. Say roll or hold.", 0.0, False, self.turn >= self.max_turns, {}
""")


def test_random_action_episodes_are_checked_for_determinism_too(pool: SandboxPool) -> None:
    # The fixed probe never says 'roll' or 'hold', so only the random-action episodes reach the global RNG; an agent
    # would at once, and its episodes from one seed would differ from worker to worker (a draw from [0, 1) shown to
    # six places, so two workers agree by chance about once in a million).
    report = Validator(pool).validate(program(DICE))
    assert report.reason == Reason.NONDETERMINISTIC_EPISODE, report
    assert "the random-action episode from seed 2 went differently in the two workers" in report.detail
    fixed = Validator(pool).validate(program(DICE.replace("random.uniform", "self.rng.uniform")))
    assert fixed.ok, fixed.detail
    assert len(fixed.stats["random_turns"]) == ValidationConfig().random_episodes


def test_a_max_turns_drawn_when_the_module_loads_is_refused(pool: SandboxPool) -> None:
    # Every worker loads the module afresh, so each would truncate the episodes at a turn of its own; past the
    # rollout's 25 turns nothing in the episodes showed it, and a worker drawing 12 played 25 turns unchecked.
    source = textwrap.dedent("""
        import random

        class Drifting:
            max_turns = random.randint(30, 10**6)

            def reset(self, seed):
                return "Walk."

            def step(self, action):
                return "Still walking.", 0.0, False, False, {}
    """)
    report = Validator(pool, ValidationConfig(max_turns_limit=10**6), rollout_turns=25).validate(program(source))
    assert report.reason == Reason.BAD_MAX_TURNS, report
    assert "Drifting.max_turns is" in report.detail and "in the other fresh worker" in report.detail
