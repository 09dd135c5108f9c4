"""SPADE rewards: the agent's episode reward and the designer's reward, in every variant the paper ablates.

Plain floats, no tensors: these run once per episode or per environment, and their exact values are tested by hand.
The designer reward here is *raw*; per-skill mean-centring and ``env_reward_scale`` are applied where the designer's
advantages are built (:func:`spade_mega.rl.advantages.designer_advantages`), so there is one centring mechanism.

Variants (``rewards.variant``), all computed from the plays of one environment over its delay window:

- ``blend`` (deployed): ``plateau_weight * plateau(win_rate) + regret_weight * clip(regret / regret_scale, 0, 1)``.
- ``regret``: hint-based regret ``R_hint - R_no_hint``, negative values floored to 0.
- ``learning_potential``: distance of the environment's win rate from its skill's slow-EMA baseline.
- ``micro_lp``: the agent's improvement over the window, a weighted least-squares slope (floored at 0).
- ``learnability``: AZR's ``1 - solve_rate`` for solve rates strictly between 0 and 1, else 0.

Regret is always measured at *matched timing*: hint plays and no-hint plays both at the regeneration step (window
offset 0), so the agent's improvement during the window does not leak into it.

One definition of a win serves every rate: an episode is *won* when its reward (:func:`episode_reward`) is at least
``rewards.win_threshold``, and a *win rate* is the fraction of episodes won (:func:`win_rate`). The plateau, the
learning-potential EMAs, micro learning potential, learnability, the memory's outcome classes, the validator's
solvability check and the ``*/win_rate`` metrics all read it. Regret stays a difference of *mean returns* (hint minus
no hint, as SPADE defines it), so shaped rewards still count there. With 0/1 rewards (the reference's games) and a
threshold in (0, 1], the win rate equals the mean return, so the reference's numbers are unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Sequence

from spade_mega.config.schema import RewardsConfig
from spade_mega.envs.episode import episode_return  # the one sum of step rewards (the episode runner's too)
from spade_mega.errors import SpadeError

Failure = Literal["invalid_program", "step_timeout"]
FAILURES: tuple[str, ...] = ("invalid_program", "step_timeout")


class StateError(SpadeError, ValueError):
    """A saved reward state (trackers, delayed designer buffer) that cannot be restored; nothing was changed."""


def _check_finite(values: Sequence[float], what: str) -> None:
    for v in values:
        if not math.isfinite(v):
            raise ValueError(f"{what} must be finite floats, got {v!r}")


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


# --- the agent -----------------------------------------------------------------------------------------------------


def episode_reward(step_rewards: Sequence[float], terminated: bool, cfg: RewardsConfig) -> float:
    """The agent's reward for one episode: its return (sum of step rewards) clipped to the configured range.

    An episode that did not terminate (cut by the turn budget) earns 0 under ``truncated_episode: zero``, the
    reference behaviour, so running out of turns is never better than failing.
    """
    if not terminated and cfg.truncated_episode == "zero":
        _check_finite(step_rewards, "step rewards")
        return 0.0
    return min(cfg.agent_reward_max, max(cfg.agent_reward_min, episode_return(step_rewards)))


def won(reward: float, cfg: RewardsConfig) -> bool:
    """Whether an episode with this reward is a win (``reward >= rewards.win_threshold``)."""
    return reward >= cfg.win_threshold


def win_rate(rewards: Sequence[float], cfg: RewardsConfig) -> float:
    """The fraction of ``rewards`` (episode rewards) that are wins; 0 for no episodes."""
    return sum(won(r, cfg) for r in rewards) / len(rewards) if rewards else 0.0


# --- designer signals ----------------------------------------------------------------------------------------------


def plateau(win_rate: float, lo: float, hi: float, ramp: float) -> float:
    """Flat-top difficulty anchor: 1 inside [lo, hi], falling linearly to 0 over ``ramp`` on either side."""
    if win_rate < lo:
        return max(0.0, 1.0 - (lo - win_rate) / ramp)
    if win_rate > hi:
        return max(0.0, 1.0 - (win_rate - hi) / ramp)
    return 1.0


def normalized_regret(regret: float, scale: float, floor: bool) -> float:
    """Regret over a fixed nominal scale, capped at 1 and (with ``floor``) floored at 0.

    A fixed scale, not a per-batch std: a small batch's std blows up and would confound the blend weights.
    """
    value = min(1.0, regret / scale)
    return max(0.0, value) if floor else value


def blend(win_rate: float, regret: float, cfg: RewardsConfig) -> float:
    """The deployed designer reward (before masking, centring and scaling)."""
    return (cfg.plateau_weight * plateau(win_rate, cfg.plateau_lo, cfg.plateau_hi, cfg.plateau_ramp)
            + cfg.regret_weight * normalized_regret(regret, cfg.regret_scale, cfg.regret_floor))


def wls_slope(xs: Sequence[float], ys: Sequence[float], weights: Sequence[float]) -> float:
    """Weighted least-squares slope of ``ys`` on ``xs``; 0 when fewer than two distinct ``xs`` carry weight."""
    if not (len(xs) == len(ys) == len(weights)):
        raise ValueError(f"xs, ys and weights differ in length: {len(xs)}, {len(ys)}, {len(weights)}")
    total = math.fsum(weights)
    if total <= 0:
        return 0.0
    x_bar = math.fsum(w * x for w, x in zip(weights, xs)) / total
    y_bar = math.fsum(w * y for w, y in zip(weights, ys)) / total
    sxx = math.fsum(w * (x - x_bar) ** 2 for w, x in zip(weights, xs))
    if sxx <= 0:
        return 0.0
    return math.fsum(w * (x - x_bar) * (y - y_bar) for w, x, y in zip(weights, xs, ys)) / sxx


def micro_learning_potential(wins_by_offset: Mapping[int, Sequence[float]]) -> float:
    """The agent's improvement on one environment over the delay window, as fitted end minus fitted start.

    ``wins_by_offset`` holds each play's outcome (1.0 won, 0.0 not) per step offset. Fits the per-step win rate
    against the step offset by weighted least squares, each step weighted by its number of plays (the variance of a
    step's rate is proportional to 1 / plays), and multiplies the slope by the window's span, so the value reads as a
    win-rate change. Every step contributes, unlike a late-minus-early split.
    """
    offsets = sorted(o for o, r in wins_by_offset.items() if r)
    if len(offsets) < 2:
        return 0.0
    ys = [_mean(wins_by_offset[o]) for o in offsets]
    ws = [float(len(wins_by_offset[o])) for o in offsets]
    return wls_slope([float(o) for o in offsets], ys, ws) * (offsets[-1] - offsets[0])


def learnability(solve_rate: float) -> float:
    """Absolute-Zero-style learnability: ``1 - solve_rate``, but 0 for environments never or always solved."""
    if solve_rate <= 0.0 or solve_rate >= 1.0:
        return 0.0
    return 1.0 - solve_rate


def env_reward_scale(n_agent: int, n_designer: int, regen_interval: int, cap: float) -> float:
    """``min(n_agent / n_designer * regen_interval, cap)``: puts the rare designer samples on the agent's footing.

    The designer gets one sample per environment and one update per ``regen_interval`` steps, while the agent gets
    many trajectories every step; without this factor the designer's share of the gradient would vanish. With no
    designer or no agent samples there is nothing to balance: 1.0, as in the reference.
    """
    if n_agent < 0 or n_designer < 0 or regen_interval <= 0:
        raise ValueError(f"env_reward_scale needs n_agent >= 0, n_designer >= 0 and regen_interval > 0, "
                         f"got {n_agent}, {n_designer}, {regen_interval}")
    if n_agent == 0 or n_designer == 0:
        return 1.0
    return min(n_agent / n_designer * regen_interval, cap)


# --- the EMA learning-potential tracker ----------------------------------------------------------------------------


@dataclass
class LearningPotentialTracker:
    """Fast and slow EMAs of one signal (a skill's agent win rate); their gap measures learning in progress.

    ``fast`` and ``slow`` are the weights of the *newest* value (reference: 0.99 and 0.95), so the fast EMA follows
    the signal closely and the slow one lags; ``potential = |mu_fast - mu_slow| / (2 * (fast - slow))``.
    """

    fast: float = 0.99
    slow: float = 0.95
    mu_fast: Optional[float] = None
    mu_slow: Optional[float] = None
    updates: int = 0

    def update(self, value: float) -> float:
        """Fold in one value and return the new potential. The first value initialises both EMAs."""
        _check_finite([value], "learning-potential updates")
        if self.mu_fast is None or self.mu_slow is None:
            self.mu_fast = self.mu_slow = float(value)
        else:
            self.mu_fast = (1.0 - self.fast) * self.mu_fast + self.fast * value
            self.mu_slow = (1.0 - self.slow) * self.mu_slow + self.slow * value
        self.updates += 1
        return self.potential

    @property
    def signed_potential(self) -> float:
        if self.mu_fast is None or self.mu_slow is None:
            return 0.0
        return (self.mu_fast - self.mu_slow) / (2.0 * (self.fast - self.slow))

    @property
    def potential(self) -> float:
        return abs(self.signed_potential)

    @property
    def baseline(self) -> Optional[float]:
        """The slow EMA: where this signal has been sitting; None before the first update."""
        return self.mu_slow


@dataclass
class SkillTrackers:
    """One :class:`LearningPotentialTracker` per skill, fed once per step with the skill's agent win rate."""

    fast: float = 0.99
    slow: float = 0.95
    trackers: dict[str, LearningPotentialTracker] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: RewardsConfig) -> "SkillTrackers":
        return cls(fast=cfg.ema_fast, slow=cfg.ema_slow)

    def update(self, skill: str, value: float) -> float:
        tracker = self.trackers.setdefault(skill, LearningPotentialTracker(self.fast, self.slow))
        return tracker.update(value)

    def baseline(self, skill: str) -> Optional[float]:
        tracker = self.trackers.get(skill)
        return tracker.baseline if tracker is not None else None

    def potential(self, skill: str) -> float:
        tracker = self.trackers.get(skill)
        return tracker.potential if tracker is not None else 0.0

    def state_dict(self) -> dict[str, Any]:
        """JSON- and msgpack-ready state (floats round-trip exactly through both)."""
        return {"skills": {skill: {"mu_fast": t.mu_fast, "mu_slow": t.mu_slow, "updates": t.updates}
                           for skill, t in self.trackers.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the EMAs; the EMA weights come from the current config, so a resumed run may change them."""
        try:
            skills = state["skills"]
            trackers = {str(skill): LearningPotentialTracker(
                self.fast, self.slow,
                mu_fast=None if s["mu_fast"] is None else float(s["mu_fast"]),
                mu_slow=None if s["mu_slow"] is None else float(s["mu_slow"]),
                updates=int(s["updates"])) for skill, s in skills.items()}
            for skill, t in trackers.items():
                # a NaN EMA would make every later designer reward of the skill NaN; half a pair is no state
                if (t.mu_fast is None) != (t.mu_slow is None) or t.updates < 0 or not all(
                        math.isfinite(mu) for mu in (t.mu_fast, t.mu_slow) if mu is not None):
                    raise ValueError(f"skill {skill!r} has mu_fast={t.mu_fast}, mu_slow={t.mu_slow}, "
                                     f"updates={t.updates} (finite EMAs, both or neither, updates >= 0)")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StateError(f"skill tracker state is malformed ({type(exc).__name__}: {exc}); "
                             "expected {'skills': {skill: {'mu_fast', 'mu_slow', 'updates'}}}") from None
        self.trackers = trackers


# --- the designer reward -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DesignerReward:
    """The raw designer reward of one environment and why it was (not) used.

    ``mask_reason`` is set when the sample must be left out of the designer update: ``"no_plays"`` (nothing measured,
    so there is no signal to pay) or ``"negative"`` (a negative signal with ``regret_floor: false``, which per-skill
    centring would otherwise turn into a positive advantage for unsolvable environments). ``components`` records the
    measured quantities (win rate, regret, plateau, ...) for logging and the environment memory.
    """

    value: float
    mask_reason: Optional[str] = None
    components: dict[str, float] = field(default_factory=dict)

    @property
    def masked(self) -> bool:
        return self.mask_reason is not None


def designer_reward(
    cfg: RewardsConfig,
    agent_returns: Mapping[int, Sequence[float]],
    hint_returns: Sequence[float] = (),
    *,
    skill_baseline: Optional[float] = None,
    failure: Optional[Failure] = None,
) -> DesignerReward:
    """The raw reward of one designer output under ``cfg.variant``.

    ``agent_returns`` maps a window offset (0 = the regeneration step) to the agent's no-hint episode rewards at that
    step; ``hint_returns`` are the hint plays at offset 0. ``skill_baseline`` (learning_potential variant) is the slow
    EMA of the skill's win rate. Every rate here is a :func:`win_rate`; regret is a difference of mean returns. A
    ``failure`` replaces everything with its bounded penalty, which is never masked: the designer must learn that
    broken programs cost more than working ones.
    """
    if failure is not None:
        if failure not in FAILURES:
            raise ValueError(f"failure must be one of {FAILURES}, got {failure!r}")
        penalty = cfg.invalid_program_penalty if failure == "invalid_program" else cfg.step_timeout_penalty
        return DesignerReward(penalty, None, {"penalty": penalty})
    for offset, returns in agent_returns.items():
        _check_finite(returns, f"agent returns at offset {offset}")
    _check_finite(hint_returns, "hint returns")

    window = [r for o in sorted(agent_returns) for r in agent_returns[o]]
    if not window:
        return DesignerReward(0.0, "no_plays")
    rate = win_rate(window, cfg)
    parts: dict[str, float] = {"win_rate": rate, "return": _mean(window)}

    if cfg.variant in ("blend", "regret"):
        at_regen = agent_returns.get(0, ())
        if at_regen and hint_returns:
            parts["regret"] = _mean(hint_returns) - _mean(at_regen)
        elif cfg.variant == "regret" or cfg.regret_weight > 0:
            return DesignerReward(0.0, "no_plays", parts)
        # else a plateau-only blend (regret_weight 0, which the config lets run without hint plays)
        regret = parts.get("regret", 0.0)
        if cfg.variant == "blend":
            parts["plateau"] = plateau(rate, cfg.plateau_lo, cfg.plateau_hi, cfg.plateau_ramp)
            if "regret" in parts:
                parts["regret_norm"] = normalized_regret(regret, cfg.regret_scale, cfg.regret_floor)
            value = blend(rate, regret, cfg)
        else:
            value = max(0.0, regret) if cfg.regret_floor else regret
    elif cfg.variant == "learning_potential":
        if skill_baseline is None:
            raise ValueError("the learning_potential variant needs the skill's baseline; update the SkillTrackers "
                             "with the skill's agent win rate every step before releasing designer samples")
        parts["baseline"] = skill_baseline
        value = abs(rate - skill_baseline)
    elif cfg.variant == "micro_lp":
        parts["micro_lp"] = micro_learning_potential(
            {o: [float(won(r, cfg)) for r in returns] for o, returns in agent_returns.items()})
        value = max(0.0, parts["micro_lp"])
    else:  # learnability: the solve rate is the win rate
        value = learnability(rate)

    if value < 0.0:
        return DesignerReward(value, "negative", parts)
    return DesignerReward(value, None, parts)
