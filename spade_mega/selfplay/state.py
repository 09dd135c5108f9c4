"""The self-play loop's own state, saved beside each trainer checkpoint so that a resumed run continues exactly.

A checkpoint of the loop is two things written for the same trainer step N: the trainer's folder
``checkpoints/step_<N>`` (model, optimizer, learning-rate schedule; atomic, see megatron/checkpoint.py) and the loop
state ``checkpoints/selfplay/step_<N>.json`` (rollouts done, the environment set being played, the delayed designer
buffer, the skill schedule, the learning-potential trackers). The loop state is written first, atomically (temporary
file, fsync, rename), so a complete trainer checkpoint always has its loop state; a loop state without its trainer
checkpoint (a save killed in between) is ignored and replaced by the next save.

Everything is JSON: plain data a user can read, never a pickle. There are no random-number-generator states to
save: every random choice of the loop (play seeds, sampling seeds, library fill-ins, batch order) is derived from
``run.seed`` and the rollout index (:func:`derive_seed`), and the grounding sampler is stateless the same way.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

from spade_mega.envs.program import EnvProgram
from spade_mega.errors import SpadeError
from spade_mega.files import replace_atomically
from spade_mega.megatron.checkpoint import find_latest, is_complete

STATE_FORMAT = "spade-mega.selfplay-state"
STATE_VERSION = 1
STATE_DIR = "selfplay"
CHECKPOINT_DIR = "checkpoints"
Origin = Literal["designer", "library", "fixed"]


class ResumeError(SpadeError):
    """A run that cannot start or resume as asked (run.resume), or a loop state that cannot be read back."""


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed for one random choice, from the run's seed and where it is made (``"play", rollout, env, k``):
    the same on every run and after a resume, independent of how many other choices came before."""
    digest = hashlib.sha256(repr((int(seed),) + parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@dataclass(frozen=True)
class ActiveEnv:
    """One environment of the set the agent plays until the next regeneration.

    ``origin`` "designer": written by the designer at ``iteration`` and paid through the delayed buffer; "library":
    a reference program that filled a slot the designer left empty (``selfplay.library_fallback``), never paying a
    designer; "fixed": one of ``selfplay.environments`` (agent-only training, the designer off). ``env_id`` is the
    program's content hash (the memory's and the buffer's key)."""

    program: EnvProgram
    origin: Origin
    slot: int
    iteration: int

    @property
    def env_id(self) -> str:
        return self.program.content_hash

    @property
    def skill(self) -> str:
        return self.program.skill

    def to_dict(self) -> dict[str, Any]:
        return {"program": self.program.to_dict(), "origin": self.origin, "slot": self.slot,
                "iteration": self.iteration}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ActiveEnv":
        program = EnvProgram.from_dict(dict(data["program"]))
        if data["program"].get("content_hash") not in (None, program.content_hash):
            raise ValueError(f"environment in slot {data.get('slot')!r}: its content hash does not match its "
                             "source, hint and skill (edited by hand?)")
        if data["origin"] not in ("designer", "library", "fixed"):
            raise ValueError(f"environment origin must be 'designer', 'library' or 'fixed', got {data['origin']!r}")
        return cls(program, data["origin"], int(data["slot"]), int(data["iteration"]))


@dataclass
class LoopState:
    """What the loop needs, besides the trainer's checkpoint and the memory database, to continue a run."""

    rollout: int = 0  # rollouts completed
    policy_version: int = 0  # the trainer step whose weights the engine serves
    active_skills: list[str] = field(default_factory=list)
    environments: list[ActiveEnv] = field(default_factory=list)
    buffer: dict[str, Any] = field(default_factory=dict)  # DelayedDesignerBuffer.state_dict()
    scheduler: dict[str, Any] = field(default_factory=dict)  # SkillScheduler.state_dict()
    trackers: dict[str, Any] = field(default_factory=dict)  # SkillTrackers.state_dict()
    regen_interval: Optional[int] = None  # selfplay.regen_interval of the run that saved it (None: not recorded)
    # the step folder a checkpoint root named in rl.reference resolved to at the run's start (None: none named, or
    # not recorded): a resume reads the same reference even when that root has newer checkpoints by then
    reference: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "rollout": self.rollout,
                "regen_interval": self.regen_interval, "reference": self.reference,
                "policy_version": self.policy_version, "active_skills": list(self.active_skills),
                "environments": [e.to_dict() for e in self.environments], "buffer": self.buffer,
                "scheduler": self.scheduler, "trackers": self.trackers}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "LoopState":
        if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
            raise ResumeError(f"{where}: not a self-play loop state (expected format {STATE_FORMAT!r})")
        if data.get("version") != STATE_VERSION:
            raise ResumeError(f"{where}: loop state version {data.get('version')!r}; this spade-mega reads "
                              f"version {STATE_VERSION}")
        try:
            state = cls(rollout=_count(data["rollout"], "rollout"),
                        policy_version=_count(data["policy_version"], "policy_version"),
                        active_skills=[str(s) for s in data["active_skills"]],
                        environments=[ActiveEnv.from_dict(e) for e in data["environments"]],
                        buffer=dict(data["buffer"]), scheduler=dict(data["scheduler"]),
                        trackers=dict(data["trackers"]), regen_interval=_interval(data.get("regen_interval")),
                        reference=None if data.get("reference") is None else str(data["reference"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ResumeError(f"{where}: loop state is damaged ({type(exc).__name__}: {exc})") from None
        return state


def _interval(value: Any) -> Optional[int]:
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"regen_interval must be an int >= 1 or null, got {value!r}")
    return value


def regeneration_change(state: LoopState, regen_interval: int) -> Optional[str]:
    """What a resume with another ``selfplay.regen_interval`` does, or None when it is unchanged (or unrecorded).

    Regeneration stays on the run's schedule, rollouts r with ``(r - 1) % regen_interval == 0``, counted from the
    run's start: the environment set in play (and the designer samples waiting on it, which keep their own delay)
    continues until the next such rollout of the new interval, then the designer writes a new set. Nothing saved
    depends on the old interval, so the change is applied, and said, rather than refused."""
    if state.regen_interval is None or state.regen_interval == regen_interval:
        return None
    following = state.rollout + 1 + (-state.rollout) % regen_interval
    return (f"selfplay.regen_interval {state.regen_interval} -> {regen_interval}: the environment set of rollout "
            f"{state.rollout} plays on until the next regeneration at rollout {following}, then every "
            f"{regen_interval} rollouts")


def _count(value: Any, name: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


class CheckpointStore:
    """The run's checkpoints: trainer folders under ``run_dir/checkpoints`` and the loop states beside them."""

    def __init__(self, run_dir: str | Path) -> None:
        self.root = Path(run_dir) / CHECKPOINT_DIR
        self.states = self.root / STATE_DIR

    def state_path(self, step: int) -> Path:
        return self.states / f"step_{step:08d}.json"

    def write_state(self, step: int, state: LoopState) -> Path:
        """Write the loop state of trainer step ``step`` atomically (before the trainer's checkpoint of that step)."""
        self.states.mkdir(parents=True, exist_ok=True)
        text = json.dumps(state.to_dict(), allow_nan=False, separators=(",", ":"))
        return replace_atomically(self.state_path(step), lambda f: f.write(text.encode("utf-8")))

    def prune_states(self) -> None:
        """Delete loop states whose trainer checkpoint is gone (pruned by keep_checkpoints, or never completed)."""
        if not self.states.is_dir():
            return
        kept = {p.name for p in self.root.iterdir() if p.is_dir() and is_complete(p)}
        for path in self.states.glob("step_*.json*"):
            if path.name.split(".")[0] not in kept:
                path.unlink(missing_ok=True)

    def latest(self) -> Optional[Path]:
        """The newest complete trainer checkpoint (None when the run has none)."""
        return find_latest(self.root)

    def read_state(self, checkpoint: Path) -> LoopState:
        path = self.states / f"{checkpoint.name}.json"
        if not path.is_file():
            raise ResumeError(f"{checkpoint}: no loop state beside it ({path} is missing): the checkpoint was not "
                              "written by the self-play loop, or its state was deleted; resume from an earlier "
                              "checkpoint (delete this one) or start a new run (run.resume: never, another run.name)")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ResumeError(f"{path}: cannot read the loop state ({exc})") from None
        return LoopState.from_dict(data, str(path))
