"""The rollout of one run: its engine, prompts, sandbox pool and validator, for the self-play loop to call."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from spade_mega.config.errors import ConfigError
from spade_mega.config.schema import SpadeConfig
from spade_mega.curriculum.prompts import PromptBuilder
from spade_mega.envs.sandbox import SandboxPool
from spade_mega.envs.validate import SolvabilityCheck, Validator
from spade_mega.inference.base import Engine
from spade_mega.monitor.progress import RunProgress
from spade_mega.rollout.agent import AgentBatch, play_episodes
from spade_mega.rollout.chat import ChatTurns
from spade_mega.rollout.designer import DesignerBatch, generate_designs
from spade_mega.rollout.records import AgentPlay, DesignerSlot
from spade_mega.rollout.solvability import solvability_check


class Rollout:
    """``design(slots)`` asks the designer for environments; ``play(plays)`` runs agent episodes and hint plays.

    The engine and the pool belong to the caller (one each per run); the tokenizer must be the engine's. With
    ``validation.solvability.enabled`` the validator ends with the policy's solvability check in
    ``validation.solvability.mode`` (:func:`solvability_check`, on this engine) unless the caller passes its own
    ``solvability``.
    """

    def __init__(self, cfg: SpadeConfig, engine: Engine, pool: SandboxPool, builder: PromptBuilder,
                 solvability: Optional[SolvabilityCheck] = None) -> None:
        _check_context(cfg)
        self.cfg, self.engine, self.pool = cfg, engine, pool
        self.chat = ChatTurns(builder)
        if solvability is None and cfg.validation.solvability.enabled:
            solvability = solvability_check(engine, self.chat, pool, cfg)
        self.validator = Validator(pool, cfg.validation, solvability=solvability, rollout_turns=cfg.rollout.max_turns)

    @classmethod
    def from_config(cls, cfg: SpadeConfig, engine: Engine, pool: SandboxPool, tokenizer: Any = None,
                    **kwargs: Any) -> "Rollout":
        """The run's rollout: prompts from ``PromptBuilder.from_config`` with ``tokenizer`` (``model.tokenizer``
        unless given)."""
        return cls(cfg, engine, pool, PromptBuilder.from_config(cfg, tokenizer), **kwargs)

    def design(self, slots: Sequence[DesignerSlot], iteration: Optional[int] = None) -> DesignerBatch:
        return generate_designs(self.engine, self.chat, self.validator, self.cfg, slots, iteration)

    def play(self, plays: Sequence[AgentPlay], progress: Optional[RunProgress] = None) -> AgentBatch:
        return play_episodes(self.engine, self.chat, self.pool, self.cfg, plays, progress)


def _check_context(cfg: SpadeConfig) -> None:
    """Every sequence of a rollout (an episode, a designer sample) grows up to ``rollout.max_context_tokens``: the
    model's positions must hold it (with ``model.hf_config``, its config.json's ``max_position_embeddings``, which
    ``SpadeConfig.check`` does not read), and so must one micro-batch row of the trainer
    (``parallel.max_tokens_per_gpu`` x ``parallel.context``, rounded down to the row length multiple of sequence /
    context parallelism; under context parallelism a sample takes its length padded to a multiple of 2 x CP), which
    refuses a longer sample. Say so before any rollout, not at the first long sample."""
    p, context = cfg.parallel, cfg.rollout.max_context_tokens
    if cfg.model.hf_config is not None:
        from spade_mega.megatron.providers import resolve_model_config

        positions = resolve_model_config(cfg.model).max_position_embeddings
        if context > positions:
            raise ConfigError("rollout.max_context_tokens",
                              f"must be <= model.max_position_embeddings ({positions}) of {cfg.model.hf_config}: "
                              f"every episode and designer sample grows up to it; got {context}")
    from spade_mega.megatron.batch import row_capacity, row_length_multiple, sample_room

    multiple = row_length_multiple(p.tensor, p.context, p.sequence_parallel)
    row, room = row_capacity(p.max_tokens_per_gpu, multiple, p.context), sample_room(context, p.context)
    if room > row:
        least = -(-(-(-room // multiple) * multiple) // p.context)  # the room rounded up to the multiple, per rank
        raise ConfigError("parallel.max_tokens_per_gpu",
                          f"a micro-batch row holds {row} tokens, but rollout samples grow up to "
                          f"rollout.max_context_tokens ({context}); raise parallel.max_tokens_per_gpu to at least "
                          f"{least} (a row is parallel.context x parallel.max_tokens_per_gpu "
                          "tokens; under sequence parallelism each of the TP ranks holds 1/TP of a rank's share) or "
                          "lower rollout.max_context_tokens")
