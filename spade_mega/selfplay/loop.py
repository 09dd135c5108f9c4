"""The SPADE loop: regenerate environments, play them, pay the agent now and the designer later, train, sync, save.

One rollout (DESIGN.md, "Data flow of one SPADE iteration"):

1. Every ``selfplay.regen_interval`` rollouts the designer writes ``rollout.envs_per_rollout`` environments for the
   skills the scheduler makes active, each prompt grounded in a corpus document and steered by the memory's seeds
   and negatives. Every output is proposed to the memory with its validation verdict and enters the delayed
   designer buffer (an invalid one marked failed: a bounded penalty). The valid programs are the environment set
   until the next regeneration; with ``selfplay.library_fallback``, slots left empty are filled with library
   programs of the active skills, which never pay a designer.
2. The agent plays every environment ``agent_trajectories_per_env`` times without the hint (trained on) and
   ``hint_plays_per_env`` times with it (regret only); all plays of an environment start from the same reset seed.
   The plays go to the buffer (designer environments), the memory (every environment) and the per-skill trackers.
3. Agent advantages per environment group; designer samples whose delay expired are released with their reward and
   centred per skill (times ``env_reward_scale``); the mixed batch is cut into optimizer steps of
   ``selfplay.global_batch_size``; after the last step the new weights are streamed into the engine. Servers that
   share the trainer's GPUs (``inference.release_memory``) free their GPU memory at the end of rank 0's rollout,
   before any rank steps, and take it back around the sync: their weights' memory, the reload, their KV cache.
4. Every ``selfplay.save_interval`` rollouts (and after the last) the trainer's checkpoint and the loop's state are
   saved together (state.py).
5. Every ``eval.interval`` rollouts (and before the first with ``eval.before_train``), after the weight sync and that
   rollout's checkpoint (an evaluation that fails loses no training), rank 0 scores the engine on the held-out
   suites (spade_mega/evaluation): ``eval/<suite>/<metric>`` at that rollout's step (step 0 before training). A job
   stopped (SIGUSR1) or killed before the scores were logged has them redone first by its resumed run.
   Evaluation seeds its own sampling, so training goes on as without it.

Distributed: every rank builds the trainer; global rank 0 alone owns the engine, the sandbox pool, the memory and
the rollout, and broadcasts each rollout's samples and metrics, so every rank trains on the same batch. Metrics are
logged per rollout (the MetricsLogger step is the rollout index).

One-step off-policy (``selfplay.async_rollouts``, slime's train_async, verl's one-step-off-policy): rank 0 plays
rollout r+1 on a thread of its own while every rank trains on rollout r, then collects it, syncs the weights of
train(r) into the engine and starts r+2 before train(r+1)::

    rollout(1) [v0] -> start rollout(2) [v0] -> train(1) -> v1 -> wait rollout(2) -> sync v1
      -> start rollout(3) [v1] -> train(2) -> v2 -> wait rollout(3) -> sync v2 -> ...

- Lag: a rollout played ahead was played by the weights before the training it overlapped. Its behaviour log-probs
  (TrainSample.rollout_logprobs) are the engine's, so truncated importance sampling corrects the lag; the old
  log-probs stay the trainer's forward before the rollout's first step. ``rollout/weight_version`` is the version
  that played it (every transcript record's ``weight_version`` too), ``rollout/policy_lag`` the optimizer steps
  between it and the weights trained on it (0 in a synchronous run). ``train/rollout_logprob_abs_diff`` compares
  the same weights, so it is logged at lag 0 only; a lagged rollout logs ``train/offpolicy_logprob_abs_diff``.
- Drain points: a rollout that is the last, saved (``selfplay.save_interval``) or evaluated (``eval.interval``) is
  not overlapped with the next (:meth:`SelfPlay._drains`): its weights are synced before its save and evaluation, and
  the next rollout is played by them, so its checkpoint holds what a synchronous run's holds and a resume from it
  continues as the uninterrupted run did.
- Stop: SIGUSR1 is agreed after a rollout's training, as always. With rollout r+1 playing ahead, rollout r is saved
  at once, without waiting for r+1 (its loop state is the one taken when r+1 started; the engine is not synced: the
  state records the version the sync would have served), then r+1 is abandoned: its next engine call raises (the
  call in flight finishes), the loop state is put back and the memory rows it wrote are dropped (its transcript is
  written only once trained, the designer rewards it paid on earlier rollouts' evaluations once it is collected:
  :meth:`_Actor.keep`). The resumed run plays r+1 anew, after its sync.
- Per rollout: what the actor settles once a rollout is trained (transcript, trajectories, advantages) travels in
  the rollout's own record (:class:`_Played`), so the rollout ahead leaves it alone. The actor's other state
  (buffer, trackers, scheduler, environments, memory) is only ever changed by the one rollout playing.
- Threads: the rollout thread only plays (engine, sandbox, memory); every collective stays on the loop's thread,
  which collects the rollout (its error raised there, on every rank by :func:`_from_rank0`) before any weight sync or
  evaluation uses the engine, and the actor's ``close`` stops and joins it, so it never outlives the run.
- Time: ``time/rollout_wait_s`` is how long training waited for its rollout (all of it when not overlapped),
  ``time/rollout_s`` the rollout's own duration, ``time/iteration_s`` the loop's wall time for the rollout (the wait,
  training, the sync, the save), ``time/sync_s`` the syncs done in it (with a rollout ahead, the previous weights').
- Refused for engines that release their memory while the trainer steps (``inference.release_memory``): they would
  be asleep during the overlap (config check).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from spade_mega.config.errors import ConfigError
from spade_mega.config.loader import prepare_run_dir, to_dict
from spade_mega.config.schema import FixedEnvConfig, SpadeConfig
from spade_mega.curriculum.corpus import Corpus, GroundingSampler
from spade_mega.curriculum.memory import EnvMemory
from spade_mega.curriculum.prompts import PromptBuilder
from spade_mega.curriculum.rewards import SkillTrackers, env_reward_scale, win_rate
from spade_mega.curriculum.skills import SkillRegistry, SkillScheduler
from spade_mega.envs import library
from spade_mega.envs.program import EnvProgram
from spade_mega.envs.validate import Reason
from spade_mega.errors import SpadeError
from spade_mega.envs.sandbox import SandboxPool
from spade_mega.megatron.batch import TrainSample
from spade_mega.megatron.checkpoint import CheckpointError
from spade_mega.megatron.offload import offloads_trainer
from spade_mega.megatron.parallel import init_distributed
from spade_mega.megatron.reference import check_reference
from spade_mega.megatron.train import StepResult, Trainer
from spade_mega.monitor import MetricsLogger, RunProgress, require_wandb, setup_logging, transcripts
from spade_mega.monitor.records import METRICS_FILE, scan
from spade_mega.rl.delayed import DelayedDesignerBuffer, DesignerSample, ReleasedDesignerSample
from spade_mega.selfplay.batch import (
    Trajectory,
    advantages,
    filter_zero_std_groups,
    optimizer_batches,
    train_samples,
)
from spade_mega.selfplay.lock import RunDirLock
from spade_mega.selfplay.state import (
    ActiveEnv,
    CheckpointStore,
    LoopState,
    ResumeError,
    derive_seed,
    regeneration_change,
)
from spade_mega.selfplay.transcripts import RolloutTranscript
from spade_mega.tokenizer import check_folder_tokenizer

if TYPE_CHECKING:
    from spade_mega.bridge.sync import SyncStats

log = logging.getLogger("spade_mega.selfplay")
T = TypeVar("T")


class RankZeroError(SpadeError):
    """Rank 0 (which alone runs the actor) failed; raised on the other ranks, naming rank 0's error."""


class RankZeroCheckpointError(RankZeroError, CheckpointError):
    """Rank 0's part of a save (the loop state) failed: a failed save on the other ranks too, so they stop with the
    same advice on how to go on."""


# how a save's failure says it ran out of host memory (a MemoryError staging tensors, the OOM killer's SIGKILL of a
# background writer, a fork refused with ENOMEM), where freeing disk space would not help
_OUT_OF_MEMORY = ("MemoryError", "OOM killer", "Cannot allocate memory")

# train-step metrics that add up over the optimizer steps of a rollout; the others are averaged
_SUMMED = ("loss_tokens", "tokens", "step_time_s", "micro_batches", "samples_agent", "samples_designer")


@dataclass(frozen=True)
class RunSummary:
    """What :func:`run` did: the run directory, where it started and ended, and the report it wrote."""

    run_dir: Path
    resumed_from: Optional[int]  # the rollout of the checkpoint resumed from; None for a new run
    rollouts: int  # rollouts completed, in all
    report: Optional[Path]
    stopped: bool = False  # stopped early on SIGUSR1, after saving: run again to resume


class _StopSignal:
    """SIGUSR1 asks the loop to finish the rollout in progress, save and stop: it is SLURM's time-limit warning, which
    the job script (spade-mega launch slurm) passes to every rank before it requeues the job, so the requeued job
    resumes from that rollout instead of the last periodic checkpoint. The ranks agree at the end of each rollout
    (a rank the signal reached stops them all at the same rollout)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> "_StopSignal":
        if threading.current_thread() is threading.main_thread():  # Python handles signals on the main thread only
            self._previous = signal.signal(signal.SIGUSR1, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor([float(self.requested)], device=device)
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGUSR1, self._previous)


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


@dataclass
class _Played:
    """One rollout as rank 0 played it: what every rank trains on (``samples``, ``metrics``), and what the actor
    settles once that training is known (the transcript, the trajectories and their advantages). Carried per rollout,
    so that the rollout ahead (``selfplay.async_rollouts``) playing while this one trains leaves it alone."""

    samples: list[TrainSample]
    metrics: dict[str, float]
    transcript: RolloutTranscript
    trajectories: list[Trajectory]
    values: Optional[torch.Tensor]
    # the designer rewards it paid, (environment, the rollout of its evaluation, reward): written to the memory once
    # the loop keeps the rollout (_Actor.keep). They go to evaluations of earlier rollouts, which a discard after the
    # rollout before keeps: a rollout ahead abandoned at a stop must not have written them.
    rewards: list[tuple[str, int, float]] = field(default_factory=list)


class _Abandoned(Exception):
    """The loop abandoned the rollout ahead (a stop): raised at its next engine call."""


class _Abandonable:
    """The engine as the rollouts call it with ``selfplay.async_rollouts``: a generation asked for once ``abandon`` is
    set raises :class:`_Abandoned` instead, so an abandoned rollout ends after the engine call in flight rather than
    playing to its end."""

    def __init__(self, engine: Any, abandon: threading.Event) -> None:
        self.engine, self.abandon = engine, abandon

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def generate(self, requests: Sequence[Any]) -> list[Any]:
        if self.abandon.is_set():
            raise _Abandoned("the loop abandoned this rollout")
        return self.engine.generate(requests)


class _Actor:
    """Rank 0's side of the loop: engine, sandbox, memory, curriculum, the delayed buffer; produces the samples."""

    def __init__(self, cfg: SpadeConfig, run_dir: Path) -> None:
        from spade_mega.inference import build_engine, releases_memory
        from spade_mega.evaluation import Evaluator
        from spade_mega.rollout import Rollout
        from spade_mega.tokenizer import load_tokenizer

        self.cfg, self.run_dir = cfg, run_dir
        self.closing: list[Any] = []
        self.writer = transcripts.BackgroundWriter()
        # selfplay.async_rollouts: the thread that plays the rollout ahead, which rank 0's loop thread collects (or
        # abandons: the rollout's engine calls then raise _Abandoned)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="spade-rollout") \
            if cfg.selfplay.async_rollouts else None
        self.abandon = threading.Event()
        self.ahead: Optional[tuple[int, LoopState, "Future[_Played]"]] = None
        try:
            self.fixed = _fixed_programs(cfg.selfplay.environments)
            tokenizer = load_tokenizer(cfg.model.tokenizer)
            registry = SkillRegistry.from_config(cfg.curriculum)
            self.scheduler = SkillScheduler(registry, cfg.curriculum.active_skills)
            # the corpus grounds designer prompts: an agent-only run (selfplay.environments) writes none
            self.sampler: Optional[GroundingSampler] = None if self.fixed else GroundingSampler(
                Corpus.build(cfg.curriculum.corpus), registry.domains(), tokenizer, cfg.curriculum.corpus.token_budget,
                cfg.run.seed)
            self.memory = EnvMemory.for_run(cfg.curriculum.memory, run_dir)
            self.closing.append(self.memory)
            self.pool = SandboxPool(cfg.sandbox)
            self.closing.append(self.pool)
            self.engine = build_engine(cfg, tokenizer)
            self.closing.append(self.engine)
            self.releases_memory = releases_memory(cfg)
            played_on = self.engine if self.executor is None else _Abandonable(self.engine, self.abandon)
            self.rollouts = Rollout(cfg, played_on, self.pool, PromptBuilder.from_config(cfg, tokenizer))
            # its suites are read (and checked) now, so a missing data file fails before the first rollout
            self.evaluator = Evaluator(cfg, self.engine, tokenizer, self.pool) \
                if cfg.eval.interval or cfg.eval.before_train else None
        except BaseException:
            self.close()
            raise
        self.buffer = DelayedDesignerBuffer(cfg.rewards, cfg.selfplay.designer_delay)
        self.trackers = SkillTrackers.from_config(cfg.rewards)
        self.environments: list[ActiveEnv] = []
        self.active_skills: list[str] = []
        self.set_stale = False  # the environment set restored is not the one the config sets now: regenerate at once
        r = cfg.rollout
        self.designer_scale = env_reward_scale(r.envs_per_rollout * r.agent_trajectories_per_env,
                                               r.envs_per_rollout, cfg.selfplay.regen_interval,
                                               cfg.rewards.env_reward_scale_cap)

    def close(self) -> None:
        try:
            if self.executor is not None:  # a rollout ahead stops at its next engine call: no thread outlives the run
                self.abandon.set()
                self.executor.shutdown(wait=True, cancel_futures=True)  # one submitted, not started: never runs
            self.writer.wait()
        finally:  # a failed transcript write (raised here) leaves no sandbox worker or engine running
            for part in reversed(self.closing):
                part.close()
            self.closing = []

    # --- state ------------------------------------------------------------------------------------------------

    def state(self, rollout: int, policy_version: int) -> LoopState:
        """The loop state after ``rollout``, the engine serving the weights of trainer step ``policy_version``."""
        return LoopState(rollout=rollout, policy_version=policy_version, active_skills=list(self.active_skills),
                         environments=list(self.environments), buffer=self.buffer.state_dict(),
                         scheduler=self.scheduler.state_dict(), trackers=self.trackers.state_dict(),
                         regen_interval=self.cfg.selfplay.regen_interval)

    def restore(self, state: LoopState) -> None:
        """The loop state of a checkpoint; the memory forgets what the rollouts after it wrote."""
        self.buffer.load_state_dict(state.buffer)
        self.scheduler.load_state_dict(state.scheduler)
        self.trackers.load_state_dict(state.trackers)
        self.environments, self.active_skills = list(state.environments), list(state.active_skills)
        change = regeneration_change(state, self.cfg.selfplay.regen_interval)
        if change is not None:
            log.warning("resume: %s", change)
        stale = _fixed_set_change(state, self.fixed)
        if stale is not None:
            log.warning("resume: %s", stale)
            self.set_stale = True
        discarded = self.memory.discard_after(state.rollout)
        if any(discarded.values()):
            log.info("memory: discarded %d environment(s) and %d evaluation(s) written after rollout %d (played "
                     "again from there)", discarded["environments"], discarded["evaluations"], state.rollout)
        if transcripts.discard_after(self.run_dir, state.rollout):
            log.info("transcripts: discarded those of the rollouts after %d (played again from there)", state.rollout)

    def evaluate(self) -> dict[str, float]:
        """Held-out scores of the weights the engine serves now (``eval/<suite>/<metric>``), and the time taken."""
        from spade_mega.evaluation import log_metrics

        assert self.evaluator is not None  # built whenever eval.interval or eval.before_train asks for evaluations
        started = time.perf_counter()
        values = log_metrics(self.evaluator.evaluate())
        values["time/eval_s"] = time.perf_counter() - started
        return values

    # --- one rollout ------------------------------------------------------------------------------------------

    def rollout(self, r: int) -> "_Played":
        """Play rollout ``r`` (regenerating first when it is due): the samples to train on, the metrics, and what
        :meth:`trained` settles once their training is known."""
        began = time.perf_counter()
        metrics: dict[str, float] = {}
        version = self.engine.weight_version  # no sync runs while a rollout plays (SelfPlay._run)
        self.clear_prefix_cache()
        transcript = RolloutTranscript(self.cfg, r, self.rollouts.chat.tokenizer)
        if (r - 1) % self.cfg.selfplay.regen_interval == 0 or self.set_stale:
            started = time.perf_counter()
            metrics.update(self.regenerate(r, transcript))
            metrics["time/regenerate_s"] = time.perf_counter() - started
        started = time.perf_counter()
        trajectories, play_metrics = self.play(r, transcript)
        metrics.update(play_metrics)
        metrics["time/play_s"] = time.perf_counter() - started
        released = self.buffer.release(r, self.trackers)
        transcript.released(released)
        rewards: list[tuple[str, int, float]] = []
        trajectories += self.designer_trajectories(released, metrics, rewards)
        if self.cfg.rl.filter_zero_std_groups:
            trajectories = self.filter_groups(r, trajectories, metrics)
        samples: list[TrainSample] = []
        values: Optional[torch.Tensor] = None
        if trajectories:
            values = advantages(trajectories, self.designer_scale, self.cfg.rl, self.cfg.kernels)
            samples = train_samples(trajectories, values)
        metrics["envs/count"] = float(len(self.environments))
        metrics["envs/designer"] = float(sum(e.origin == "designer" for e in self.environments))
        metrics["envs/library"] = float(sum(e.origin == "library" for e in self.environments))
        metrics["envs/fixed"] = float(sum(e.origin == "fixed" for e in self.environments))
        metrics["designer/pending"] = float(len(self.buffer))
        metrics["memory/environments"] = float(len(self.memory))
        # a server engine's redone requests and restarted servers since the run started (docs/inference_servers.md)
        metrics.update({f"inference/{key}": float(n) for key, n in getattr(self.engine, "recoveries", {}).items()})
        self.clear_prefix_cache()
        if self.releases_memory:  # the trainer steps next on the same GPUs; every rank waits for this rollout
            started = time.perf_counter()
            self.engine.release_memory()
            metrics["time/engine_release_s"] = time.perf_counter() - started
        metrics["rollout/weight_version"] = float(version)
        metrics["time/rollout_s"] = time.perf_counter() - began
        return _Played(samples, metrics, transcript, trajectories, values, rewards)

    def filter_groups(self, r: int, trajectories: list[Trajectory], metrics: dict[str, float]) -> list[Trajectory]:
        """``rl.filter_zero_std_groups``: the agent groups whose rewards are all equal marked filtered (not trained
        on), counted in ``agent/filtered_groups`` and ``agent/filtered_episodes`` and left out of
        ``agent/trained_episodes``. Only what is trained changes: the plays were measured (returns, win rates,
        regret, memory, trackers, the designer's reward) in :meth:`play`."""
        marked, groups = filter_zero_std_groups(trajectories)
        filtered = float(sum(t.filtered for t in marked))
        metrics["agent/filtered_groups"] = float(groups)
        metrics["agent/filtered_episodes"] = filtered
        metrics["agent/trained_episodes"] = metrics.get("agent/trained_episodes", 0.0) - filtered
        if groups and not any(t.trains for t in marked):
            log.info("rollout %d: every agent group's rewards are all equal (rl.filter_zero_std_groups) and no "
                     "designer sample trains: nothing to train on, no optimizer step", r)
        return marked

    def clear_prefix_cache(self) -> None:
        """Empty the hf engine's prefix cache (servers promise no bitwise replay) around a rollout. Before it: an
        evaluation after the last checkpoint left its sequences there, a run resumed from that checkpoint has none,
        and a prefix taken from them changes the rollout's log-probs in the last bits. After it: the trainer steps
        next (on the same GPU) and the weight sync would drop them anyway."""
        from spade_mega.inference import PrefixCaching

        if isinstance(self.engine, PrefixCaching):
            self.engine.clear_prefix_cache()

    def trained(self, played: "_Played", updated: Sequence[bool]) -> None:
        """The rollout's transcript, once its training is known (``updated[k]``: whether the optimizer step that held
        the rollout's k-th sample was applied), compressed in the background while the weights sync and the next
        rollout plays."""
        if played.values is not None:
            played.transcript.settle(played.trajectories, played.values, updated)
        self.writer.submit(played.transcript.write, self.run_dir)

    def keep(self, played: "_Played") -> None:
        """The rollout is the one the loop trains on next: the designer rewards it paid go to the memory (on the
        loop's thread, no rollout playing ahead). A rollout ahead abandoned at a stop never gets here."""
        for env_id, step, reward in played.rewards:
            self.memory.set_designer_reward(env_id, step, reward)

    # --- the rollout ahead (selfplay.async_rollouts) -----------------------------------------------------------

    def start_ahead(self, r: int) -> None:
        """Start playing rollout ``r`` on the actor's thread (the loop trains on ``r - 1`` meanwhile), after taking
        the loop state as rollout ``r - 1`` left it: a stop saves that, not what ``r`` changes."""
        assert self.ahead is None and self.executor is not None  # one at a time, only with selfplay.async_rollouts
        # a snapshot: the state_dicts copy what they hold, the lists are copied, the environments are frozen records
        before = self.state(r - 1, policy_version=0)  # the version is the loop's to fill in
        self.ahead = (r, before, self.executor.submit(self.rollout, r))

    def collect_ahead(self) -> "_Played":
        """The rollout ahead, once played (waiting for it); its error, raised here, on the loop's thread."""
        assert self.ahead is not None
        _, _, future = self.ahead
        try:
            return future.result()
        finally:
            self.ahead = None

    def saved_state(self, rollout: int, policy_version: int) -> LoopState:
        """What a checkpoint after ``rollout`` saves: the loop state now, or with a rollout ahead (a stop while it
        plays), the state taken before it started."""
        if self.ahead is None:
            return self.state(rollout, policy_version)
        assert self.ahead[1].rollout == rollout
        return replace(self.ahead[1], policy_version=policy_version)

    def abandon_ahead(self) -> None:
        """Stop the rollout ahead at its next engine call (the call in flight finishes), wait for it, and put the
        loop state back as the rollout before it left it: its memory rows are dropped, its transcript was never
        written. Nothing if none is ahead."""
        if self.ahead is None:
            return
        r, before, future = self.ahead
        self.abandon.set()
        try:
            future.result()
        except _Abandoned:
            pass
        except Exception as exc:  # the run stops anyway (its checkpoint is saved): say what it was
            log.warning("rollout %d, abandoned, had failed: %s: %s", r, type(exc).__name__, exc)
        finally:
            self.ahead = None
            self.abandon.clear()
        self.restore(before)

    def regenerate(self, r: int, transcript: RolloutTranscript) -> dict[str, float]:
        """A new environment set: designer outputs, validated, proposed to memory, queued for their reward."""
        from spade_mega.rollout import DesignerSlot

        self.set_stale = False
        if self.fixed:
            return self.fixed_set(r)
        assert self.sampler is not None  # built whenever the designer writes the set
        cfg, mem = self.cfg, self.cfg.curriculum.memory
        self.active_skills = self.scheduler.next_active()
        slots = []
        for i in range(cfg.rollout.envs_per_rollout):
            skill = self.active_skills[i % len(self.active_skills)]
            slots.append(DesignerSlot(
                skill=skill, document=self.sampler.sample(skill, r, i),
                seeds=tuple(self.memory.seeds(skill, mem.seeds_per_prompt, mem.prompt_window)),
                negatives=tuple(self.memory.negatives(skill, mem.negatives_per_prompt, mem.prompt_window)),
                sampling_seed=derive_seed(cfg.run.seed, "designer", r, i)))
        batch = self.rollouts.design(slots, iteration=r)
        outcomes = batch.outcomes
        programs: dict[int, EnvProgram] = {}
        for i, outcome in enumerate(outcomes):
            if outcome.program is not None:
                p = outcome.program
                programs[i] = EnvProgram(p.source, p.hint, p.skill, {**p.provenance, "slot": i})
        self.memory.propose_many(programs.values())
        for i, program in programs.items():
            report = outcomes[i].validation
            self.memory.set_validation(program.content_hash, outcomes[i].valid,
                                       None if report is None or report.reason is None else report.reason.value,
                                       iteration=r)
        for i, outcome in enumerate(outcomes):
            seq = outcome.sequence
            sample = DesignerSample(
                sample_id=f"r{r}-s{i}", env_id=programs[i].content_hash if i in programs else f"unparsed-r{r}-s{i}",
                skill=outcome.skill, step=r, policy_version=seq.policy_version or 0, token_ids=seq.token_ids,
                loss_mask=seq.loss_mask, behaviour_logprobs=seq.behaviour_logprobs, failure=outcome.failure,
                metadata={"slot": i, "valid": outcome.valid, "rejection": outcome.rejection})
            self.buffer.add(sample)
            transcript.designer_output(outcome, sample, slots[i])

        self.environments = []
        seen: set[str] = set()
        for i, outcome in enumerate(outcomes):
            if outcome.valid and programs[i].content_hash not in seen:
                seen.add(programs[i].content_hash)
                self.environments.append(ActiveEnv(programs[i], "designer", i, r))
        library_envs = self.library_fill(r, {e.slot for e in self.environments}, seen) \
            if cfg.selfplay.library_fallback else []
        self.environments = sorted(self.environments + library_envs, key=lambda e: e.slot)

        valid = sum(o.valid for o in outcomes)
        metrics = {"designer/valid_rate": valid / len(outcomes), "designer/outputs": float(len(outcomes)),
                   "designer/parsed": float(len(programs)), "designer/output_tokens":
                   _mean([float(o.sequence.num_generated) for o in outcomes]),
                   "designer/library_fill": float(len(library_envs))}
        metrics.update(batch.stats.metrics("perf/designer"))
        metrics.update(_rejection_metrics(outcomes))
        return metrics

    def library_fill(self, r: int, filled: set[int], seen: set[str]) -> list[ActiveEnv]:
        """Library programs of the active skills for the slots without a valid designer environment, each checked
        by the validator like a designer's (cheap, and a broken library render must not reach the agent)."""
        chosen: list[tuple[int, EnvProgram]] = []
        for i in range(self.cfg.rollout.envs_per_rollout):
            skill = self.active_skills[i % len(self.active_skills)]
            if i in filled or skill not in library.SKILLS:
                continue
            entries = [e for e in library.by_skill(skill)
                       if e.program().content_hash not in seen | {p.content_hash for _, p in chosen}]
            if not entries:
                continue
            entry = random.Random(derive_seed(self.cfg.run.seed, "library", r, i)).choice(entries)
            p = entry.program()
            chosen.append((i, EnvProgram(p.source, p.hint, p.skill, {**p.provenance, "iteration": r, "slot": i})))
        envs = []
        for (i, program), report in zip(chosen, self._validated(chosen, r)):
            if report.ok:
                envs.append(ActiveEnv(program, "library", i, r))
            else:
                log.warning("library program %s failed validation (%s: %s); its slot stays empty",
                            program.provenance.get("name"), report.reason.value if report.reason else "", report.detail)
        return envs

    def fixed_set(self, r: int) -> dict[str, float]:
        """``selfplay.environments`` (the designer off): the same programs at every regeneration, each checked by the
        validator like a designer's; one that fails stops the run, naming its file."""
        chosen = [(i, EnvProgram(p.source, p.hint, p.skill, {**p.provenance, "iteration": r, "slot": i}))
                  for i, p in enumerate(self.fixed)]
        for (i, program), report in zip(chosen, self._validated(chosen, r)):
            if not report.ok:
                raise ConfigError(f"selfplay.environments[{i}].path",
                                  f"{program.provenance['path']} is not a valid environment program "
                                  f"({report.reason.value if report.reason else ''}: {report.detail})")
        self.active_skills = list(dict.fromkeys(p.skill for _, p in chosen))
        self.environments = [ActiveEnv(program, "fixed", i, r) for i, program in chosen]
        return {}

    def _validated(self, chosen: Sequence[tuple[int, EnvProgram]], r: int) -> list[Any]:
        """The validator's reports of programs the designer did not write (library, fixed), which are proposed to the
        memory with their verdict. No solvability check: the library's programs are solved by their scripted oracles
        (tests/test_env_library_sandbox.py plays each to its target return), fixed ones are the user's choice."""
        reports = self.rollouts.validator.validate_many([p for _, p in chosen], solvability=False)
        self.memory.propose_many(p for _, p in chosen)
        for (_, program), report in zip(chosen, reports):
            self.memory.set_validation(program.content_hash, report.ok,
                                       None if report.reason is None else report.reason.value, iteration=r)
        return reports

    def play(self, r: int, transcript: RolloutTranscript) -> tuple[list[Trajectory], dict[str, float]]:
        """Every environment's plays; agent trajectories to train on, plays recorded in buffer, memory, trackers. A
        program that breaks in play (a call raises or hangs) leaves the set, marked failed in the buffer (the designer's
        penalty) and invalid in the memory; a listed one (``selfplay.environments``) stays, named in a warning: it is
        the set, so the run would train on nothing until the next regeneration. A play its program broke is no
        measurement of the agent (``AgentEpisode.measured``): it is counted in ``agent/broken_plays`` and left out of
        the returns, win rates and regret, the trackers, the memory's evaluation (none when no play without the hint
        measured the agent) and the buffer's plays."""
        from spade_mega.rollout import AgentPlay

        cfg, seed = self.cfg, self.cfg.run.seed
        plays = []
        for e, env in enumerate(self.environments):
            reset_seed = derive_seed(seed, "reset", r, e)
            for hinted, count in ((False, cfg.rollout.agent_trajectories_per_env),
                                  (True, cfg.rollout.hint_plays_per_env)):
                plays += [AgentPlay(env.env_id, env.program, reset_seed, hinted=hinted,
                                    sampling_seed=derive_seed(seed, "hint" if hinted else "agent", r, e, k))
                          for k in range(count)]
        if not plays:
            return [], {}
        batch = self.rollouts.play(plays)
        episodes = batch.episodes
        transcript.episodes(self.environments, episodes)
        trajectories, agent_returns, hint_returns, failures, broken, played = [], [], [], 0, 0, 0
        turns: list[float] = []  # of the plays agent/return averages
        regrets, by_skill, failed = [], {}, set()
        for e, env in enumerate(self.environments):
            mine = [ep for ep in episodes if ep.env_id == env.env_id]
            agent = [ep.reward for ep in mine if not ep.hinted and ep.measured]
            hint = [ep.reward for ep in mine if ep.hinted and ep.measured]
            played += sum(not ep.hinted for ep in mine)
            broken += sum(not ep.measured for ep in mine)
            agent_returns += agent
            hint_returns += hint
            turns += [float(ep.turns) for ep in mine if not ep.hinted and ep.measured]
            by_skill.setdefault(env.skill, []).extend(agent)
            if env.env_id in self.buffer:
                if agent:
                    self.buffer.record_plays(env.env_id, r, agent)
                if hint:
                    self.buffer.record_plays(env.env_id, r, hint, hinted=True)
            broke = [ep.designer_failure for ep in mine if ep.designer_failure is not None]
            failures += len([ep for ep in mine if ep.failure is not None])
            if broke:
                timed_out = "step_timeout" in broke
                if env.origin == "fixed":  # listed by the user, it is the set: it stays, named (it does not improve)
                    fault = next(ep for ep in mine if ep.program_fault is not None)
                    log.warning("rollout %d: selfplay.environments[%d] (%s) broke in %d of its %d plays (%s: %s); "
                                "it stays in the set, those plays are not trained on", r, env.slot,
                                env.program.provenance.get("path"), len(broke), len(mine),
                                fault.program_fault.value, fault.failure_detail)
                else:
                    failed.add(env.env_id)
                if env.env_id in self.buffer:
                    self.buffer.mark_failed(env.env_id, "step_timeout" if timed_out else broke[0])
                # invalid, with the reason validation would have given: its plays stay recorded, but a program that
                # breaks is no seed for the designer (one whose hint plays win has a high regret)
                self.memory.set_validation(env.env_id, False,
                                           (Reason.TIMEOUT if timed_out else Reason.PROGRAM_ERROR).value, iteration=r)
            # rates count wins (rewards.win_threshold); regret is SPADE's difference of mean returns, measured where
            # plays with and without the hint were: without a measured hint play (none configured, or every one
            # broken) the memory records no win rate with the hint and no regret (NULL), not copies of the agent's
            regret = _mean(hint) - _mean(agent) if hint and agent else None
            if regret is not None:
                regrets.append(regret)
            if agent:
                rate = win_rate(agent, cfg.rewards)
                self.memory.record_evaluation(env.env_id, r, win_rate=rate,
                                              win_rate_hint=win_rate(hint, cfg.rewards) if hint else None,
                                              plays=len(agent), hint_plays=len(hint), regret=regret)
            trajectories += [Trajectory(ep.sequence.token_ids, ep.sequence.loss_mask, ep.sequence.behaviour_logprobs,
                                        "agent", ep.reward, f"env{e}") for ep in mine if ep.trainable]
        for skill, returns in by_skill.items():
            if returns:
                self.trackers.update(skill, win_rate(returns, cfg.rewards))
        if failed:  # a program that broke in play teaches nothing more until the next regeneration
            log.warning("rollout %d: %d environment(s) failed in the sandbox and leave the set", r, len(failed))
            self.environments = [env for env in self.environments if env.env_id not in failed]
        metrics = {"agent/episodes": float(played),
                   "agent/trained_episodes": float(len(trajectories)),
                   "agent/failed_episodes": float(failures),
                   "agent/broken_plays": float(broken)}
        if agent_returns:  # none when every play without the hint broke: nothing measured
            metrics["agent/return"] = _mean(agent_returns)
            metrics["agent/turns"] = _mean(turns)  # the same plays: hint plays and broken ones are no measurement
            metrics["agent/win_rate"] = win_rate(agent_returns, cfg.rewards)
        if regrets:  # regret is measured by hint plays: without any (agent-only training) there is none to log
            metrics["designer/regret"] = _mean(regrets)
        if hint_returns:
            metrics["agent/hint_return"] = _mean(hint_returns)
            metrics["agent/hint_win_rate"] = win_rate(hint_returns, cfg.rewards)
        metrics.update(batch.stats.metrics("perf/agent"))
        return trajectories, metrics

    def designer_trajectories(self, released: Sequence[ReleasedDesignerSample], metrics: dict[str, float],
                              rewards: list[tuple[str, int, float]]) -> list[Trajectory]:
        """The released designer samples as trajectories of their skill; their rewards, for the memory, to
        ``rewards`` (written by :meth:`keep`)."""
        out = []
        for item in released:
            s, reward = item.sample, item.reward
            out.append(Trajectory(s.token_ids, s.loss_mask, s.behaviour_logprobs, "designer", reward.value,
                                  s.skill, valid=not reward.masked))
            # an environment whose every play without the hint broke at its regeneration has no evaluation there
            if s.metadata.get("valid") and not reward.masked and self.memory.evaluated(s.env_id, s.step):
                rewards.append((s.env_id, s.step, reward.value))
        if released:
            paid = [item.reward.value for item in released if not item.reward.masked]
            metrics["designer/released"] = float(len(released))
            metrics["designer/masked"] = float(len(released) - len(paid))
            metrics["designer/penalised"] = float(sum(item.sample.failure is not None for item in released))
            if paid:
                metrics["designer/reward"] = _mean(paid)
        return out


class SelfPlay:
    """One run of the loop on this rank. ``run()`` resumes as ``run.resume`` says, runs the remaining rollouts and
    writes the report; construct it on every rank of the job."""

    def __init__(self, cfg: SpadeConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run.output_dir) / cfg.run.name
        self.store = CheckpointStore(self.run_dir)
        self.on_disk: Optional[int] = None  # the trainer step whose checkpoint this run saved or resumed from last
        self.served = 0  # the weight version the engine serves: the trainer step of the last update sent to it
        # the version a sync labels the trainer's weights with: the trainer step of the last rollout that changed them
        self.trained_version = 0
        self.policy_lag = 0  # trained_version minus the version that played the rollout in training (0: the same)
        self.reference: Optional[str] = None  # the step folder of a checkpoint root named in rl.reference
        from spade_mega.inference import releases_memory

        # parallel.offload_trainer: the trainer's memory released while the engine generates (_offload)
        self.offloading = offloads_trainer(cfg.parallel.offload_trainer, releases_memory(cfg))

    def _steps_per_rollout(self) -> int:
        """Optimizer steps planned per rollout: every environment's agent plays and one designer sample per slot (none
        with ``selfplay.environments``: no designer)."""
        r, s = self.cfg.rollout, self.cfg.selfplay
        designer = 0 if s.environments else 1
        return math.ceil(r.envs_per_rollout * (r.agent_trajectories_per_env + designer) / s.global_batch_size)

    def _steps_estimate(self) -> int:
        """Optimizer steps planned for the whole run: a decaying learning-rate schedule's horizon (_train keeps the
        schedule on this plan)."""
        return self.cfg.selfplay.num_rollouts * self._steps_per_rollout()

    def _checkpoint_to_resume(self) -> Optional[Path]:
        latest = self.store.latest()
        mode = self.cfg.run.resume
        if mode == "never" and latest is not None:
            raise ResumeError(f"{self.store.root} holds checkpoints (newest {latest.name}) but run.resume is never: "
                              "a new run would overwrite them; give the run another run.name (or run.output_dir), "
                              "move the folder away, or resume with run.resume: auto")
        if mode == "must" and latest is None:
            raise ResumeError(f"run.resume is must but {self.store.root} holds no complete checkpoint to resume "
                              "from; check run.output_dir and run.name, or use run.resume: auto")
        return latest

    def _start_actor(self) -> "_Actor":
        prepare_run_dir(self.cfg)
        return _Actor(self.cfg, self.run_dir)

    def run(self) -> RunSummary:
        cfg = self.cfg
        setup_logging(cfg.logging)
        require_wandb(cfg.logging.wandb)  # on every rank, before anything is built: a missing extra fails them alike
        with _StopSignal() as stop:  # from the start: a time-limit warning while the trainer builds stops at rollout 1
            checkpoint = self._checkpoint_to_resume()
            if checkpoint is None and cfg.inference.hf_weights is not None:  # before anything is built or written
                check_folder_tokenizer(cfg.inference.hf_weights, cfg.model.tokenizer)
            world = init_distributed(cfg.parallel)  # before the lock, so that every rank gets its error
            check_reference(cfg, checkpoint, world)  # rl.kl_coef > 0: a reference prepare_reference would refuse
            # rank 0 alone writes the run directory; a second trainer on it stops here, before the model is built
            lock = _from_rank0(lambda: RunDirLock(self.run_dir), share=False)
            try:
                state = self.store.read_state(checkpoint) if checkpoint is not None else None
                # the metrics sinks start before the model is built: a new run whose W&B cannot start stops here, in
                # seconds, every rank naming rank 0's error (an online wandb.init takes it a few seconds)
                with self._open_metrics(state.rollout if checkpoint is not None and state is not None else None) \
                        as metrics:
                    trainer = Trainer(cfg, total_steps=self._steps_estimate())
                    actor: Optional[_Actor] = None
                    try:  # closed finished or failed: a process running several runs (a sweep) keeps none of them
                        actor = _from_rank0(self._start_actor, share=False)
                        return self._run(trainer, actor, checkpoint, state, stop, metrics)
                    except BaseException:
                        trainer.abandon_save()
                        raise
                    finally:
                        try:
                            if actor is not None:
                                actor.close()
                        finally:
                            trainer.close()
            finally:
                if lock is not None:
                    lock.close()

    def _open_metrics(self, resume_step: Optional[int]) -> MetricsLogger:
        """The run's metrics logger on every rank, rank 0's writing; a sink failing to start there stops every rank."""
        opened = _from_rank0(lambda: MetricsLogger(self.run_dir, self.cfg.logging, resume_step=resume_step,
                                                   run_config=to_dict(self.cfg)), share=False)
        return opened if opened is not None else MetricsLogger(self.run_dir, self.cfg.logging, resume_step=resume_step)

    def _run(self, trainer: Trainer, actor: Optional[_Actor], checkpoint: Optional[Path],
             state: Optional[LoopState], stop: _StopSignal, metrics: MetricsLogger) -> RunSummary:
        from spade_mega.bridge import load_hf, sync_weights
        from spade_mega.megatron.reference import pinned_reference, prepare_reference

        cfg = self.cfg
        start = 0
        # one step folder for the whole run, chosen by rank 0 (the ranks read the same), recorded in its loop states
        recorded = state.reference if checkpoint is not None and state is not None else None
        self.reference = _from_rank0(lambda: pinned_reference(cfg, recorded), share=True)
        # rl.kl_coef > 0: before a checkpoint replaces the initial weights
        prepare_reference(trainer, checkpoint, self.reference)
        if checkpoint is not None and state is not None:
            trainer.load(str(checkpoint))
            self.on_disk = trainer.step
            self.served = state.policy_version  # the version the interrupted run's engine served these weights as
            start = state.rollout
            if actor is not None:
                actor.restore(state)
            log.info("resumed from %s (rollout %d, optimizer step %d)", checkpoint, start, trainer.step)
        elif cfg.inference.hf_weights is not None:
            # a new run starts the trainer from the weights the engine serves (the first sync would otherwise
            # replace them with the trainer's random initialisation); a resumed run takes its checkpoint's
            load_hf(trainer, cfg.inference.hf_weights)
            log.info("initial weights from %s", cfg.inference.hf_weights)
        if checkpoint is None and actor is not None:  # an attempt that never saved starts over, so does its memory
            discarded = actor.memory.discard_after(0)
            if any(discarded.values()):
                log.warning("memory %s: discarded %d environment(s) and %d evaluation(s) of an earlier attempt of "
                            "this run that saved no checkpoint (the run starts over from rollout 1)",
                            actor.memory.path, discarded["environments"], discarded["evaluations"])
            if transcripts.discard_after(self.run_dir, 0):
                log.warning("transcripts of an earlier attempt of this run discarded (it saved no checkpoint)")
        if checkpoint is None:
            self.served = trainer.step
        sync_weights(trainer, actor.engine if actor is not None else None, self.served)
        if self.offloading:  # the engine generates first (an evaluation, the first rollout)
            self._offload(trainer, actor, None)
        self.trained_version = self.served
        total = cfg.selfplay.num_rollouts
        done, stopped = start, False
        with RunProgress(total, "rollouts", cfg=cfg.logging, start=start) as bar:
            if cfg.eval.before_train and checkpoint is None:  # the starting weights, at step 0
                metrics.log(0, _from_rank0(lambda: actor.evaluate(), share=True))
            if checkpoint is not None and self._evaluation_missing(start):
                log.info("resume: evaluating the checkpoint of rollout %d first (the interrupted job stopped before "
                         "its scores were logged)", start)
                metrics.log(start, _from_rank0(lambda: actor.evaluate(), share=True))
            played: Optional[_Played] = None  # rank 0's record of the rollout being trained on
            unsynced: Optional[bool] = None  # trained while the rollout ahead played: whether a step changed them

            def obtain(r: int) -> tuple[list[TrainSample], dict[str, float]]:  # rank 0
                nonlocal played
                started = time.perf_counter()
                played = actor.collect_ahead() if actor.ahead is not None else actor.rollout(r)
                actor.keep(played)  # the rollout thread is idle: no rollout ahead plays yet
                played.metrics["time/rollout_wait_s"] = time.perf_counter() - started
                return played.samples, played.metrics

            def sync(values: dict[str, float], changed: bool) -> None:
                synced = self._sync(trainer, actor, values, changed=changed)
                if synced is not None:
                    self.trained_version = synced.version  # an engine that released its memory: a new label
                    values["time/sync_s"] += synced.seconds
                    values["perf/sync_mb_per_s"] = synced.mb_per_s

            for r in range(start + 1, total + 1):
                began = time.perf_counter()
                samples, values = _from_rank0(lambda: obtain(r), share=True)
                values["time/sync_s"] = 0.0
                if unsynced is not None:  # the engine is free again: the weights trained during the rollout ahead
                    sync(values, unsynced)
                    unsynced = None
                ahead = cfg.selfplay.async_rollouts and not self._drains(r)
                if ahead:  # played by the weights the engine serves now, while the ranks train on r
                    _from_rank0(lambda: actor.start_ahead(r + 1), share=False)
                self.policy_lag = self.trained_version - int(values["rollout/weight_version"])
                values["rollout/policy_lag"] = float(self.policy_lag)
                if self.offloading:  # the engine released its memory at the end of the rollout: the trainer's turn
                    values["time/trainer_reload_s"] = trainer.offloader.reload()
                train_metrics, updated = self._train(trainer, samples, r)
                values.update(train_metrics)
                if any(updated):
                    self.trained_version = trainer.step
                _from_rank0(lambda: actor.trained(played, updated), share=False)
                stopped = stop.agreed(trainer.backend.device) and r < total
                if not ahead:
                    sync(values, any(updated))
                elif stopped:  # the engine plays the rollout ahead, abandoned once saved: not synced, the job stops
                    self.served = self.trained_version  # the version the sync would have served
                else:
                    unsynced = any(updated)
                if r % cfg.selfplay.save_interval == 0 or r == total or stopped:
                    started = time.perf_counter()
                    with self._saving(metrics, r, values):
                        self._complete_save(trainer, actor, values, wait=True)  # one being written completes first
                        self._save(trainer, actor, r,
                                   background=cfg.selfplay.async_save and not (r == total or stopped))
                    values["time/checkpoint_s"] = time.perf_counter() - started  # the part training waited for
                elif cfg.selfplay.async_save:  # a background save written on every rank becomes the newest checkpoint
                    with self._saving(metrics, r, values):
                        self._complete_save(trainer, actor, values, wait=False)
                if self.offloading:  # synced and saved: the engine generates next (an evaluation, the next rollout)
                    self._offload(trainer, actor, values)
                values["time/iteration_s"] = time.perf_counter() - began
                values["train/optimizer_step"] = float(trainer.step)
                # written, then evaluated (after the save): an evaluation that fails (an engine out of memory on long
                # answers) or a job killed during it (a time limit) loses no training and none of the rollout's
                # metrics; its scores, a second record of the step, are what a resumed run redoes (_evaluation_missing)
                metrics.log(r, values)
                if cfg.eval.interval and r % cfg.eval.interval == 0 and not stopped:
                    scores = _from_rank0(lambda: actor.evaluate(), share=True)
                    metrics.log(r, scores)
                    values.update(scores)
                bar.update(r, values)
                done = r
                if stopped:
                    log.warning("SIGUSR1: stopped after rollout %d of %d, checkpoint saved; the same command "
                                "resumes from it%s", r, total, ", and evaluates it first" if
                                cfg.eval.interval and r % cfg.eval.interval == 0 else "")
                    if ahead:  # saved first: the rollout ahead ends at its next engine call, its effects undone
                        _from_rank0(lambda: actor.abandon_ahead(), share=False)
                    break
        report = None
        if dist.get_rank() == 0:
            from spade_mega.monitor.report import build_report

            report = build_report(self.run_dir).html
        return RunSummary(self.run_dir, start if checkpoint is not None else None, done, report, stopped)

    def _drains(self, r: int) -> bool:
        """Whether rollout ``r`` is a drain point of ``selfplay.async_rollouts``, not overlapped with the next: the
        last, one saved (``selfplay.save_interval``) or one evaluated (``eval.interval``). Its checkpoint and
        evaluation see the weights it trained, synced, and the next rollout is played by them, as in a synchronous
        run; so a run resumed from that checkpoint continues as the uninterrupted one did."""
        s, interval = self.cfg.selfplay, self.cfg.eval.interval
        return r == s.num_rollouts or r % s.save_interval == 0 or bool(interval and r % interval == 0)

    def _train(self, trainer: Trainer, samples: list[TrainSample], r: int) -> tuple[dict[str, float], list[bool]]:
        """The rollout's optimizer steps: their metrics, and per sample whether its step was applied (a step whose
        gradients were not finite is skipped). Old log-probs come from one forward before the first step, so every
        step of the rollout clips against the policy that the rollout started from (PPO's minibatch convention). With
        the KL term, the reference log-probs of every step come from the same pre-pass (one swap of the reference's
        weights per rollout), each step's batch packed as that step packs it."""
        if not samples:
            return {"train/steps": 0.0}, []
        # A decaying schedule follows the run's rollouts: its horizon counts the planned steps, and a rollout that
        # took fewer (groups filtered by rl.filter_zero_std_groups, broken plays, designer samples not yet released,
        # skipped steps) left its share unspent, so the run ended above optimizer.min_lr. Each rollout's steps start
        # at least where the plan puts the rollout (never back: one that took more steps runs ahead). Set from the
        # rollout index, so a run resumed from an earlier checkpoint (no-step rollouts save none) starts it alike.
        # Not into or across the warmup: optimizer.warmup_steps warms up the first steps taken, however late.
        planned = (r - 1) * self._steps_per_rollout()
        if self.cfg.optimizer.warmup_steps <= trainer.scheduler.num_steps < planned:
            trainer.scheduler.step(increment=planned - trainer.scheduler.num_steps)
        started = time.perf_counter()
        gaps = []
        # rl.routing_replay: the same forward records each token's experts, which every step of the rollout replays
        for sample, values in zip(samples, trainer.old_policy(samples)):
            sample.old_logprobs = values
            if sample.role == "agent":  # played this rollout, by the engine's weights policy_lag steps ago
                gaps.append((values - sample.rollout_logprobs)[sample.loss_mask].abs())
        batches = optimizer_batches(samples, self.cfg.selfplay.global_batch_size,
                                    derive_seed(self.cfg.run.seed, "batch", r))
        if trainer.reference is not None:  # rl.kl_coef > 0: the reference is fixed, so it is swapped in once a rollout
            for batch, values in zip(batches, trainer.reference_logprobs_of_steps(batches)):
                for sample, ref in zip(batch, values):
                    sample.ref_logprobs = ref
        results: list[StepResult] = [trainer.train_step(batch) for batch in batches]
        step_of = {id(sample): k for k, batch in enumerate(batches) for sample in batch}
        updated = [results[step_of[id(sample)]].updated for sample in samples]
        applied = [res for res in results if res.updated]
        out = {"train/steps": float(len(results)), "train/updated": float(len(applied)),
               "train/skipped_steps": float(len(results) - len(applied))}
        if out["train/skipped_steps"]:
            log.warning("rollout %d: %d of %d optimizer step(s) skipped, their gradients not finite: %d of %d "
                        "sample(s) not trained on (train/skipped_steps; step_skipped in the rollout's transcript)", r,
                        len(results) - len(applied), len(results), updated.count(False), len(samples))
        # counts add up over every step; averages are over the applied ones (a skipped step's loss and grad norm, inf,
        # NaN or ~1e38, would hide the others: Megatron-LM leaves skipped iterations out of its averages too), over all
        # when none was applied (train/grad_norm NaN then says so)
        for key in dict.fromkeys(key for res in results for key in res.metrics):  # some only where a step had them
            values = [res.metrics[key] for res in (results if key in _SUMMED else applied or results)
                      if key in res.metrics]
            if values:
                out[f"train/{key}"] = math.fsum(values) if key in _SUMMED else _mean(values)
        out["train/tokens_per_s"] = out["train/tokens"] / max(out["train/step_time_s"], 1e-9)
        if gaps:  # engine vs trainer log-probs of the same tokens
            gap = torch.cat(gaps)
            # under the same weights (lag 0): numerics, or a failed sync; under weights the trainer has since stepped
            # past (selfplay.async_rollouts): how far the policy moved too, under a name of its own
            name = "rollout_logprob_abs_diff" if self.policy_lag == 0 else "offpolicy_logprob_abs_diff"
            out[f"train/{name}"] = float(gap.mean())
            out[f"train/{name}_max"] = float(gap.max())
        out["time/train_s"] = time.perf_counter() - started
        return out, updated

    def _sync(self, trainer: Trainer, actor: Optional[_Actor], values: dict[str, float], *,
              changed: bool) -> Optional["SyncStats"]:
        """The trainer's new weights into the engine (collective). An engine that released its GPU memory for the
        step takes back its weights' first, reloads, then takes back its KV cache (evaluation and the next rollout
        generate); each on rank 0 alone, its failure raised on every rank. The time taken is
        ``time/engine_resume_s``.

        Weights no step of the rollout changed (``changed`` false, the same on every rank: no step taken, every group
        flat under ``rl.filter_zero_std_groups`` or every play broken, or every step skipped, its gradients not
        finite) are not sent again (None): the engine serves them on under their version, the step that last changed
        them, which its generations, the transcripts and the loop state (``policy_version``) record. An engine that
        released its memory has lost its copy and is given them, as a new version."""
        from spade_mega.bridge import sync_weights
        from spade_mega.inference import releases_memory

        engine = actor.engine if actor is not None else None
        assert actor is None or actor.ahead is None  # never while the rollout ahead plays on the engine
        if not releases_memory(self.cfg):
            if not changed:
                return None
            synced = sync_weights(trainer, engine, trainer.step)
            self.served = synced.version
            return synced

        def resume(tag: str) -> float:
            assert engine is not None  # rank 0's
            started = time.perf_counter()
            engine.resume_memory(tag)
            return time.perf_counter() - started

        took = _from_rank0(lambda: resume("weights"), share=True)
        synced = sync_weights(trainer, engine, trainer.step)
        self.served = synced.version
        if not self.offloading:  # else once the trainer has released its memory (_offload)
            took += _from_rank0(lambda: resume("kv_cache"), share=True)
        values["time/engine_resume_s"] = took
        return synced

    def _offload(self, trainer: Trainer, actor: Optional[_Actor], values: Optional[dict[str, float]]) -> None:
        """``parallel.offload_trainer``: the trainer's parameters and optimizer state moved to host memory and its
        gradients freed (megatron/offload.py), once the weights are synced and saved; then an engine that released
        its memory for the step takes its KV cache back, into what the trainer freed (rank 0; its failure raised on
        every rank). The trainer reloads before the next rollout's training. ``values``: the rollout's metrics
        (None at the run's start, before the first generation, when the engine holds all its memory still)."""
        from spade_mega.inference import releases_memory

        done = trainer.offloader.offload()
        if values is None:
            return
        values["time/trainer_offload_s"] = done.seconds
        values["memory/trainer_offloaded_gb"] = done.nbytes / 1e9  # this rank's (rank 0's in the log)
        if releases_memory(self.cfg):
            def resume() -> float:
                assert actor is not None  # rank 0's
                started = time.perf_counter()
                actor.engine.resume_memory("kv_cache")
                return time.perf_counter() - started

            values["time/engine_resume_s"] = values.get("time/engine_resume_s", 0.0) + \
                _from_rank0(resume, share=True)

    def _evaluation_missing(self, r: int) -> bool:
        """Whether rollout ``r`` was due an evaluation whose scores metrics.jsonl lacks: a job stopped by SIGUSR1 leaves
        it to the resumed run, one killed during it lost it. Its checkpoint holds the weights it would have scored,
        and evaluation seeds its own sampling, so the resumed run logs the scores the interrupted one would have.
        Without ``logging.jsonl`` nothing says whether it ran: it is run again (the same scores). Every rank gets rank
        0's answer."""
        if not (self.cfg.eval.interval and r % self.cfg.eval.interval == 0):
            return False
        jsonl = self.cfg.logging.jsonl
        return bool(_from_rank0(lambda: not (jsonl and scores_logged(self.run_dir / METRICS_FILE, r)), share=True))

    @contextlib.contextmanager
    def _saving(self, metrics: MetricsLogger, r: int, values: dict[str, float]) -> Iterator[None]:
        """A save at rollout ``r`` that failed (on every rank alike: a full disk, a read-only folder, a writer killed)
        stops the run, losing nothing written: the rollout's metrics are logged first, and the error names what the
        run keeps and how to go on from its newest complete checkpoint."""
        try:
            yield
        except CheckpointError as exc:
            try:
                metrics.log(r, values)
            except Exception as failed:  # on the same full disk: the save's error says more
                log.warning("rollout %d: its metrics could not be logged either: %s", r, failed)
            latest = self.store.latest()
            resume = f"resumes from {latest.name}" if latest is not None else "starts over (no checkpoint completed)"
            if any(sign in str(exc) for sign in _OUT_OF_MEMORY):
                fix = ("Free host memory on the nodes (each rank stages its checkpoint shard in host memory, and a "
                       "background writer's copy grows as training changes the weights it saves: "
                       "selfplay.async_save false saves without that copy)")
            else:
                fix = f"Free space on {self.store.root} (or make it writable)"
            raise CheckpointError(f"{exc}. The run stopped after rollout {r}; its metrics and transcripts so far stay "
                                  f"in {self.run_dir}. {fix} and run the same command again: it {resume} "
                                  "(run.resume: auto)") from exc

    def _save(self, trainer: Trainer, actor: Optional[_Actor], r: int, *, background: bool = False) -> None:
        """Loop state first (rank 0), then the trainer's checkpoint of the same step (collective). After rollouts that
        took no optimizer step (``rl.filter_zero_std_groups`` with every group flat, every play broken) the trainer's
        checkpoint of its step is already on disk and unchanged: only the loop state is written, atomically. Saved
        again, a job killed during that save left the new loop state beside the old checkpoint, and the resumed run
        went on after this rollout, whose metrics record (logged after the save) was never written.

        ``background`` (``selfplay.async_save``, not for the run's last save nor a stop's): the checkpoint's files are
        written in the background; no other save may be pending (:meth:`_complete_save` first, which prunes the loop
        states, so it must not run after this one's is written). A loop state counts only beside its complete
        checkpoint (state.py), so the one written now waits, ignored, until its checkpoint completes."""

        def loop_state() -> None:
            assert actor is not None  # rank 0's
            actor.writer.wait()  # the rollout's transcript is on disk before its checkpoint
            try:
                self.store.write_state(trainer.step, replace(actor.saved_state(r, self.served),
                                                             reference=self.reference))
            except OSError as exc:  # a full disk fails this small file first
                raise CheckpointError(f"{self.store.states}: cannot write the loop state of this checkpoint ({exc}); "
                                      "the previous checkpoint stays the newest") from exc

        # a failure there (a transcript write's, a full disk) stops every rank; they waited for rank 0 in a barrier
        # (over NCCL until the collective timeout). The other ranks save only once rank 0 has written the state.
        _from_rank0(loop_state, share=False)
        if trainer.step != self.on_disk:  # every rank took the same steps, so all agree
            trainer.save(str(self.store.root), keep=self.cfg.selfplay.keep_checkpoints, background=background)
            self.on_disk = trainer.step
        if actor is not None and trainer.pending_save is None:
            self.store.prune_states()

    def _complete_save(self, trainer: Trainer, actor: Optional[_Actor], values: dict[str, float], *,
                       wait: bool) -> None:
        """The background save, once written on every rank (``wait``: waiting for it), made a checkpoint; its write's
        duration is ``time/checkpoint_write_s``. Collective."""
        took = trainer.finish_save(wait=wait)
        if took is not None:
            values["time/checkpoint_write_s"] = took
            if actor is not None:
                self.store.prune_states()


def _fixed_programs(envs: Sequence[FixedEnvConfig]) -> list[EnvProgram]:
    """The program files of ``selfplay.environments``, as text (they run only in the sandbox). Each must be another
    environment: the content hash is the environment's id, so a repeated one would be one environment counted twice."""
    programs: list[EnvProgram] = []
    for i, env in enumerate(envs):
        try:
            source = Path(env.path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            where = "" if Path(env.path).is_absolute() else f" (relative to the working directory {Path.cwd()})"
            raise ConfigError(f"selfplay.environments[{i}].path", f"cannot read {env.path}{where}: {exc}") from None
        program = EnvProgram(source, env.hint, env.skill, {"origin": "fixed", "name": Path(env.path).stem,
                                                           "path": env.path})
        first = next((k for k, p in enumerate(programs) if p.content_hash == program.content_hash), None)
        if first is not None:
            raise ConfigError(f"selfplay.environments[{i}].path", f"{env.path} is the same program, hint and skill as "
                              f"entry {first} ({envs[first].path}): list each environment once")
        programs.append(program)
    return programs


def _fixed_set_change(state: LoopState, fixed: Sequence[EnvProgram]) -> Optional[str]:
    """What a resume does when the checkpoint's environment set is not the one ``selfplay.environments`` sets now (a
    program edited on disk, an entry added, replaced or removed, the list added or removed), or None when it is. A set
    in play otherwise plays on until the next regeneration: the listed programs (the designer's, with the list
    removed) are set at the first resumed rollout instead. The checkpoint's programs keep their memory records."""
    following = state.rollout + 1
    if not fixed:
        if not any(e.origin == "fixed" for e in state.environments):
            return None
        return (f"the checkpoint's environment set is selfplay.environments, which the config no longer lists: the "
                f"designer writes a new set at rollout {following}")
    if [(e.origin, e.env_id) for e in state.environments] == [("fixed", p.content_hash) for p in fixed]:
        return None
    played = {e.env_id for e in state.environments}
    played_paths = {e.program.provenance.get("path") for e in state.environments if e.origin == "fixed"}
    listed, listed_paths = {p.content_hash for p in fixed}, {p.provenance["path"] for p in fixed}
    notes = [f"selfplay.environments[{i}] ({p.provenance['path']})" + (
             ": its program, hint or skill changed since the checkpoint" if p.provenance["path"] in played_paths
             else " is new") for i, p in enumerate(fixed) if p.content_hash not in played]
    notes += [f"the checkpoint's {e.origin} environment {e.program.provenance.get('path') or e.env_id[:12]} is no "
              "longer listed" for e in state.environments if e.env_id not in listed
              and not (e.origin == "fixed" and e.program.provenance.get("path") in listed_paths)]
    return (f"{'; '.join(notes) or 'selfplay.environments lists its programs in another order'}: the listed programs "
            f"are validated and set at rollout {following} (the checkpoint's keep their plays in the memory)")


def scores_logged(metrics_file: Path, step: int) -> bool:
    """Whether a run's metrics.jsonl holds evaluation scores (``eval/...``) at ``step``."""
    if not metrics_file.is_file():
        return False
    records = [line.record for line in scan(metrics_file) if line.record is not None]
    return any(r.step == step and any(name.startswith("eval/") for name in r.metrics) for r in records)


def _rejection_metrics(outcomes: Sequence[Any]) -> dict[str, float]:
    """Designer outputs refused, by reason (``designer/rejected/validate_unsolvable``, ...), and what the solvability
    check spent judging them (``validation/solvability_plays``, ``_wins``, ``_turns``, ``_generated_tokens``,
    ``_prompt_tokens``)."""
    metrics: dict[str, float] = {}
    for outcome in outcomes:
        if outcome.rejection is not None:
            key = "designer/rejected/" + outcome.rejection.replace(":", "_")
            metrics[key] = metrics.get(key, 0.0) + 1.0
        cost = outcome.validation.stats.get("solvability", {}) if outcome.validation is not None else {}
        for name, value in cost.items():
            metrics[f"validation/solvability_{name}"] = metrics.get(f"validation/solvability_{name}", 0.0) + value
    return metrics


def _from_rank0(make: Callable[[], T], *, share: bool) -> Optional[T]:
    """``make()`` run on rank 0 alone (the actor: engine, sandbox, memory, rollout), its value on every rank with
    ``share`` (each rollout's samples and metrics: the trainer takes the same global batch everywhere), else None
    elsewhere. Every rank calls it. A failure there is raised on every rank, naming rank 0's error: the other ranks
    would otherwise wait in their next collective for rank 0 (over NCCL until the collective timeout; over gloo until
    rank 0's exit closed the connection, then a raw traceback). Pickled between the job's own
    ranks, never from a sandbox worker."""
    value: Optional[T] = None
    error: Optional[Exception] = None
    if dist.get_rank() == 0:
        try:
            value = make()
        except Exception as exc:  # raised below, after the other ranks know
            error = exc
    if dist.get_world_size() > 1:
        box = [(None if error is None else f"{type(error).__name__}: {error}", value if share else None,
                isinstance(error, CheckpointError))]
        dist.broadcast_object_list(box, src=0)
        failure, shared, saving = box[0]
        if failure is not None and error is None:
            kind = RankZeroCheckpointError if saving else RankZeroError
            raise kind(f"rank 0 failed, so rank {dist.get_rank()} stops too: {failure}")
        if share:
            value = shared
    if error is not None:
        raise error
    return value


def run(cfg: SpadeConfig) -> RunSummary:
    """Run (or resume) the self-play loop of ``cfg``; every rank of the job calls it."""
    return SelfPlay(cfg).run()
