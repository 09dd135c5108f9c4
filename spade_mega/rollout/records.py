"""What a rollout hands the trainer: token sequences with their masks and behaviour log-probs, plus the outcome.

Every sequence is one flat list of token ids the trainer feeds as is: ``loss_mask`` is 1 exactly on the model's own
tokens (what the engine generated) and 0 on prompts and template text; ``behaviour_logprobs`` holds the engine's
log-prob of each generated token and 0 elsewhere, aligned with ``token_ids``; ``policy_version`` is the weight version
that produced the tokens (the oldest one when a multi-turn episode spans an update), which truncated importance
sampling needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Sequence

from spade_mega.curriculum.corpus import GroundingDocument
from spade_mega.curriculum.memory import EnvRecord
from spade_mega.curriculum.parsing import ParseReason
from spade_mega.curriculum.rewards import Failure
from spade_mega.envs.program import EnvProgram
from spade_mega.envs.validate import Reason, ValidationReport
from spade_mega.inference.base import EngineError


@dataclass
class TokenSequence:
    """One append-only training sequence (see the module docstring)."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    policy_version: Optional[int] = None  # None until the first generated token is appended

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def append_context(self, ids: Sequence[int]) -> None:
        """Prompt or template tokens: not the model's, so not trained on."""
        self.token_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.behaviour_logprobs.extend([0.0] * len(ids))

    def append_generated(self, ids: Sequence[int], logprobs: Sequence[float], version: int) -> None:
        """The engine's output tokens, kept exactly as generated, with their behaviour log-probs; a completion
        without one usable log-prob per token is the engine's fault (an EngineError), and nothing is appended."""
        if len(ids) != len(logprobs):
            raise EngineError(f"the engine returned {len(ids)} generated tokens but {len(logprobs)} log-probs")
        bad = next((lp for lp in logprobs if not (math.isfinite(lp) and lp <= 0.0)), None)
        if bad is not None:
            raise EngineError(f"the engine returned a behaviour log-prob of {bad!r}; each must be finite and <= 0")
        self.token_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.behaviour_logprobs.extend(logprobs)
        self.policy_version = version if self.policy_version is None else min(self.policy_version, version)


# --- the designer --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DesignerSlot:
    """One designer prompt to fill: the skill asked for, its grounding document and memory's seeds and negatives.

    ``sampling_seed`` makes the completion reproducible (None: the engine draws)."""

    skill: str
    document: Optional[GroundingDocument] = None
    seeds: tuple[EnvRecord, ...] = ()
    negatives: tuple[EnvRecord, ...] = ()
    sampling_seed: Optional[int] = None


@dataclass
class DesignerOutcome:
    """One designer output: the training sequence, what it says, and whether it is a usable environment.

    Exactly one of ``program`` and ``parse_error`` is set; ``validation`` is the sandbox verdict on ``program``.
    """

    skill: str
    document_id: Optional[str]
    seed_env_ids: tuple[int, ...]
    negative_env_ids: tuple[int, ...]
    sequence: TokenSequence
    text: str  # the decoded output, without its end-of-turn token
    finish_reason: str
    program: Optional[EnvProgram] = None
    parse_error: Optional[ParseReason] = None
    parse_detail: str = ""
    validation: Optional[ValidationReport] = None
    prompt_dropped: dict[str, int] = field(default_factory=dict)  # what the prompt budget trimmed

    @property
    def valid(self) -> bool:
        """A parsed program that passed validation: the only kind the agent plays."""
        return self.program is not None and self.validation is not None and self.validation.ok

    @property
    def failure(self) -> Optional[Failure]:
        """The designer-reward failure of this output, None when it is valid: ``step_timeout`` when validation refused
        it for a call past ``sandbox.call_timeout_s`` (reason ``timeout``: in its sandbox checks, or while the
        solvability check played it), as the same timeout met in training's play is paid; else ``invalid_program``.
        A slow program refused for ``validation.time_budget_s`` as a whole is ``invalid_program``: no call hung."""
        if self.valid:
            return None
        if self.validation is not None and self.validation.reason is Reason.TIMEOUT:
            return "step_timeout"
        return "invalid_program"

    @property
    def rejection(self) -> Optional[str]:
        """One reason code for metrics: ``parse:<reason>`` or ``validate:<reason>``, None when valid."""
        if self.parse_error is not None:
            return f"parse:{self.parse_error.value}"
        if self.validation is not None and self.validation.reason is not None:
            return f"validate:{self.validation.reason.value}"
        return None


# --- the agent -----------------------------------------------------------------------------------------------------


class EpisodeFailure(str, Enum):
    """Why an episode ended other than by the environment or the turn limit (counted in metrics)."""

    STEP_TIMEOUT = "step_timeout"  # reset() or step() overran sandbox.call_timeout_s
    SANDBOX_ERROR = "sandbox_error"  # the program did not load, raised, crashed, broke the contract, printed too much
    CONTEXT_OVERFLOW = "context_overflow"  # the next turn would not fit in rollout.max_context_tokens


@dataclass(frozen=True)
class AgentPlay:
    """One episode to play: an environment, its reset seed, the sampling seed, with or without the hint.

    The plays of one GRPO group share ``env_id`` and usually ``seed`` (the same instance) and differ in
    ``sampling_seed``. Seeds come from the caller, so a rollout is reproducible."""

    env_id: Any  # the caller's identifier (a memory id, a content hash), carried into the episode
    program: EnvProgram
    seed: int
    sampling_seed: Optional[int] = None
    hinted: bool = False


@dataclass
class AgentEpisode:
    """One played episode as one multi-turn sequence: prompt, then per turn the agent's tokens (mask 1) and the
    template text carrying the next observation (mask 0)."""

    env_id: Any
    skill: str
    content_hash: str
    hinted: bool
    seed: int
    sampling_seed: Optional[int]
    sequence: TokenSequence = field(default_factory=TokenSequence)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each turn's generated tokens
    observations: list[str] = field(default_factory=list)  # the first one, then one per successful step
    actions: list[str] = field(default_factory=list)  # parsed from each turn's output, as sent to step()
    malformed_actions: int = 0  # turns whose output had no <action> tag (the whole answer was sent)
    finish_reasons: list[str] = field(default_factory=list)  # per turn: "stop" or "length" (cut at the budget)
    replies: list[str] = field(default_factory=list)  # per turn: the decoded answer, without the stop token
    step_rewards: list[float] = field(default_factory=list)
    terminated: bool = False
    truncated: bool = False  # ended without the environment terminating it: its own truncation, the turn limit,
    # the context limit or a failure
    reward: float = 0.0  # curriculum.rewards.episode_reward of the step rewards
    failure: Optional[EpisodeFailure] = None
    failure_detail: str = ""

    @property
    def turns(self) -> int:
        """Agent moves generated."""
        return len(self.turn_spans)

    @property
    def trainable(self) -> bool:
        """Whether the agent update may use it: hint plays never, nor episodes the environment program broke (their
        reward says nothing about the agent); a context overflow is a legitimate truncated episode."""
        return (not self.hinted and len(self.turn_spans) > 0
                and self.failure in (None, EpisodeFailure.CONTEXT_OVERFLOW))

    @property
    def measured(self) -> bool:
        """Whether this play measures the agent: its program did not break it. A broken play's reward is whatever the
        episode held when the program raised or hung, so the loop leaves it out of every return, win rate, regret,
        skill tracker, memory evaluation and designer reward input (it counts it in ``agent/broken_plays``); a
        context overflow is the agent's own and counts."""
        return self.program_fault is None

    @property
    def program_fault(self) -> Optional[Reason]:
        """The validation reason a program that broke this episode earns (``timeout``: a call past
        ``sandbox.call_timeout_s``; ``program_error``: any other sandbox failure), as if validation had met it; None
        when the program did not break."""
        return {EpisodeFailure.STEP_TIMEOUT: Reason.TIMEOUT,
                EpisodeFailure.SANDBOX_ERROR: Reason.PROGRAM_ERROR}.get(self.failure)  # type: ignore[arg-type]

    @property
    def designer_failure(self) -> Optional[Failure]:
        """The failure the designer of this environment is penalised for: a timeout is ``step_timeout``, any other
        program failure ``invalid_program``; context overflows are the agent's (None)."""
        if self.failure is EpisodeFailure.STEP_TIMEOUT:
            return "step_timeout"
        if self.failure is EpisodeFailure.SANDBOX_ERROR:
            return "invalid_program"
        return None


# --- timings -------------------------------------------------------------------------------------------------------


@dataclass
class RolloutStats:
    """Where a rollout phase spent its time and how many tokens it moved, for metrics."""

    generation_s: float = 0.0  # inside engine.generate
    sandbox_s: float = 0.0  # opening, resetting and stepping environments
    validation_s: float = 0.0  # validating designer programs
    engine_calls: int = 0
    prompt_tokens: int = 0  # prompt tokens sent to the engine, over all calls (a multi-turn context counts each turn)
    generated_tokens: int = 0
    sequences: int = 0

    def metrics(self, prefix: str) -> dict[str, float]:
        """Flat ``{prefix/name: value}``, plus generated tokens per second of generation."""
        out: dict[str, float] = {f"{prefix}/{name}": float(getattr(self, name)) for name in self.__dataclass_fields__}
        if self.generation_s > 0:
            out[f"{prefix}/generated_tokens_per_s"] = self.generated_tokens / self.generation_s
        return out
