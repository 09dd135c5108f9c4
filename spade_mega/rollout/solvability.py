"""The LLM solvability check, validation's last step: the policy plays each program with its hint, and a program
fewer than ``validation.solvability.min_wins`` of whose ``attempts`` are won is refused as unsolvable.

SPADE validates tool-use environments with "an LLM solvability check". The reference shows the model the program's
source and asks for a boxed yes/no (at temperature 0.3), accepting the program when the answer has no verdict. Here
the model *plays* the program, with the designer's hint, exactly as a hint play does: a win is evidence a reading
cannot fake, a program the policy cannot win even when told how teaches the agent nothing until the policy improves,
and the episodes go through the same lockstep machinery as training (``rollout.agent``): every attempt of every
program in one batch, one engine call per turn, at most ``rollout.max_open_envs`` sandbox workers open.

A program that breaks while being played (its ``step()`` times out or raises on the model's actions) is refused with
that failure as the reason: training would hit it too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from spade_mega.config.schema import SpadeConfig
from spade_mega.curriculum.rewards import won
from spade_mega.envs.program import EnvProgram
from spade_mega.envs.sandbox import SandboxPool
from spade_mega.envs.validate import Reason, SolvabilityVerdict
from spade_mega.inference.base import Engine
from spade_mega.rollout.agent import play_episodes
from spade_mega.rollout.chat import ChatTurns
from spade_mega.rollout.records import AgentEpisode, AgentPlay, EpisodeFailure, RolloutStats
from spade_mega.rollout.sampling import derived_seed

_BROKEN = {EpisodeFailure.STEP_TIMEOUT: Reason.TIMEOUT, EpisodeFailure.SANDBOX_ERROR: Reason.PROGRAM_ERROR}


class PlayedSolvability:
    """A :data:`~spade_mega.envs.validate.SolvabilityCheck` that plays the programs with ``engine``.

    Attempt ``k`` of a program resets it with seed ``validation.seed + k`` (distinct instances) and samples at
    ``validation.solvability.temperature`` with a seed derived from the program's hash, so a program's verdict under
    given weights is reproducible. ``stats`` adds up the engine and sandbox time of every check, for metrics.
    """

    def __init__(self, engine: Engine, chat: ChatTurns, pool: SandboxPool, cfg: SpadeConfig) -> None:
        self.engine, self.chat, self.pool = engine, chat, pool
        self.check = cfg.validation.solvability
        self.seed = cfg.validation.seed
        # the attempts are hint plays, sampled at the check's temperature
        self.cfg = replace(cfg, rollout=replace(cfg.rollout, hint_temperature=self.check.temperature))
        self.stats = RolloutStats()

    def __call__(self, programs: Sequence[EnvProgram]) -> list[SolvabilityVerdict]:
        attempts = self.check.attempts
        plays = [AgentPlay(i, program, seed=self.seed + k, hinted=True,
                           sampling_seed=derived_seed(int(program.content_hash[:15], 16), k))
                 for i, program in enumerate(programs) for k in range(attempts)]
        batch = play_episodes(self.engine, self.chat, self.pool, self.cfg, plays)
        for name in RolloutStats.__dataclass_fields__:
            setattr(self.stats, name, getattr(self.stats, name) + getattr(batch.stats, name))
        by_program: list[list[AgentEpisode]] = [[] for _ in programs]
        for episode in batch.episodes:
            by_program[episode.env_id].append(episode)
        return [self._verdict(episodes) for episodes in by_program]

    def _verdict(self, episodes: list[AgentEpisode]) -> SolvabilityVerdict:
        wins = sum(won(ep.reward, self.cfg.rewards) for ep in episodes)
        cost = {"plays": float(len(episodes)), "wins": float(wins), "turns": float(sum(ep.turns for ep in episodes)),
                "generated_tokens": float(sum(ep.sequence.num_generated for ep in episodes)),
                # each turn's request carries the whole context before it, as RolloutStats counts prompt tokens
                "prompt_tokens": float(sum(start for ep in episodes for start, _ in ep.turn_spans))}
        broken = next((ep for ep in episodes if ep.failure in _BROKEN), None)
        if broken is not None:
            return SolvabilityVerdict(False, f"while the policy played it with the hint (seed {broken.seed}): "
                                             f"{broken.failure_detail}", _BROKEN[broken.failure], cost)
        threshold, needed = self.cfg.rewards.win_threshold, self.check.min_wins
        best = max(ep.reward for ep in episodes)
        detail = (f"{wins} of {len(episodes)} attempts with the hint won (reward >= rewards.win_threshold "
                  f"{threshold:g}; best reward {best:g}); validation.solvability.min_wins is {needed}")
        return SolvabilityVerdict(wins >= needed, detail, Reason.UNSOLVABLE, cost)
