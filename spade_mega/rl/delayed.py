"""The delayed designer buffer: designer samples wait until their environment has been played, then are paid.

A designer output generated at step ``s`` is trained at step ``s + designer_delay``, once its environment has been
played at steps ``s .. s + delay - 1`` (the window; at least step ``s``). By then the policy has moved on, so the
sample keeps the behaviour log-probs and policy version it was generated with, for truncated importance sampling.

The buffer holds everything as plain data (ids, ints, floats, strings), and ``state_dict()`` is JSON- and
msgpack-ready, never pickle: a resumed run releases exactly what the uninterrupted run would have. (The reference
implementation keeps these samples in process globals and loses them on resume.)

Each sample keeps the delay it was added under: a run resumed with another ``designer_delay`` pays the samples
already waiting on the window they were generated for (the plays they have collected are the ones it asked for, so
they get the reward the uninterrupted run would have given them), and the new delay applies from the next designer
samples on. The saved state records every waiting sample's delay.

Per step, in this order: ``add`` the new designer samples (regeneration steps), ``record_plays`` for every pending
environment that was played (agent no-hint plays; hint plays at the regeneration step), ``mark_failed`` for an
environment whose ``step()`` timed out, then ``release(step)``. ``release`` removes what it returns, so save
``state_dict()`` only between steps, with the model and optimizer of the same step: a state saved after ``release``
but before the step that trains those samples has finished would resume without them.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from spade_mega.config.schema import RewardsConfig
from spade_mega.curriculum.rewards import (
    FAILURES,
    DesignerReward,
    Failure,
    SkillTrackers,
    StateError,
    designer_reward,
)

STATE_FORMAT = "spade-mega.delayed-designer-buffer"
STATE_VERSION = 2  # 2: each waiting sample's delay (version 1 states are read with the buffer's delay)
ROLES = ("agent", "hint")
log = logging.getLogger("spade_mega.rl")


@dataclass
class DesignerSample:
    """One designer output waiting for its reward.

    ``token_ids`` is the whole sequence (prompt and output); ``loss_mask`` is 1 on the designer's own output tokens;
    ``behaviour_logprobs`` are the sampling policy's log-probs, aligned with ``token_ids`` (0 outside the mask).
    ``step`` is the training step that generated it (its regeneration step), ``policy_version`` the weights that did.
    ``failure`` (``"invalid_program"`` or ``"step_timeout"``) replaces its reward with the bounded penalty.
    """

    sample_id: str
    env_id: str
    skill: str
    step: int
    policy_version: int
    token_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    failure: Optional[Failure] = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        """Raise ValueError naming the first inconsistent field (before the buffer changes anything)."""
        for name in ("sample_id", "env_id", "skill"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"designer sample {self.sample_id!r}: {name} must be a non-empty string")
        for name in ("step", "policy_version"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"designer sample {self.sample_id!r}: {name} must be an int >= 0, got {value!r}")
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.behaviour_logprobs) != n:
            raise ValueError(f"designer sample {self.sample_id!r}: token_ids, loss_mask and behaviour_logprobs "
                             f"differ in length ({n}, {len(self.loss_mask)}, {len(self.behaviour_logprobs)})")
        if any(m not in (0, 1) for m in self.loss_mask) or not any(self.loss_mask):
            raise ValueError(f"designer sample {self.sample_id!r}: loss_mask must be 0/1 with at least one 1")
        if not all(math.isfinite(lp) for lp, m in zip(self.behaviour_logprobs, self.loss_mask) if m):
            raise ValueError(f"designer sample {self.sample_id!r}: behaviour_logprobs must be finite on loss tokens")
        if self.failure is not None and self.failure not in FAILURES:
            raise ValueError(f"designer sample {self.sample_id!r}: failure must be one of {FAILURES} or None, "
                             f"got {self.failure!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"sample_id": self.sample_id, "env_id": self.env_id, "skill": self.skill, "step": self.step,
                "policy_version": self.policy_version, "token_ids": list(self.token_ids),
                "loss_mask": list(self.loss_mask), "behaviour_logprobs": list(self.behaviour_logprobs),
                "failure": self.failure, "metadata": dict(self.metadata)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DesignerSample":
        """The one parse of a sample, for :meth:`DelayedDesignerBuffer.add` and a restored state alike: plain ints
        and floats (numpy scalars converted, nothing truncated or guessed), metadata as JSON data."""
        sid = data["sample_id"]
        sample = cls(sample_id=sid, env_id=data["env_id"], skill=data["skill"], step=data["step"],
                     policy_version=data["policy_version"], token_ids=_integers(data["token_ids"], "token_ids", sid),
                     loss_mask=_integers(data["loss_mask"], "loss_mask", sid),
                     behaviour_logprobs=_reals(data["behaviour_logprobs"], "behaviour_logprobs", sid),
                     failure=data.get("failure"), metadata=_json_data(data.get("metadata") or {}, sid))
        sample.check()
        return sample


def _integers(values: Sequence[Any], name: str, sample_id: Any) -> list[int]:
    out = []
    for i, v in enumerate(values):
        try:
            out.append(operator.index(v))  # numpy and torch integers too; never a float or string
        except TypeError:
            raise ValueError(f"designer sample {sample_id!r}: {name} must be integers, got {v!r} at position {i}") \
                from None
    return out


def _reals(values: Sequence[Any], name: str, sample_id: Any) -> list[float]:
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(f"designer sample {sample_id!r}: {name} must be numbers (0.0 outside the loss mask), "
                             f"got {v!r} at position {i}")
    return [float(v) for v in values]


def _json_data(metadata: Any, sample_id: Any) -> dict[str, Any]:
    """A JSON copy of ``metadata``: what a checkpoint writes is what a resumed run reads back."""
    try:
        if not isinstance(metadata, Mapping):
            raise TypeError(f"not a mapping: {type(metadata).__name__}")
        return json.loads(json.dumps(metadata, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"designer sample {sample_id!r}: metadata must be JSON data (str keys, finite numbers, "
                         f"strings, lists, dicts): {exc}") from None


@dataclass(frozen=True)
class ReleasedDesignerSample:
    """A designer sample whose delay expired, with its raw reward (per-skill centring happens in the advantages)."""

    sample: DesignerSample
    reward: DesignerReward


class DelayedDesignerBuffer:
    """Designer samples keyed by environment, waiting ``delay`` steps of play before they are paid and trained."""

    def __init__(self, cfg: RewardsConfig, delay: int) -> None:
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay}")
        self.cfg = cfg
        self.delay = delay
        self._pending: list[DesignerSample] = []
        self._delays: dict[str, int] = {}  # sample_id -> the delay it was added under
        self._plays: dict[str, dict[str, dict[int, list[float]]]] = {}  # env -> role -> absolute step -> returns

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, env_id: object) -> bool:
        return env_id in self._plays

    def add(self, sample: DesignerSample) -> None:
        """Keep a copy of ``sample`` parsed as a restored state is, so whatever is added saves and resumes exactly
        (a value a checkpoint could not write or read back is refused here, by name, not at resume)."""
        sample = DesignerSample.from_dict(sample.to_dict())
        if any(p.sample_id == sample.sample_id for p in self._pending):
            raise ValueError(f"designer sample {sample.sample_id!r} is already waiting in the buffer")
        self._pending.append(sample)
        self._delays[sample.sample_id] = self.delay
        self._plays.setdefault(sample.env_id, {role: {} for role in ROLES})

    def record_plays(self, env_id: str, step: int, returns: Sequence[float], *, hinted: bool = False) -> None:
        """Add episode rewards of ``env_id`` played at ``step``: agent (no-hint) plays, or hint plays (``hinted``)."""
        if env_id not in self._plays:
            raise ValueError(f"no designer sample is waiting for environment {env_id!r}; record plays only for "
                             "environments in the buffer (check `env_id in buffer`)")
        values = [float(r) for r in returns]
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"returns of environment {env_id!r} at step {step} must be finite, got {values}")
        self._plays[env_id]["hint" if hinted else "agent"].setdefault(int(step), []).extend(values)

    def mark_failed(self, env_id: str, failure: Failure) -> None:
        """Give every waiting sample of ``env_id`` the penalty of ``failure`` (e.g. its ``step()`` timed out)."""
        if failure not in FAILURES:
            raise ValueError(f"failure must be one of {FAILURES}, got {failure!r}")
        if env_id not in self._plays:
            raise ValueError(f"no designer sample is waiting for environment {env_id!r}")
        for sample in self._pending:
            if sample.env_id == env_id:
                sample.failure = failure

    def release(self, step: int, trackers: Optional[SkillTrackers] = None) -> list[ReleasedDesignerSample]:
        """Remove and return, in arrival order, the samples whose delay has expired at ``step``, with their reward.

        ``trackers`` (the per-skill learning-potential EMAs) are read by the ``learning_potential`` variant only.
        """
        due = [s for s in self._pending if s.step + self._delays[s.sample_id] <= step]
        released = [ReleasedDesignerSample(s, self._reward(s, trackers)) for s in due]
        self._pending = [s for s in self._pending if s.step + self._delays[s.sample_id] > step]
        self._delays = {s.sample_id: self._delays[s.sample_id] for s in self._pending}
        waiting = {s.env_id for s in self._pending}
        self._plays = {env: plays for env, plays in self._plays.items() if env in waiting}
        return released

    def _reward(self, sample: DesignerSample, trackers: Optional[SkillTrackers]) -> DesignerReward:
        plays = self._plays[sample.env_id]
        window = range(sample.step, sample.step + max(self._delays[sample.sample_id], 1))
        agent = {t - sample.step: plays["agent"][t] for t in window if plays["agent"].get(t)}
        baseline = None
        if self.cfg.variant == "learning_potential" and sample.failure is None:
            if trackers is None:
                raise ValueError("rewards.variant 'learning_potential' needs the SkillTrackers passed to release()")
            baseline = trackers.baseline(sample.skill)
        return designer_reward(self.cfg, agent, plays["hint"].get(sample.step, []),
                               skill_baseline=baseline, failure=sample.failure)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, as JSON/msgpack-ready data (lists, dicts with str keys, ints, floats)."""
        plays = [[env, role, step, list(returns)]
                 for env, by_role in self._plays.items() for role in ROLES
                 for step, returns in by_role[role].items()]
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "delay": self.delay,
                "pending": [s.to_dict() for s in self._pending], "plays": plays,
                "delays": [self._delays[s.sample_id] for s in self._pending]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a saved buffer; a malformed state raises :class:`StateError` and leaves this buffer unchanged."""
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise StateError(f"not a delayed designer buffer state (expected format {STATE_FORMAT!r})")
        if state.get("version") not in (1, STATE_VERSION):
            raise StateError(f"delayed designer buffer state version {state.get('version')!r} is not supported "
                             f"(this spade-mega reads versions 1 and {STATE_VERSION})")
        try:
            pending = [DesignerSample.from_dict(d) for d in state["pending"]]
            delays = list(state["delays"]) if state["version"] == STATE_VERSION else [self.delay] * len(pending)
            if len(delays) != len(pending) or not all(type(d) is int and d >= 0 for d in delays):
                raise ValueError(f"delays must be one int >= 0 per waiting sample, got {delays!r}")
            plays: dict[str, dict[str, dict[int, list[float]]]] = {s.env_id: {r: {} for r in ROLES} for s in pending}
            for env, role, step, returns in state["plays"]:
                if env not in plays or role not in ROLES:
                    raise ValueError(f"plays recorded for {env!r}/{role!r}, which has no waiting sample")
                values = [float(r) for r in returns]
                if not all(math.isfinite(v) for v in values):
                    raise ValueError(f"non-finite returns for environment {env!r} at step {step}")
                plays[env][role][int(step)] = values
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(f"delayed designer buffer state is malformed: {type(exc).__name__}: {exc}") from None
        if len({s.sample_id for s in pending}) != len(pending):
            raise StateError("delayed designer buffer state holds the same sample_id twice")
        self._pending, self._plays = pending, plays
        self._delays = {s.sample_id: d for s, d in zip(pending, delays)}
        other = sorted({d for d in delays if d != self.delay})
        if other:
            log.warning("delayed designer buffer: %d designer sample(s) saved under designer_delay %s keep it (their "
                        "window of plays); this run's designer_delay %d applies to the samples it generates",
                        sum(d != self.delay for d in delays), "/".join(map(str, other)), self.delay)
