"""Multi-turn agent episodes, played in lockstep: each turn, one engine call for every live episode, then one
batched step of their sandboxed environments.

An episode is one append-only token sequence (see ``chat.py``): the prompt, then per turn the agent's generated ids
exactly as the engine returned them (loss mask 1, behaviour log-probs) and the template text carrying the next
observation (mask 0). It ends when the environment terminates or truncates it, at the turn limit
(``min(rollout.max_turns, the program's max_turns)``), when the next turn would not fit in
``rollout.max_context_tokens`` (``context_overflow``), or when the program fails in the sandbox (``step_timeout``,
``sandbox_error``); a failure ends only its own episode.

At most ``rollout.max_open_envs`` environments are open at once (each is a sandbox worker); further plays wait for a
slot. A finished episode's worker is kept for a later play of the same program (a fresh instance of the class is
reset in it; validation checked that no state leaks between episodes), so groups of plays load each program once.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

from spade_mega.config.schema import SpadeConfig
from spade_mega.curriculum.parsing import parse_agent_output
from spade_mega.curriculum.rewards import episode_reward
from spade_mega.envs.program import EnvProgram
from spade_mega.envs.sandbox import EnvHandle, SandboxError, SandboxPool, SandboxTimeout
from spade_mega.inference.base import Engine, EngineError, Generation, GenerationRequest
from spade_mega.monitor.progress import RunProgress
from spade_mega.rollout.chat import ChatTurns, decode, encode
from spade_mega.rollout.records import AgentEpisode, AgentPlay, EpisodeFailure, RolloutStats
from spade_mega.rollout.sampling import derived_seed, sampling


@dataclass
class AgentBatch:
    """The episodes of ``play_episodes``, in play order, and where the time went."""

    episodes: list[AgentEpisode]
    stats: RolloutStats = field(default_factory=RolloutStats)


@dataclass
class _Live:
    index: int
    play: AgentPlay
    episode: AgentEpisode
    handle: EnvHandle
    turn_limit: int


class _Environments:
    """Open environments, at most ``capacity`` at once, with finished ones kept for another play of their program."""

    def __init__(self, pool: SandboxPool, capacity: int) -> None:
        self.pool, self.capacity = pool, capacity
        self.in_use: set[EnvHandle] = set()
        self.idle: OrderedDict[EnvHandle, str] = OrderedDict()  # handle -> program hash, oldest first

    def acquire(self, program: EnvProgram) -> EnvHandle:
        key = program.content_hash
        handle = next((h for h, k in self.idle.items() if k == key), None)
        if handle is not None:
            del self.idle[handle]
        else:
            while self.idle and len(self.in_use) + len(self.idle) >= self.capacity:
                self.idle.popitem(last=False)[0].close()
            handle = self.pool.open(program)
        self.in_use.add(handle)
        return handle

    def release(self, handle: EnvHandle, reusable: bool) -> None:
        self.in_use.discard(handle)
        if reusable:
            self.idle[handle] = handle.program.content_hash
        else:
            handle.close()

    def close(self) -> None:
        for handle in [*self.in_use, *self.idle]:
            handle.close()
        self.in_use.clear()
        self.idle.clear()


def _failure_kind(error: SandboxError) -> EpisodeFailure:
    return EpisodeFailure.STEP_TIMEOUT if isinstance(error, SandboxTimeout) else EpisodeFailure.SANDBOX_ERROR


def _detail(error: SandboxError, call: str) -> str:
    return f"{call}: {type(error).__name__}: {error.message}"[:2000]


def play_episodes(engine: Engine, chat: ChatTurns, pool: SandboxPool, cfg: SpadeConfig, plays: Sequence[AgentPlay],
                  progress: Optional[RunProgress] = None) -> AgentBatch:
    """Play every ``AgentPlay`` to its end; returns the episodes in the order of ``plays``."""
    return _Lockstep(engine, chat, pool, cfg, plays, progress).run()


class _Lockstep:
    """The state of one ``play_episodes`` call."""

    def __init__(self, engine: Engine, chat: ChatTurns, pool: SandboxPool, cfg: SpadeConfig,
                 plays: Sequence[AgentPlay], progress: Optional[RunProgress]) -> None:
        self.engine, self.chat, self.pool, self.cfg, self.plays, self.progress = engine, chat, pool, cfg, plays, progress
        self.rollout = cfg.rollout
        self.stats = RolloutStats()
        self.episodes: list[Optional[AgentEpisode]] = [None] * len(plays)
        self.envs = _Environments(pool, self.rollout.max_open_envs)
        self.pending = deque(range(len(plays)))
        self.unloadable: dict[str, tuple[EpisodeFailure, str]] = {}  # program hash -> why it did not load

    def run(self) -> AgentBatch:
        live: list[_Live] = []
        try:
            while self.pending or live:
                live.extend(self._admit(self.rollout.max_open_envs - len(live)))
                if live:
                    live = self._turn(live)
        finally:
            self.envs.close()
        return AgentBatch([ep for ep in self.episodes if ep is not None], self.stats)

    def _done(self, index: int, episode: AgentEpisode, *, terminated: bool = False,
              failure: Optional[EpisodeFailure] = None, detail: str = "") -> None:
        episode.terminated, episode.truncated = terminated, not terminated
        episode.failure, episode.failure_detail = failure, detail
        episode.reward = episode_reward(episode.step_rewards, terminated, self.cfg.rewards)
        self.episodes[index] = episode
        self.stats.sequences += 1
        if self.progress is not None:
            self.progress.advance(1)

    def _finish(self, live: _Live, *, terminated: bool = False, failure: Optional[EpisodeFailure] = None,
                detail: str = "") -> None:
        broken = failure in (EpisodeFailure.STEP_TIMEOUT, EpisodeFailure.SANDBOX_ERROR)
        self.envs.release(live.handle, reusable=not broken)
        self._done(live.index, live.episode, terminated=terminated, failure=failure, detail=detail)

    def _admit(self, room: int) -> list[_Live]:
        """Open and reset up to ``room`` pending plays; returns those whose first prompt is ready."""
        started = time.perf_counter()
        opened: list[_Live] = []
        while self.pending and len(opened) < room:
            index = self.pending.popleft()
            play = self.plays[index]
            episode = AgentEpisode(play.env_id, play.program.skill, play.program.content_hash, play.hinted, play.seed,
                                   play.sampling_seed)
            known = self.unloadable.get(episode.content_hash)
            if known is not None:  # loading it again would fail again, after up to sandbox.load_timeout_s
                self._done(index, episode, failure=known[0], detail=known[1])
                continue
            try:
                handle = self.envs.acquire(play.program)
            except SandboxError as error:
                failure = self.unloadable[episode.content_hash] = (_failure_kind(error),
                                                                   _detail(error, "loading the program"))
                self._done(index, episode, failure=failure[0], detail=failure[1])
                continue
            opened.append(_Live(index, play, episode, handle, min(self.rollout.max_turns, handle.max_turns)))
        results = self.pool.reset_many([(entry.handle, entry.play.seed) for entry in opened]) if opened else []
        self.stats.sandbox_s += time.perf_counter() - started
        ready = []
        for entry, result in zip(opened, results):
            if isinstance(result, SandboxError):
                self._finish(entry, failure=_failure_kind(result), detail=_detail(result, f"reset({entry.play.seed})"))
                continue
            episode = entry.episode
            episode.observations.append(result)
            hint = entry.play.program.hint if entry.play.hinted else None
            prompt = encode(self.chat.tokenizer, self.chat.builder.agent([result], hint=hint).text)
            episode.sequence.append_context(prompt)
            if len(prompt) >= self.rollout.max_context_tokens:
                self._finish(entry, failure=EpisodeFailure.CONTEXT_OVERFLOW,
                             detail=f"the first prompt has {len(prompt)} tokens, rollout.max_context_tokens is "
                                    f"{self.rollout.max_context_tokens}")
                continue
            ready.append(entry)
        return ready

    def _turn(self, live: list[_Live]) -> list[_Live]:
        """One generation for every live episode, then one batched step; returns the episodes that go on."""
        generations = self._generate(live)
        actions = []
        for entry, gen in zip(live, generations):
            episode = entry.episode
            start = len(episode.sequence)
            episode.sequence.append_generated(gen.output_ids, gen.logprobs, gen.weight_version)
            episode.turn_spans.append((start, len(episode.sequence)))
            finish = self.chat.finish_reason(gen)
            episode.finish_reasons.append(finish)
            answer = decode(self.chat.tokenizer, self.chat.content_ids(gen.output_ids, finish))
            episode.replies.append(answer)
            action = parse_agent_output(answer)
            episode.actions.append(action.text)
            episode.malformed_actions += not action.well_formed
            actions.append(action.text)
        started = time.perf_counter()
        results = self.pool.step_many([(entry.handle, action) for entry, action in zip(live, actions)])
        self.stats.sandbox_s += time.perf_counter() - started
        going_on = []
        for entry, gen, result in zip(live, generations, results):
            episode = entry.episode
            if isinstance(result, SandboxError):
                self._finish(entry, failure=_failure_kind(result), detail=_detail(result, f"step {episode.turns}"))
                continue
            episode.step_rewards.append(result.reward)
            episode.observations.append(result.observation)
            if result.terminated or result.truncated or episode.turns >= entry.turn_limit:
                self._finish(entry, terminated=result.terminated)
                continue
            following = self.chat.between_turns(gen.output_ids, self.chat.finish_reason(gen), result.observation)
            next_start = len(episode.sequence) + len(following)
            if next_start >= self.rollout.max_context_tokens:
                self._finish(entry, failure=EpisodeFailure.CONTEXT_OVERFLOW,
                             detail=f"turn {episode.turns + 1} would start at token {next_start}, leaving no room "
                                    f"within rollout.max_context_tokens ({self.rollout.max_context_tokens})")
                continue
            episode.sequence.append_context(following)
            going_on.append(entry)
        return going_on

    def _generate(self, live: list[_Live]) -> list[Generation]:
        """One engine call: every live episode's next turn, each capped by the turn and context budgets."""
        requests = []
        for entry in live:
            ids = entry.episode.sequence.token_ids
            budget = min(self.rollout.max_response_tokens, self.rollout.max_context_tokens - len(ids))
            seed = derived_seed(entry.play.sampling_seed, entry.episode.turns)
            requests.append(GenerationRequest(tuple(ids), sampling(self.rollout, budget, hinted=entry.play.hinted,
                                                                   seed=seed, stop_ids=self.chat.stop_ids)))
        started = time.perf_counter()
        generations = self.engine.generate(requests)
        self.stats.generation_s += time.perf_counter() - started
        if len(generations) != len(requests):
            raise EngineError(f"the engine returned {len(generations)} completions for {len(requests)} requests")
        self.stats.engine_calls += 1
        self.stats.prompt_tokens += sum(len(r.prompt_ids) for r in requests)
        self.stats.generated_tokens += sum(len(g.output_ids) for g in generations)
        return generations
