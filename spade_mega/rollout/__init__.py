"""Rollouts: designer generation (prompt, generate, parse, validate) and multi-turn agent episodes (with and without
the hint), as token sequences the trainer consumes directly.

    rollout = Rollout.from_config(cfg, engine, pool, tokenizer)
    designs = rollout.design([DesignerSlot("logic", document, seeds, negatives, sampling_seed=7)], iteration=3)
    batch = rollout.play([AgentPlay(env_id, program, seed=0, sampling_seed=s) for s in range(16)])
"""

from spade_mega.rollout.agent import AgentBatch, play_episodes
from spade_mega.rollout.chat import ChatTurns
from spade_mega.rollout.designer import DesignerBatch, designer_outcome, generate_designs, validate_outcomes
from spade_mega.rollout.records import (AgentEpisode, AgentPlay, DesignerOutcome, DesignerSlot, EpisodeFailure,
                                        RolloutStats, TokenSequence)
from spade_mega.rollout.runner import Rollout
from spade_mega.rollout.solvability import JudgedSolvability, PlayedSolvability, parse_verdict, solvability_check

__all__ = ["AgentBatch", "AgentEpisode", "AgentPlay", "ChatTurns", "DesignerBatch", "DesignerOutcome", "DesignerSlot",
           "EpisodeFailure", "JudgedSolvability", "PlayedSolvability", "Rollout", "RolloutStats", "TokenSequence",
           "designer_outcome", "generate_designs", "parse_verdict", "play_episodes", "solvability_check",
           "validate_outcomes"]
