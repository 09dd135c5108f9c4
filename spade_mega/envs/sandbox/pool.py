"""The sandbox pool: warm isolated workers, one per open environment, stepped one at a time or in batches.

A worker hosts exactly one program, so programs never share an interpreter. ``open()`` takes a warm worker and loads
the program into it; ``reset()`` builds a fresh instance of the program's class and returns its first observation;
``step()`` continues the episode. A call that fails in any way (raises, overruns its deadline, crashes the worker,
breaks the contract, prints too much, garbles its reply) raises a typed :class:`SandboxError` and retires the worker:
it is killed and reaped, and the handle's next ``reset()`` reloads the program into a fresh worker from the warm
pool, which a background thread keeps topped up. ``step_many`` / ``reset_many`` send every request before awaiting any
reply, so the environments of a batch run concurrently and a failure stays with its own entry.
"""

from __future__ import annotations

import logging
import math
import resource
import threading
import time
from collections import deque
from typing import Any, NamedTuple, Sequence

from spade_mega.config.schema import SandboxConfig
from spade_mega.envs.program import EnvProgram
from spade_mega.envs.sandbox.cgroups import CgroupTree, pool_tag
from spade_mega.envs.sandbox.errors import (ContractViolation, LoadError, NonFiniteReward, OutputLimitExceeded,
                                             ProgramError, ProtocolError, SandboxError, SandboxUnavailable)
from spade_mega.envs.sandbox.isolation import IsolationReport, Launch, plan_isolation
from spade_mega.envs.sandbox.process import Reply, WorkerProcess, exchange, spawn
from spade_mega.envs.sandbox.worker import (K_PROGRAM, K_PROTOCOL, K_REPLY_TOO_LARGE, K_UNSERIALIZABLE, LOAD_KINDS,
                                            OP_LOAD, OP_RESET, OP_STEP)

log = logging.getLogger("spade_mega.sandbox")


def raise_open_file_limit() -> tuple[int, int]:
    """Lift this process's soft RLIMIT_NOFILE to its hard limit; returns (before, after).

    Each live worker holds a handful of descriptors in the trainer (pipes, pidfd), and SPADE keeps hundreds of
    environments open at once: a common soft limit of 1024 would stop a pool at about 200 workers with EMFILE.
    Raising soft up to hard needs no privilege (it is what ``ulimit -n $(ulimit -Hn)`` does).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # e.g. above fs.nr_open: keep what we have
            return soft, soft
        log.info("sandbox: raised the open-file soft limit from %d to %d for the worker pool", soft, target)
        return soft, target
    return soft, soft
_MAX_INFO_DEPTH = 32


class StepResult(NamedTuple):
    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]


class EnvHandle:
    """One environment instance in its own worker. Use it from one thread at a time."""

    def __init__(self, pool: "SandboxPool", program: EnvProgram, worker: WorkerProcess, class_name: str,
                 max_turns: int) -> None:
        self.pool = pool
        self.program = program
        self.class_name = class_name
        self.max_turns = max_turns
        self.last_output = ""  # what the program printed during the last call
        self._worker: WorkerProcess | None = worker
        self._in_episode = False
        self._closed = False

    def reset(self, seed: int) -> str:
        """Start an episode: a fresh instance of the program's class, ``reset(seed)``; returns the observation."""
        return _raise(self.pool.reset_many([(self, seed)])[0])

    def step(self, action: str) -> StepResult:
        """Continue the episode with ``action``: ``(observation, reward, terminated, truncated, info)``."""
        worker = self._episode_worker(action)
        reply = worker.call(OP_STEP, action, self.pool.cfg.call_timeout_s)
        return _raise(self._step_result(reply))

    def close(self) -> None:
        """Kill the worker. The handle cannot be used afterwards."""
        self._closed = True
        self._retire()

    @property
    def worker_pid(self) -> int | None:
        """Host pid of the current worker (None between a failure and the next reset)."""
        return self._worker.pid if self._worker is not None else None

    def __enter__(self) -> "EnvHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _episode_worker(self, action: object) -> WorkerProcess:
        if self._closed:
            raise RuntimeError("this environment handle is closed")
        if not self._in_episode or self._worker is None:
            raise RuntimeError("step() needs an episode: call reset() first (also after a failed call)")
        if type(action) is not str:
            raise TypeError(f"an action is a str, got {type(action).__name__}")
        try:
            action.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"an action must be text that UTF-8 can encode: {exc}") from None
        return self._worker

    def _retire(self) -> None:
        self._in_episode = False
        worker, self._worker = self._worker, None
        if worker is not None:
            self.pool._retire(worker)

    def _fail(self, error: SandboxError) -> SandboxError:
        self.last_output = error.output
        self._retire()
        return error

    def _step_result(self, reply: Reply | SandboxError) -> StepResult | SandboxError:
        if isinstance(reply, SandboxError):
            return self._fail(reply)
        error = self.pool._reply_error(reply, OP_STEP)
        if error is not None:
            return self._fail(error)
        result = check_step(reply.value)
        if isinstance(result, SandboxError):
            result.output = reply.output
            return self._fail(result)
        self.last_output = reply.output
        return result


def check_step(value: Any) -> StepResult | ContractViolation:
    """The step reply as a StepResult, or the contract violation it commits."""
    if type(value) is not list or len(value) != 5:
        got = f"{len(value)} values" if type(value) is list else type(value).__name__
        return ContractViolation(f"step() must return (observation, reward, terminated, truncated, info), got {got}")
    observation, reward, terminated, truncated, info = value
    if type(observation) is not str:
        return ContractViolation(f"step() observation must be a str, got {type(observation).__name__}")
    if type(reward) not in (int, float):
        return ContractViolation(f"step() reward must be a float, got {type(reward).__name__}")
    if not math.isfinite(reward):
        return NonFiniteReward(f"step() reward must be finite, got {reward!r}")
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        if type(flag) is not bool:
            return ContractViolation(f"step() {name} must be a bool, got {type(flag).__name__}")
    problem = _json_like_problem(info, "info", 0) if type(info) is dict else f"info must be a dict, got " \
                                                                               f"{type(info).__name__}"
    if problem:
        return ContractViolation(f"step() {problem}")
    return StepResult(observation, float(reward), terminated, truncated, info)


def _json_like_problem(value: Any, where: str, depth: int) -> str:
    if depth > _MAX_INFO_DEPTH:
        return f"{where} is nested deeper than {_MAX_INFO_DEPTH}"
    kind = type(value)
    if kind in (str, int, float, bool) or value is None:
        return ""
    if kind is list:
        return next((p for i, v in enumerate(value) if (p := _json_like_problem(v, f"{where}[{i}]", depth + 1))), "")
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                return f"{where} has a key of type {type(key).__name__} (keys must be str)"
            problem = _json_like_problem(item, f"{where}[{key!r}]", depth + 1)
            if problem:
                return problem
        return ""
    return f"{where} holds a {kind.__name__} (only str, int, float, bool, None, lists and dicts are allowed)"


def _raise(result: Any) -> Any:
    if isinstance(result, SandboxError):
        raise result
    return result


class SandboxPool:
    """Warm isolated workers that run environment programs. Use as a context manager, or call ``close()``."""

    def __init__(self, cfg: SandboxConfig | None = None) -> None:
        self.cfg = cfg or SandboxConfig()
        self.cfg.check()
        raise_open_file_limit()
        self._plan = plan_isolation(self.cfg)
        self._launch = Launch(self._plan, self.cfg)
        self._cgroups: CgroupTree | None = None
        self.cgroup_note = "disabled by sandbox.cgroups"
        if self.cfg.cgroups:
            self._cgroups, self.cgroup_note = CgroupTree.create(pool_tag())
        self._cond = threading.Condition()
        self._warm: deque[WorkerProcess] = deque()
        self._live: set[WorkerProcess] = set()
        self._closed = False
        self._stop = False  # set by close() once every worker is reaped; only then does the spawner thread end
        self._spawn_error: SandboxUnavailable | None = None
        self.isolation: IsolationReport | None = None
        self._starting = 0
        # bubblewrap's --die-with-parent follows the thread that started it: long-lived threads start them all.
        self._spawners = [threading.Thread(target=self._spawn_loop, name=f"spade-sandbox-spawner-{i}", daemon=True)
                          for i in range(self.cfg.spawners)]
        for spawner in self._spawners:
            spawner.start()
        try:
            self._await_first_worker()
        except BaseException:
            self.close()
            raise

    # -- public API ---------------------------------------------------------------------------------------------

    def open(self, program: EnvProgram) -> EnvHandle:
        """Load ``program`` into a fresh worker. Raises LoadError (or another SandboxError) if it does not load."""
        worker = self._acquire()
        try:
            reply = worker.call(OP_LOAD, program.source, self.cfg.load_timeout_s)
        except BaseException:  # the source could not be sent (or we were interrupted): the worker goes too
            self._retire(worker)
            raise
        loaded = self._loaded(reply, worker, program)
        if isinstance(loaded, SandboxError):
            self._retire(worker)
            raise loaded
        return EnvHandle(self, program, worker, *loaded)

    def reset_many(self, pairs: Sequence[tuple[EnvHandle, int]]) -> list[str | SandboxError]:
        """Reset each ``(env, seed)`` concurrently; each entry is the observation or that call's SandboxError.

        A handle whose worker was retired (or has used half its CPU budget) first gets a fresh worker and its
        program reloaded, also concurrently.
        """
        envs = [env for env, _ in pairs]
        _distinct(envs)
        for env, seed in pairs:
            if env._closed:
                raise RuntimeError("this environment handle is closed")
            if type(seed) is not int or not -2**63 <= seed < 2**64:
                raise TypeError(f"a seed is an int that fits in 64 bits, got {seed!r}")
        results: list[str | SandboxError | None] = [None] * len(pairs)
        stale = [i for i, env in enumerate(envs)
                 if env._worker is None or env._worker.busy_s > self.cfg.cpu_s / 2]
        for i in stale:
            envs[i]._retire()
        fresh: list[WorkerProcess] = []
        try:
            for _ in stale:
                fresh.append(self._acquire())
            loads = exchange([(worker, OP_LOAD, envs[i].program.source, self.cfg.load_timeout_s)
                              for i, worker in zip(stale, fresh)])
        except BaseException:
            for worker in fresh:
                self._retire(worker)
            raise
        for i, worker, reply in zip(stale, fresh, loads):
            loaded = self._loaded(reply, worker, envs[i].program)
            if isinstance(loaded, SandboxError):
                self._retire(worker)
                envs[i].last_output = loaded.output
                results[i] = loaded
            else:
                envs[i]._worker = worker
        ready = [i for i in range(len(pairs)) if results[i] is None]
        for i in ready:
            envs[i]._in_episode = False
        replies = exchange([(envs[i]._worker, OP_RESET, pairs[i][1], self.cfg.call_timeout_s) for i in ready])
        for i, reply in zip(ready, replies):
            env = envs[i]
            error = reply if isinstance(reply, SandboxError) else self._reply_error(reply, OP_RESET)
            if error is None and type(reply.value) is not str:
                error = ContractViolation(f"reset() must return a str observation, got {type(reply.value).__name__}",
                                          reply.output)
            if error is not None:
                results[i] = env._fail(error)
            else:
                env.last_output = reply.output
                env._in_episode = True
                results[i] = reply.value
        return results  # type: ignore[return-value]

    def step_many(self, pairs: Sequence[tuple[EnvHandle, str]]) -> list[StepResult | SandboxError]:
        """Step each ``(env, action)`` concurrently; each entry is a StepResult or that call's SandboxError."""
        _distinct([env for env, _ in pairs])
        workers = [env._episode_worker(action) for env, action in pairs]
        replies = exchange([(w, OP_STEP, action, self.cfg.call_timeout_s) for w, (_, action) in zip(workers, pairs)])
        return [env._step_result(reply) for (env, _), reply in zip(pairs, replies)]

    def close(self) -> None:
        """Kill every worker (warm or held by a handle), stop the spawner, remove the cgroups. Idempotent."""
        with self._cond:
            self._closed = True
            workers = list(self._live)
            self._live.clear()
            self._warm.clear()
            self._cond.notify_all()
        for worker in workers:
            worker.send_kill()
        for worker in workers:
            worker.kill()
        # Only now may the spawner thread end: its exit would SIGKILL (--die-with-parent) any bubblewrap it started,
        # and a bubblewrap killed before it reaps its worker leaves a zombie to init.
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for spawner in self._spawners:
            if spawner.is_alive() and threading.current_thread() is not spawner:
                spawner.join(timeout=self.cfg.start_timeout_s + 5)
        if self._cgroups is not None:
            self._cgroups.remove()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def live_workers(self) -> int:
        """Workers alive now: warm ones plus those held by handles."""
        with self._cond:
            return len(self._live)

    @property
    def warm_workers(self) -> int:
        with self._cond:
            return len(self._warm)

    def processes(self) -> set[int]:
        """Host pids of every live worker and of the bubblewrap processes around it (the launcher and the init)."""
        with self._cond:
            return {pid for worker in self._live for pid in (worker.pid, worker.popen.pid, worker.sandbox_init)
                    if pid is not None}

    # -- internals ----------------------------------------------------------------------------------------------

    def _await_first_worker(self) -> None:
        """The first worker proves the isolation works here and fills in ``self.isolation``."""
        deadline = time.monotonic() + self.cfg.start_timeout_s
        with self._cond:
            while self.isolation is None:
                if self._spawn_error is not None:
                    raise self._spawn_error
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SandboxUnavailable(f"the first sandbox worker did not start within sandbox.start_timeout_s "
                                             f"({self.cfg.start_timeout_s:.0f} s)")
                self._cond.wait(remaining)

    def _acquire(self) -> WorkerProcess:
        deadline = time.monotonic() + self.cfg.start_timeout_s
        with self._cond:
            while True:
                if self._closed:
                    raise SandboxUnavailable("the sandbox pool is closed")
                if self._warm:
                    worker = self._warm.popleft()
                    self._cond.notify_all()
                    return worker
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    # Spawners retry a failed start (the machine may be briefly short of memory or processes), so
                    # the caller waits for the retry and hears why starts fail only at its deadline.
                    if self._spawn_error is not None:
                        raise self._spawn_error
                    raise SandboxUnavailable(f"no sandbox worker started within sandbox.start_timeout_s "
                                             f"({self.cfg.start_timeout_s:.0f} s); the machine may be overloaded")
                self._cond.wait(remaining)

    def _retire(self, worker: WorkerProcess) -> None:
        with self._cond:
            self._live.discard(worker)
        worker.kill()

    def _spawn_loop(self) -> None:
        backoff = 0.05
        while True:
            with self._cond:
                while not self._closed and len(self._warm) + self._starting >= self.cfg.warm_workers:
                    self._cond.wait()
                if self._closed:
                    while not self._stop:
                        self._cond.wait()
                    return
                self._starting += 1
                launch = self._launch
            worker, error = self._start_one(launch)
            with self._cond:
                self._starting -= 1
                if worker is not None and not self._closed:
                    self._spawn_error = None
                    self._warm.append(worker)
                    self._live.add(worker)
                    self._cond.notify_all()
                    backoff = 0.05
                    continue
                if error is not None:
                    self._spawn_error = error
                    self._cond.notify_all()
            if worker is not None:  # the pool closed while it started
                worker.kill()
            elif error is not None:  # retry later (the machine may be short of memory or processes)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _start_one(self, launch: Launch) -> tuple[WorkerProcess | None, SandboxUnavailable | None]:
        """A started worker whose isolation is acceptable, or the reason there is none (None, None: retry now)."""
        try:
            worker = spawn(launch, self._cgroups)
        except SandboxUnavailable as exc:
            return None, None if self._fall_back(exc) else exc
        except Exception as exc:  # noqa: BLE001 - e.g. fork failing under memory pressure
            return None, SandboxUnavailable(f"starting a sandbox worker failed: {exc}")
        try:
            with self._cond:
                self._accept_isolation(worker)
        except SandboxUnavailable as exc:
            worker.kill()
            return None, exc
        return worker, None

    def _fall_back(self, exc: SandboxUnavailable) -> bool:
        """best-effort only: when bubblewrap exists but cannot start a sandbox, run workers without it."""
        with self._cond:
            if self._plan.required or not self._plan.bwrap or self.isolation is not None:
                return False
            if self._launch.plan is not self._plan:  # another spawner already fell back
                return True
        log.warning("sandbox: bubblewrap could not start a worker (%s); best-effort isolation continues WITHOUT "
                    "bubblewrap: no read-only root, no mount or pid namespace", exc)
        with self._cond:
            self._plan = self._plan.without_bwrap()
            self._launch = Launch(self._plan, self.cfg)
        return True

    def _accept_isolation(self, worker: WorkerProcess) -> None:
        """Strict: refuse a worker that got less than full isolation. Log what the first worker got (lock held)."""
        report = worker.report
        assert report is not None
        missing = report.missing_for_strict()
        if self._plan.required and missing:
            raise SandboxUnavailable(f"sandbox.isolation is 'strict' but a worker got only: {report.describe()} "
                                     f"(missing: {', '.join(missing)}; {'; '.join(report.problems)})")
        if self.isolation is None:
            self.isolation = report
            cgroups = "" if report.cgroups else f" (cgroups: {self.cgroup_note})"
            if missing:
                log.warning("!!! sandbox isolation is INCOMPLETE (best-effort): %s%s. Missing for strict: %s. %s",
                            report.describe(), cgroups, ", ".join(missing), "; ".join(report.problems))
            else:
                log.info("sandbox isolation: %s%s", report.describe(), cgroups)

    def _loaded(self, reply: Reply | SandboxError, worker: WorkerProcess,
                program: EnvProgram) -> tuple[str, int] | SandboxError:
        """The class name and max_turns of a loaded program; labels its worker with them for error messages."""
        if isinstance(reply, SandboxError):
            return reply
        error = self._reply_error(reply, OP_LOAD)
        if error is not None:
            return error
        value = reply.value
        if not (type(value) is list and len(value) == 2 and type(value[0]) is str and type(value[1]) is int):
            return ProtocolError(f"malformed load reply {type(value).__name__}", reply.output)
        worker.label = f"{value[0][:80]} (program {program.content_hash[:12]})"
        return value[0], value[1]

    def _reply_error(self, reply: Reply, op: str) -> SandboxError | None:
        """The SandboxError a worker's reply stands for, or None when it is a success."""
        if reply.output_overflow:
            return OutputLimitExceeded(f"the program printed more than sandbox.output_limit_kb "
                                       f"({self.cfg.output_limit_kb} KB) during {op}", reply.output)
        if reply.ok:
            return None
        kind, message = reply.value
        if kind in LOAD_KINDS:
            return LoadError(kind, message, reply.output)
        error_type = {K_PROGRAM: ProgramError, K_UNSERIALIZABLE: ContractViolation,
                      K_REPLY_TOO_LARGE: OutputLimitExceeded, K_PROTOCOL: ProtocolError}.get(kind)
        if error_type is None:
            return ProtocolError(f"unknown error kind {kind[:40]!r} from the worker during {op}", reply.output)
        return error_type(message, reply.output)


def _distinct(envs: list[EnvHandle]) -> None:
    if len({id(env) for env in envs}) != len(envs):
        raise ValueError("a batch may hold each environment handle at most once")
