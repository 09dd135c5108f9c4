"""One sandbox worker as the trainer sees it: start it, exchange framed messages under deadlines, kill and reap it.

Everything that arrives from a worker is hostile bytes: frames are bounded before they are read, bodies are decoded
with msgpack into plain data (never unpickled) within limits on what decoding may build (:func:`_decode`), and the
envelope is checked field by field. A call that overruns its deadline, hits EOF, or receives a malformed frame kills
the worker.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import select
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import msgpack

from spade_mega.envs.sandbox.cgroups import CgroupTree, WorkerCgroup
from spade_mega.envs.sandbox.errors import (ProtocolError, SandboxCrash, SandboxError, SandboxTimeout,
                                             SandboxUnavailable)
from spade_mega.envs.sandbox.isolation import IsolationReport, Launch, inspect_worker
from spade_mega.envs.sandbox.worker import FRAME, ST_ERR, ST_OK

_ENVELOPE = 4096  # reply bytes allowed beyond reply_limit_kb for the envelope and the captured output
# Values (scalars and containers, at any depth) one reply may hold. A reply is an envelope, an observation string and
# a small JSON-like info dict, so it needs a few dozen; the bound matters because msgpack spends one byte on an empty
# list or dict that costs the trainer ~64 once built: a 1 MiB frame of them would become ~70 MB of Python objects.
# At this limit a decoded reply stays within a few MB beyond its strings, which the frame already bounds.
MAX_REPLY_VALUES = 1 << 16
_CONTAINER_HEADERS = {**dict.fromkeys([*range(0x90, 0xA0), 0xDC, 0xDD], 1),  # fixarray, array 16, array 32
                      **dict.fromkeys([*range(0x80, 0x90), 0xDE, 0xDF], 2)}  # fixmap, map 16, map 32: 2 values each
_ATOMIC_WRITE = select.PIPE_BUF - FRAME.size  # pipe writes up to PIPE_BUF bytes are all-or-nothing
_packb = msgpack.Packer().pack


@dataclass(frozen=True)
class Reply:
    """A well-formed reply: ``ok`` with ``value``, or not ok with ``value == [kind, message]``."""

    ok: bool
    value: Any
    output: str
    output_overflow: bool


class WorkerProcess:
    """A started worker: its pipes, its host pid (a pidfd, so a kill never hits a reused pid), cgroup and report."""

    def __init__(self, popen: subprocess.Popen, req_w: int, rep_r: int, max_frame: int) -> None:
        self.popen = popen
        self.req_w = req_w
        self.rep_r = rep_r
        self.max_frame = max_frame
        self.max_string = max_frame  # longest str or bytes a reply may carry (spawn sets it from the config)
        self.label = ""  # the environment it hosts, for error messages: set by the pool once a program is loaded
        self.seq = 0
        self.pid = popen.pid
        self.sandbox_init: int | None = None  # host pid of bubblewrap's init, the worker's parent, under bubblewrap
        self.init_pidfd: int | None = None
        self.pidfd: int | None = None
        self.cgroup: WorkerCgroup | None = None
        self.report: IsolationReport | None = None
        self.busy_s = 0.0  # wall time spent in calls: bounds the CPU the worker has used toward RLIMIT_CPU
        self.dead = False
        self.exit_note = ""
        self.stderr_tail = ""
        self._poller = select.poll()
        self._poller.register(rep_r, select.POLLIN)
        self._kill_lock = threading.Lock()

    def call(self, op: str, arg: Any, timeout: float) -> Reply | SandboxError:
        """One request and its reply: the per-step path, so it avoids :func:`exchange`'s bookkeeping."""
        body = _packb([self.seq + 1, op, arg])
        if len(body) > _ATOMIC_WRITE or self.dead:  # a large request may need several writes
            return exchange([(self, op, arg, timeout)])[0]
        self.seq += 1
        started = time.monotonic()
        deadline = started + timeout
        try:
            os.write(self.req_w, FRAME.pack(len(body)) + body)  # atomic: the pipe is empty between calls
        except OSError:
            return self.crash_error(op)
        pending = _Pending(0, self, op, b"", deadline, started)
        poll = self._poller.poll
        while True:
            wait_ms = int((deadline - time.monotonic()) * 1000) + 1
            if wait_ms <= 0:
                self.kill()
                return SandboxTimeout(f"{op} did not answer within {timeout:.1f} s; the worker was killed")
            if poll(wait_ms):
                result = _receive(pending)
                if result is not None:
                    self.busy_s += time.monotonic() - started
                    return result

    def send_kill(self) -> None:
        """SIGKILL the worker without waiting (the pool sends it to many workers, then reaps them all).

        Under bubblewrap the worker is the only child of bubblewrap's init (pid 1 of the sandbox's pid namespace;
        the program can start no process), which exits with it, taking the namespace down, and bubblewrap then
        exits too (its process group is killed only if it lingers, as killing it first would orphan the worker).
        Without bubblewrap the worker leads its own process group: the whole group is killed.
        """
        if self.dead:
            return
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.pid == self.popen.pid:  # no bubblewrap; the group id cannot be reused before we reap the leader
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """Kill the worker and everything in its sandbox, reap the processes and remove its cgroup. Idempotent,
        and safe from several threads (a deadline in one, ``pool.close()`` in another)."""
        with self._kill_lock:
            if self.dead:
                return
            self.send_kill()
            self.dead = True
            self._reap()

    def _reap(self) -> None:
        try:  # bubblewrap reaps the worker and exits by itself; its process group goes if it does not
            self.popen.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()
        if self.init_pidfd is not None:  # bubblewrap may exit before its init does, and never reaps it: the orphan
            _readable(self.init_pidfd, 2.0)  # goes to PID 1 or a subreaper, which may be us (a
            try:  # container's entry point). A pidfd is readable once its process has exited.
                os.waitid(os.P_PIDFD, self.init_pidfd, os.WEXITED | os.WNOHANG)
            except ChildProcessError:
                pass
        code = self.popen.returncode  # bubblewrap exits with 128 + N when its worker died of signal N
        signum = -code if code < 0 else code - 128 if 128 < code < 128 + 65 else 0
        self.exit_note = f"killed by {_signal_name(signum)}" if signum else f"exit status {code}"
        if self.cgroup is not None:
            self.cgroup.remove()
        for fd in (self.req_w, self.rep_r, self.pidfd, self.init_pidfd):
            if fd is not None:
                os.close(fd)
        stderr = self.popen.stderr
        if stderr is not None:  # only bubblewrap and the interpreter before the hello ever write here
            os.set_blocking(stderr.fileno(), False)
            try:
                self.stderr_tail = (os.read(stderr.fileno(), 4096) or b"").decode("utf-8", "replace").strip()
            except BlockingIOError:
                pass
            stderr.close()

    def crash_error(self, op: str) -> SandboxCrash:
        self.kill()
        return SandboxCrash(f"the worker died during {op} ({self.exit_note})")


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def spawn(launch: Launch, cgroups: CgroupTree | None) -> WorkerProcess:
    """Start one worker, read its hello, verify its isolation from outside, move it into its cgroups.

    Must run on a thread that outlives the worker: bubblewrap's --die-with-parent follows the starting *thread*.
    """
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    info_r, info_w = os.pipe() if launch.plan.bwrap else (None, None)
    argv, env = launch.command(req_r, rep_w, info_w)
    # The worker starts with SIGUSR1 blocked (a signal mask outlives exec): SLURM hands the job's time-limit warning
    # to every process of the trainer's step, and the worker must not die of it while the trainer checkpoints.
    # Only this thread blocks it meanwhile, so the trainer's own handler still gets it.
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        popen = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, pass_fds=[fd for fd in (req_r, rep_w, info_w) if fd],
                                 process_group=0)
    except OSError:
        for fd in (req_r, req_w, rep_r, rep_w, info_r, info_w):
            if fd is not None:
                os.close(fd)
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
    for fd in (req_r, rep_w, info_w):
        if fd is not None:
            os.close(fd)
    for fd in (req_w, rep_r):
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    cfg = launch.cfg
    worker = WorkerProcess(popen, req_w, rep_r, (cfg.reply_limit_kb << 10) + (cfg.output_limit_kb << 10) + _ENVELOPE)
    worker.max_string = max(cfg.reply_limit_kb, cfg.output_limit_kb) << 10  # the worker caps both before sending
    try:
        if info_r is not None:
            child = _bwrap_child_pid(info_r, cfg.start_timeout_s)
            if child is None:
                raise _start_failure(worker, "bubblewrap did not start the sandbox")
            worker.pid = child
        worker.pidfd = os.pidfd_open(worker.pid)
        (hello,) = exchange([(worker, None, None, cfg.start_timeout_s)])
        if isinstance(hello, SandboxError) or not hello.ok:
            raise _start_failure(worker, hello.value[1] if isinstance(hello, Reply) else hello.message)
        if info_r is not None:  # bubblewrap's init started the worker, its only child, which has now said hello
            with open(f"/proc/{worker.pid}/task/{worker.pid}/children") as f:
                (pid,) = f.read().split()
            worker.sandbox_init, worker.init_pidfd, worker.pid = worker.pid, worker.pidfd, int(pid)
            worker.pidfd = os.pidfd_open(worker.pid)
        problems = []
        if cgroups is not None:  # "where available": a refusal here costs the cgroup, not the worker
            try:
                worker.cgroup = cgroups.worker(cfg.memory_mb << 20, cfg.threads + 2)
                worker.cgroup.attach(worker.pid)
            except OSError as exc:
                problems.append(f"cgroup: {exc}")
                if worker.cgroup is not None:
                    worker.cgroup.remove()
                    worker.cgroup = None
        worker.report = inspect_worker(worker.pid, hello.value, bool(launch.plan.bwrap),
                                       cgroups.controllers if worker.cgroup and cgroups else (), problems)
    except BaseException:
        worker.kill()
        raise
    finally:
        if info_r is not None:
            os.close(info_r)
    return worker


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether ``fd`` becomes readable (or hung up) within ``timeout_s``. poll, not select: select refuses a
    descriptor numbered 1024 or more, and a trainer holding hundreds of workers (the pool lifts the open-file limit
    for them) has such numbers: starting a worker then failed with 'filedescriptor out of range in select()'."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def _bwrap_child_pid(info_r: int, timeout: float) -> int | None:
    """bubblewrap writes {"child-pid": N, ...} to --info-fd once the sandbox exists (N is its init, the worker's
    parent); None if it exits or stalls first."""
    data = b""
    deadline = time.monotonic() + timeout
    while not data.rstrip().endswith(b"}"):
        ready = _readable(info_r, max(0.0, deadline - time.monotonic()))
        chunk = os.read(info_r, 4096) if ready else b""
        if not chunk:
            return None
        data += chunk
    return int(json.loads(data)["child-pid"])


def _start_failure(worker: WorkerProcess, detail: str) -> SandboxUnavailable:
    """Kill what started, and say why it failed, with the last line bubblewrap or the interpreter printed."""
    worker.kill()
    said = f" (it said: {worker.stderr_tail.splitlines()[-1]})" if worker.stderr_tail else ""
    return SandboxUnavailable(f"a sandbox worker failed to start: {detail}{said}")


class _Pending:
    __slots__ = ("index", "worker", "op", "out", "buf", "deadline", "started")

    def __init__(self, index: int, worker: WorkerProcess, op: str, out: bytes, deadline: float, now: float) -> None:
        self.index, self.worker, self.op, self.out = index, worker, op, out
        self.buf = b""
        self.deadline, self.started = deadline, now


def exchange(calls: Sequence[tuple[WorkerProcess, str | None, Any, float]]) -> list[Reply | SandboxError]:
    """Send each ``(worker, op, arg, timeout)`` request, then collect every reply under its own deadline.

    ``op=None`` sends nothing and reads the worker's hello. Requests go out before any reply is awaited, so the
    workers run concurrently. Each result is a :class:`Reply` or the SandboxError of that call (its worker killed).
    """
    results: list[Reply | SandboxError | None] = [None] * len(calls)
    poller = select.poll()
    readers: dict[int, _Pending] = {}
    writers: dict[int, _Pending] = {}
    # Every request is encoded before any is sent: a value that cannot be encoded raises here, leaving no worker
    # with a request whose reply nobody reads.
    bodies = [None if op is None else _packb([worker.seq + 1, op, arg]) for worker, op, arg, _ in calls]
    now = time.monotonic()
    for index, ((worker, op, arg, timeout), body) in enumerate(zip(calls, bodies)):
        if worker.dead:  # its descriptors are closed, and their numbers may belong to another worker by now
            results[index] = SandboxCrash(f"{op or 'start'}: the worker was already killed ({worker.exit_note}); "
                                          "reset the environment (its sandbox pool must be open)")
            continue
        if body is None:
            out = b""
        else:
            worker.seq += 1
            out = FRAME.pack(len(body)) + body
        pending = _Pending(index, worker, op or "start", out, now + timeout, now)
        if out:
            try:
                pending.out = out[os.write(worker.req_w, out):]
            except BlockingIOError:
                pass
            except OSError:  # EPIPE: the worker is gone
                results[index] = worker.crash_error(pending.op)
                continue
            if pending.out:
                writers[worker.req_w] = pending
                poller.register(worker.req_w, select.POLLOUT)
        readers[worker.rep_r] = pending
        poller.register(worker.rep_r, select.POLLIN)

    def finish(pending: _Pending, result: Reply | SandboxError) -> None:
        results[pending.index] = result
        pending.worker.busy_s += time.monotonic() - pending.started
        poller.unregister(pending.worker.rep_r)
        del readers[pending.worker.rep_r]
        if pending.worker.req_w in writers:
            poller.unregister(pending.worker.req_w)
            del writers[pending.worker.req_w]

    while readers:
        wait_ms = max(0, int((min(p.deadline for p in readers.values()) - now) * 1000) + 1)
        for fd, _events in poller.poll(wait_ms):
            if fd in writers:
                pending = writers[fd]
                try:
                    pending.out = pending.out[os.write(fd, pending.out):]
                except BlockingIOError:
                    continue
                except OSError:
                    finish(pending, pending.worker.crash_error(pending.op))
                    continue
                if not pending.out:
                    poller.unregister(fd)
                    del writers[fd]
            elif fd in readers:
                pending = readers[fd]
                result = _receive(pending)
                if result is not None:
                    finish(pending, result)
        now = time.monotonic()
        for pending in [p for p in readers.values() if now >= p.deadline]:
            pending.worker.kill()
            finish(pending, SandboxTimeout(f"{pending.op} did not answer within "
                                           f"{pending.deadline - pending.started:.1f} s; the worker was killed"))
    return results  # type: ignore[return-value]


def _receive(pending: _Pending) -> Reply | SandboxError | None:
    """Read what is there; a Reply or an error once the frame is complete (or broken), else None."""
    worker = pending.worker
    try:
        chunk = os.read(worker.rep_r, 1 << 16)
    except BlockingIOError:
        return None
    except OSError as exc:
        if exc.errno == errno.EINTR:
            return None
        chunk = b""
    if not chunk:
        return worker.crash_error(pending.op)
    pending.buf += chunk
    if len(pending.buf) < 4:
        return None
    (size,) = FRAME.unpack_from(pending.buf)
    if size > worker.max_frame:
        worker.kill()
        return ProtocolError(f"the worker announced a {size}-byte reply to {pending.op} "
                             f"(limit {worker.max_frame}); the worker was killed")
    if len(pending.buf) < 4 + size:
        return None
    if len(pending.buf) > 4 + size:
        worker.kill()
        return ProtocolError(f"the worker sent {len(pending.buf) - 4 - size} bytes beyond its reply to "
                             f"{pending.op}; the worker was killed")
    reply = _decode(pending.buf[4:], worker.seq, worker.max_string)
    if isinstance(reply, str):
        worker.kill()
        source = f"the worker of environment {worker.label}" if worker.label else "the worker"
        return ProtocolError(f"{reply} from {source} during {pending.op}; the worker was killed")
    return reply


def _decode(body: bytes, seq: int, max_string: int | None = None) -> Reply | str:
    """The reply, or what is wrong with it.

    Nothing is built beyond the protocol's needs: at most MAX_REPLY_VALUES values, no str or bytes longer than
    ``max_string`` (default: the body's length), no msgpack extension types (the protocol has none), and nesting
    within the msgpack decoder's fixed stack. A body short enough cannot hold too many values (each takes a byte or
    more), so only a long one is first counted, header by header, without building anything.
    """
    max_string = len(body) if max_string is None else max_string
    try:
        if len(body) > MAX_REPLY_VALUES and _count_values(body, MAX_REPLY_VALUES) > MAX_REPLY_VALUES:
            return (f"a reply holding more than {MAX_REPLY_VALUES} values (the protocol's limit per reply: an "
                    f"observation and a small info dict need far fewer)")
        message = msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True, max_str_len=max_string,
                                  max_bin_len=max_string, max_array_len=MAX_REPLY_VALUES,
                                  max_map_len=MAX_REPLY_VALUES // 2, max_ext_len=0, ext_hook=_no_extension)
    except Exception as exc:  # noqa: BLE001 - any decoding failure means hostile or corrupt bytes
        return f"undecodable reply ({type(exc).__name__}: {str(exc)[:200]})"
    if type(message) is not list or len(message) != 5:
        return f"malformed reply envelope ({type(message).__name__})"
    reply_seq, status, value, output, overflow = message
    if type(reply_seq) is not int or reply_seq != seq:
        return f"reply to request {reply_seq!r} while request {seq} was pending"
    if type(status) is not int or status not in (ST_OK, ST_ERR) or type(output) is not str or type(overflow) is not bool:
        return "malformed reply envelope fields"
    if status == ST_ERR and not (type(value) is list and len(value) == 2 and all(type(v) is str for v in value)):
        return "malformed error reply"
    return Reply(status == ST_OK, value, output, overflow)


def _no_extension(code: int, data: bytes) -> None:
    raise ValueError(f"msgpack extension type {code}, which the protocol never sends")


def _count_values(body: bytes, limit: int) -> int:
    """How many values the first msgpack object in ``body`` holds, counting up to ``limit + 1`` and building none:
    containers are read by their headers, everything else is skipped. Malformed bytes raise."""
    unpacker = msgpack.Unpacker(max_buffer_size=len(body))
    unpacker.feed(body)
    pending, count = 1, 0
    while pending and count <= limit:
        kind = _CONTAINER_HEADERS.get(body[unpacker.tell()])
        if kind is None:
            unpacker.skip()
        elif kind == 1:
            pending += unpacker.read_array_header()
        else:
            pending += 2 * unpacker.read_map_header()
        pending -= 1
        count += 1
    return count
