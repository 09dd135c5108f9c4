"""Validation of environment programs: a program is used only if it passes, and a rejection carries one reason code.

The checks, in order (the first failure decides the reason):

1. syntax, then the module loads and defines exactly one environment class with a sane ``max_turns``, the same in
   two fresh workers;
2. ``reset(seed)`` returns a str, and the same str in two fresh workers;
3. a fixed action sequence played from that seed in both workers gives the same digest (and the same again when
   replayed in the first worker, so no state leaks from one episode into the next); so does each random-action
   episode of check 5, played from its own seed in both workers (its actions reach code the fixed probe does not);
4. every step returns the contract types, with a finite reward inside ``[validation.reward_min, reward_max]``;
5. the episode ends within ``max_turns`` under a random-action policy and under a repeated-action policy;
6. throughout, every call stays within the sandbox's per-call deadline and output limit, and all the episodes together
   within ``validation.time_budget_s``;
7. optionally, a solvability check passed in by the caller (the rollout's: the policy plays each program with its
   hint, ``spade_mega.rollout.solvability``). It judges together every program of a ``validate_many`` call that
   passed checks 1 to 6, so an engine-backed check plays them all in one batch.

Episodes are played as far as training plays them: given the rollout's turn limit (``rollout.max_turns``), the
validator plays ``min(max_turns, rollout_turns)`` turns, the *horizon*. A program may declare more turns than the
rollout plays (up to ``validation.max_turns_limit``; the library's mazes do, as generous move budgets): the rollout
truncates its episodes at the horizon, so checks 3 to 6 cover exactly the turns training will run, and check 5 applies
only when the program's own ``max_turns`` is within it. Without ``rollout_turns`` the horizon is ``max_turns``.

The reason codes are an enum, so metrics can count rejections by cause.
"""

from __future__ import annotations

import hashlib
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Sequence

import msgpack

from spade_mega.config.schema import ValidationConfig
from spade_mega.envs.program import EnvProgram
from spade_mega.envs.sandbox import (ContractViolation, EnvHandle, LoadError, NonFiniteReward, OutputLimitExceeded,
                                     ProgramError, ProtocolError, SandboxCrash, SandboxError, SandboxPool,
                                     SandboxTimeout, StepResult)


class Reason(str, Enum):
    """Why a program was rejected: exactly one per rejected program."""

    SYNTAX = "syntax"
    LOAD_ERROR = "load_error"
    NO_ENV_CLASS = "no_env_class"
    MULTIPLE_ENV_CLASSES = "multiple_env_classes"
    BAD_MAX_TURNS = "bad_max_turns"
    RESET_NOT_STR = "reset_not_str"
    NONDETERMINISTIC_RESET = "nondeterministic_reset"
    NONDETERMINISTIC_EPISODE = "nondeterministic_episode"
    STEP_CONTRACT = "step_contract"
    REWARD_NOT_FINITE = "reward_not_finite"
    REWARD_OUT_OF_RANGE = "reward_out_of_range"
    EPISODE_TOO_LONG = "episode_too_long"
    PROGRAM_ERROR = "program_error"
    TIMEOUT = "timeout"
    TIME_BUDGET = "time_budget"
    OUTPUT_LIMIT = "output_limit"
    CRASH = "crash"
    PROTOCOL = "protocol"
    UNSOLVABLE = "unsolvable"


@dataclass
class SolvabilityVerdict:
    """The solvability check's judgement of one program. ``reason`` is the rejection when it is not solvable:
    ``unsolvable``, or the failure of a program that broke while being played (``timeout``, ``program_error``).
    ``cost`` says what judging it took (plays, tokens), for metrics; it lands in ``report.stats["solvability"]``,
    ``detail`` in ``report.stats["solvability_detail"]`` (and in ``report.detail`` when it is refused)."""

    solvable: bool
    detail: str
    reason: Reason = Reason.UNSOLVABLE
    cost: dict[str, float] = field(default_factory=dict)


SolvabilityCheck = Callable[[Sequence[EnvProgram]], Sequence[SolvabilityVerdict]]
"""``programs -> one verdict each, in order``: judges whether each program can be solved."""

PROBE_ACTIONS = ("1", "yes", "a", "up", "0", "42", "left", "no", "A B C", "7", "north", "")


@dataclass
class ValidationReport:
    """The verdict on one program. ``reason`` is None when it passed."""

    content_hash: str
    reason: Reason | None = None
    detail: str = ""
    output: str = ""  # what the program printed in the failing call (capped)
    class_name: str = ""
    max_turns: int = 0
    horizon: int = 0  # turns an episode lasts at most in training: min(max_turns, the rollout's max_turns)
    seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.reason is None

    def to_dict(self) -> dict[str, Any]:
        return {"content_hash": self.content_hash, "ok": self.ok, "reason": self.reason.value if self.reason else None,
                "detail": self.detail, "output": self.output, "class_name": self.class_name,
                "max_turns": self.max_turns, "horizon": self.horizon, "seconds": round(self.seconds, 4),
                "stats": self.stats}


class _Budget:
    """The wall-clock budget of one program's validation episodes (``validation.time_budget_s``)."""

    def __init__(self, seconds: float, horizon: int) -> None:
        self.seconds, self.horizon = seconds, horizon
        self.started = time.monotonic()

    def check(self, phase: str, turn: int) -> None:
        took = time.monotonic() - self.started
        if took > self.seconds:
            raise Rejected(Reason.TIME_BUDGET, f"the validation episodes took {took:.1f} s, over "
                                               f"validation.time_budget_s ({self.seconds:g} s); stopped at turn {turn} "
                                               f"of the {phase} episodes, of up to {self.horizon} turns each")


class Rejected(Exception):
    """Internal: stops validation at the first failed check."""

    def __init__(self, reason: Reason, detail: str, output: str = "") -> None:
        super().__init__(detail)
        self.reason, self.detail, self.output = reason, detail, output


def _reason_of(error: SandboxError, in_reset: bool) -> Reason:
    if isinstance(error, LoadError):
        return Reason(error.kind)
    if isinstance(error, NonFiniteReward):
        return Reason.REWARD_NOT_FINITE
    if isinstance(error, ContractViolation):
        return Reason.RESET_NOT_STR if in_reset else Reason.STEP_CONTRACT
    for error_type, reason in ((ProgramError, Reason.PROGRAM_ERROR), (SandboxTimeout, Reason.TIMEOUT),
                               (OutputLimitExceeded, Reason.OUTPUT_LIMIT), (SandboxCrash, Reason.CRASH),
                               (ProtocolError, Reason.PROTOCOL)):
        if isinstance(error, error_type):
            return reason
    raise TypeError(f"unmapped sandbox error {type(error).__name__}")


class Validator:
    """Validates programs in ``pool``'s workers. ``solvability`` is the optional last check; ``rollout_turns`` is the
    rollout's turn limit (``rollout.max_turns``), past which training never plays an episode."""

    def __init__(self, pool: SandboxPool, cfg: ValidationConfig | None = None,
                 solvability: SolvabilityCheck | None = None, rollout_turns: int | None = None) -> None:
        if rollout_turns is not None and not (type(rollout_turns) is int and rollout_turns >= 1):
            raise ValueError(f"rollout_turns must be an int >= 1 (rollout.max_turns), got {rollout_turns!r}")
        self.pool = pool
        self.rollout_turns = rollout_turns
        self.cfg = cfg or ValidationConfig()
        self.cfg.check()
        self.solvability = solvability

    def validate(self, program: EnvProgram) -> ValidationReport:
        return self.validate_many([program])[0]

    def validate_many(self, programs: Sequence[EnvProgram],
                      progress: Callable[[ValidationReport], None] | None = None, *,
                      solvability: bool = True) -> list[ValidationReport]:
        """Validate ``validation.concurrency`` programs at a time, then judge the ones that passed together with the
        solvability check (unless ``solvability`` is false: programs known to be solvable, such as the library's);
        reports come back in input order, each given to ``progress`` once final."""
        judge = self.solvability if solvability else None

        def one(program: EnvProgram) -> ValidationReport:
            report = self._sandbox_checks(program)
            if progress is not None and (judge is None or not report.ok):
                progress(report)
            return report

        with ThreadPoolExecutor(max_workers=self.cfg.concurrency, thread_name_prefix="spade-validate") as executor:
            reports = list(executor.map(one, programs))
        passed = [(program, report) for program, report in zip(programs, reports) if report.ok]
        if judge is not None and passed:
            started = time.perf_counter()
            verdicts = list(judge([program for program, _ in passed]))
            if len(verdicts) != len(passed):
                raise RuntimeError(f"the solvability check returned {len(verdicts)} verdicts for {len(passed)} "
                                   "programs")
            took = time.perf_counter() - started
            for (_, report), verdict in zip(passed, verdicts):
                report.stats["solvability"] = dict(verdict.cost)
                report.stats["solvability_detail"] = verdict.detail  # also why a solvable one passed
                report.seconds += took
                if not verdict.solvable:
                    report.reason, report.detail = verdict.reason, verdict.detail
                if progress is not None:
                    progress(report)
        return reports

    def _sandbox_checks(self, program: EnvProgram) -> ValidationReport:
        """Checks 1 to 6 of one program."""
        report = ValidationReport(program.content_hash)
        started = time.perf_counter()
        handles: list[EnvHandle] = []
        try:
            self._run(program, report, handles)
        except Rejected as rejected:
            report.reason, report.detail, report.output = rejected.reason, rejected.detail, rejected.output[:2000]
        finally:
            for handle in handles:
                handle.close()
            report.seconds = time.perf_counter() - started
        return report

    # -- the checks ---------------------------------------------------------------------------------------------

    def _run(self, program: EnvProgram, report: ValidationReport, handles: list[EnvHandle]) -> None:
        cfg = self.cfg
        for _ in range(2):  # two fresh workers: determinism across processes
            try:
                handles.append(self.pool.open(program))
            except SandboxError as error:
                raise Rejected(_reason_of(error, in_reset=False), error.detail, error.output) from None
        a, b = handles
        report.class_name, report.max_turns = a.class_name, a.max_turns
        if a.max_turns > cfg.max_turns_limit:
            raise Rejected(Reason.BAD_MAX_TURNS, f"{a.class_name}.max_turns is {a.max_turns}, over "
                                                 f"validation.max_turns_limit ({cfg.max_turns_limit})")
        if (b.class_name, b.max_turns) != (a.class_name, a.max_turns):  # each worker loads the module afresh
            raise Rejected(Reason.BAD_MAX_TURNS, f"{a.class_name}.max_turns is {a.max_turns} in one fresh worker and "
                                                 f"{b.class_name}.max_turns {b.max_turns} in the other fresh worker: "
                                                 "it must be the same constant whenever the module loads")
        horizon = report.horizon = min(a.max_turns, self.rollout_turns or a.max_turns)
        budget = _Budget(cfg.time_budget_s, horizon)
        probe = [PROBE_ACTIONS[i % len(PROBE_ACTIONS)] for i in range(horizon)]
        first = self._episodes([(a, cfg.seed), (b, cfg.seed)], lambda k, obs, turn: probe[turn], horizon, budget)
        if first[0][0] != first[1][0]:
            raise Rejected(Reason.NONDETERMINISTIC_RESET, f"reset({cfg.seed}) gave different observations in two "
                                                          f"fresh workers: {_clip(first[0][0])} vs {_clip(first[1][0])}")
        if first[0][1] != first[1][1]:
            raise Rejected(Reason.NONDETERMINISTIC_EPISODE, f"the fixed action sequence from seed {cfg.seed} gave "
                                                            "different episodes in two fresh workers")
        (replay,) = self._episodes([(a, cfg.seed)], lambda k, obs, turn: probe[turn], horizon, budget)
        if replay[:2] != first[0][:2]:
            raise Rejected(Reason.NONDETERMINISTIC_EPISODE, f"replaying seed {cfg.seed} in the same worker gave a "
                                                            "different episode: state leaks between episodes")
        lengths = []
        for k in range(cfg.random_episodes):  # each in both workers: actions an agent would try reach more code
            seed, rngs = cfg.seed + 1 + k, [random.Random(f"{cfg.seed}:{k}") for _ in handles]
            played = self._episodes([(a, seed), (b, seed)], lambda j, obs, turn: _random_action(rngs[j], obs),
                                    horizon, budget, policy_name="random")
            if played[0][0] != played[1][0]:
                raise Rejected(Reason.NONDETERMINISTIC_RESET, f"reset({seed}) gave different observations in the "
                                                              f"two workers: {_clip(played[0][0])} vs "
                                                              f"{_clip(played[1][0])}")
            if played[0][1] != played[1][1]:
                raise Rejected(Reason.NONDETERMINISTIC_EPISODE, f"the random-action episode from seed {seed} went "
                                                                "differently in the two workers (randomness not "
                                                                "drawn from the seed, or state leaking between "
                                                                "episodes)")
            lengths.append(played[0][2])
        repeated = self._episodes([(a, cfg.seed), (b, cfg.seed + 1)],
                                  lambda k, obs, turn: (PROBE_ACTIONS[0], "")[k], horizon, budget,
                                  policy_name="repeated-action")
        report.stats = {"fixed_turns": first[0][2], "random_turns": lengths,
                        "repeated_turns": [turns for _, _, turns in repeated]}

    def _episodes(self, starts: list[tuple[EnvHandle, int]], policy: Callable[[int, str, int], str], horizon: int,
                  budget: _Budget, policy_name: str = "") -> list[tuple[str, str, int]]:
        """Play one episode per ``(handle, seed)`` concurrently, for at most ``horizon`` turns; returns (first
        observation, digest, turns) each.

        With a ``policy`` name the episode must end within max_turns when that is the horizon; without one (the fixed
        probe sequence), or when the rollout truncates first, it stops at the horizon either way. ``budget`` is
        checked after every call.
        """
        phase = policy_name or "fixed-sequence"
        observations = self.pool.reset_many(starts)
        for obs in observations:
            if isinstance(obs, SandboxError):
                raise Rejected(_reason_of(obs, in_reset=True), f"reset: {obs.detail}", obs.output)
        budget.check(phase, 0)
        digests = [hashlib.sha256(msgpack.packb(obs)) for obs in observations]
        last = list(observations)
        turns = [0] * len(starts)
        live = list(range(len(starts)))
        while live:
            batch = [(starts[k][0], policy(k, last[k], turns[k])) for k in live]
            results = self.pool.step_many(batch)
            still = []
            for k, (handle, action), result in zip(live, batch, results):
                self._check_step(result, turns[k], action)
                turns[k] += 1
                digests[k].update(msgpack.packb(list(result)))
                last[k] = result.observation
                if result.terminated or result.truncated:
                    continue
                if turns[k] >= horizon:
                    if policy_name and horizon == handle.max_turns:
                        raise Rejected(Reason.EPISODE_TOO_LONG, f"under a {policy_name} policy the episode did not "
                                                                f"end within max_turns ({handle.max_turns})")
                    continue
                still.append(k)
            live = still
            budget.check(phase, max(turns))
        return [(obs, digest.hexdigest(), n) for obs, digest, n in zip(observations, digests, turns)]

    def _check_step(self, result: StepResult | SandboxError, turn: int, action: str) -> None:
        where = f"step {turn + 1} (action {action!r})"
        if isinstance(result, SandboxError):
            raise Rejected(_reason_of(result, in_reset=False), f"{where}: {result.detail}", result.output)
        if not self.cfg.reward_min <= result.reward <= self.cfg.reward_max:
            raise Rejected(Reason.REWARD_OUT_OF_RANGE, f"{where}: reward {result.reward} is outside "
                                                       f"[{self.cfg.reward_min}, {self.cfg.reward_max}]")


_WORD = re.compile(r"[A-Za-z0-9_\-]+")


def _random_action(rng: random.Random, observation: str) -> str:
    """A random action: a word of the observation, a number, a probe word, or junk."""
    roll = rng.random()
    words = _WORD.findall(observation)
    if roll < 0.4 and words:
        return rng.choice(words)
    if roll < 0.6:
        return str(rng.randint(-10, 100))
    if roll < 0.8:
        return rng.choice(PROBE_ACTIONS)
    return "".join(rng.choice("abcxyz 0123,.") for _ in range(rng.randint(0, 12)))


def _clip(text: str, n: int = 80) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")
