"""Colocated engine servers hand their GPU memory back while the trainer steps (``inference.release_memory``).

Neither memory mechanism can run on this machine: SGLang needs CUDA, and vLLM has no sleep mode on CPU (its real CPU
server, in tests/test_inference_vllm.py, is refused by name and runs the sleep / wake protocol without freeing
anything). So the engines here talk to :class:`MemoryServer`, an HTTP server written from the servers' own sources,
that keeps their state as they do and records every call:

- SGLang (python/sglang/srt/entrypoints/http_server.py, managers/scheduler_update_weights_mixin.py):
  ``GET /get_server_info`` carries the server args (``enable_memory_saver``); ``POST /release_memory_occupation`` and
  ``/resume_memory_occupation`` take ``{"tags": [...]}`` (None or empty: all) and answer ``null``, an error as HTTP
  400 ``{"error": {"message"}}``; resuming a tag that is not released fails (``offload_tags.remove``). Its
  scheduler asserts it holds no request when told to release (a failed assertion stops the server), and it still holds
  the batch whose results were just answered for a step or more (the overlap scheduler's next step):
  ``POST /flush_cache`` answers 400 until it is idle, 200 once it is (managers/scheduler.py, http_server.py).
- vLLM 0.32 (vllm/entrypoints/serve/dev/sleep/api_router.py, dev/server_info/api_router.py, v1/executor/abstract.py):
  ``POST /sleep?level=0..2`` answers ``{"status": "sleeping", "level"}`` (a level past 2 is HTTP 400);
  ``POST /wake_up?tags=...`` answers ``{"status": "awake"}`` once no tag sleeps, else ``"sleeping"``;
  ``GET /server_info?config_format=json`` carries ``vllm_config.model_config.enable_sleep_mode``; ``GET
  /is_sleeping`` answers ``{"is_sleeping": bool}``.

A server refuses, as the real ones fail, to generate or reload while memory they need is released. What is checked:
the engine calls every server with those requests, in the order release -> resume(weights) -> reload ->
resume(kv_cache); a server that cannot or will not release is an error naming it and what to do; closing the engine
wakes an attached server; nothing is called when the setting is off; and in the real self-play loop (two ranks) the
release comes before any rank's trainer touches the step and the resume around the weight sync.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from safetensors.torch import load_file
from sandbox_support import strict_missing

from spade_mega.config.errors import ConfigError
from spade_mega.config.loader import load_config
from spade_mega.config.schema import ModelConfig, SpadeConfig
from spade_mega.inference import EngineError, GenerationRequest, MemoryReleasing, SamplingParams, releases_memory
from spade_mega.inference.server import write_model_folder
from spade_mega.inference.sglang import SGLangEngine
from spade_mega.inference.vllm import VLLMEngine
from spade_mega.launch.plan import plan_launch
from spade_mega.tokenizer import byte_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"
RECIPE = ROOT / "examples" / "configs" / "qwen3_30b_a3b_games.yaml"
TOK = byte_tokenizer()
ENGINES = {"sglang": SGLangEngine, "vllm": VLLMEngine}


class MemoryServer:
    """An SGLang- or vLLM-speaking server (see the module docstring) on a free port, in a thread. ``events`` is every
    call in order (``release``, ``resume:weights``, ``reload``, ``generate``, ``info``, ...; the self-play test's
    trainer ranks add theirs); ``requests`` the exact (path, body) of each memory call. ``memory_flag``: started with
    --enable-memory-saver / --enable-sleep-mode; ``refuse``: an event answered with an error instead; ``dev_mode``
    (vLLM): VLLM_SERVER_DEV_MODE=1, without which its memory and reload routes do not exist; ``busy_polls``
    (SGLang): how many /flush_cache polls after a generation its scheduler still holds that batch."""

    def __init__(self, engine: str, *, memory_flag: bool = True, refuse: str | None = None,
                 dev_mode: bool = True, busy_polls: int = 2) -> None:
        self.engine, self.memory_flag, self.refuse, self.dev_mode = engine, memory_flag, refuse, dev_mode
        self.busy_polls, self.busy = busy_polls, 0
        self.events: list[str] = []
        self.requests: list[tuple[str, Any]] = []
        self.released: set[str] = set()
        self.loaded: list[str] = []  # the folder of every reload, as the server was told it
        self.lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._answer(None)

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._answer(json.loads(raw) if raw else None)

            def _answer(self, body: Any) -> None:
                with server.lock:
                    status, reply = server.handle(self.path, body)
                if status == 200 and isinstance(body, dict) and body.get("stream"):  # vLLM streams its completions
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(f"data: {json.dumps(reply)}\n\ndata: [DONE]\n\n".encode())
                    self.close_connection = True
                    return
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def memory_events(self) -> list[str]:
        return [e for e in self.events if e.split(":")[0] in ("release", "resume", "reload")]

    def handle(self, target: str, body: Any) -> tuple[int, Any]:
        url = urllib.parse.urlsplit(target)
        path, query = url.path, urllib.parse.parse_qs(url.query)
        if path.startswith("/trainer/"):  # the self-play test's trainer ranks say when they start a forward or step
            self.events.append(f"trainer:{path.split('/')[-1]}:{query['rank'][0]}")
            return 200, None
        sglang = self.engine == "sglang"
        if not (sglang or self.dev_mode) and path in ("/server_info", "/sleep", "/wake_up", "/is_sleeping",
                                                      "/collective_rpc", "/reset_prefix_cache"):
            return 404, {"detail": "Not Found"}  # vLLM mounts them only with VLLM_SERVER_DEV_MODE=1
        if path in ("/health", "/v1/models"):
            return 200, {"data": [{"id": "served-model"}]}
        if path in ("/get_server_info", "/server_info"):
            self.events.append("info")
            if sglang:
                return 200, {"enable_memory_saver": self.memory_flag, "tp_size": 1, "version": "0.5.5"}
            return 200, {"vllm_config": {"model_config": {"enable_sleep_mode": self.memory_flag},
                                         "device_config": {"device": "cuda"}}, "vllm_env": {}, "system_env": {}}
        if path == "/is_sleeping" and not sglang:  # vLLM: any tag asleep (or its scheduler paused)
            self.events.append("is_sleeping")
            return 200, {"is_sleeping": bool(self.released)}
        if path == "/flush_cache" and sglang:
            if self.busy:
                self.busy -= 1
                return 400, "Cache flushed.\n(When there are running or waiting requests, the operation will not " \
                            "be performed.)"
            self.events.append("flush")
            return 200, None
        if path in ("/release_memory_occupation", "/sleep"):
            self.requests.append((target, body))
            if sglang and self.busy:  # the scheduler's assert self._is_no_request() (the real one stops there)
                return 500, {"error": {"message": "AssertionError: release_memory_occupation should be called only "
                                                  "when no ongoing request."}}
            if not sglang and not 0 <= int(query.get("level", ["1"])[0]) <= 2:
                return 400, {"error": {"message": "Input should be less than or equal to 2"}}
            tags = (body or {}).get("tags") if sglang else None
            return self._event("release", lambda: self.released.update(tags or ("weights", "kv_cache")),
                               None if sglang else {"status": "sleeping", "level": int(query["level"][0])})
        if path in ("/resume_memory_occupation", "/wake_up"):
            self.requests.append((target, body))
            tags = (body or {}).get("tags") if sglang else query.get("tags")
            tags = tags or ["weights", "kv_cache"]
            if sglang and not set(tags) <= self.released:  # the scheduler's offload_tags.remove(tag)
                return 400, {"error": {"message": f"KeyError: {sorted(set(tags) - self.released)}"}}
            reply = None if sglang else {"status": "awake" if self.released <= set(tags) else "sleeping",
                                         "tags": tags}
            return self._event(f"resume:{','.join(tags)}", lambda: self.released.difference_update(tags), reply)
        if path in ("/update_weights_from_disk", "/collective_rpc"):
            if "weights" in self.released:  # loading into freed memory
                return 500, {"error": {"message": "weights are released: resume them before loading"}}
            self.loaded.append(body["model_path"] if sglang else body["kwargs"]["weights_path"])
            return self._event("reload", lambda: None, {"success": True, "message": "ok"} if sglang else
                               {"results": [None]})
        if path == "/reset_prefix_cache":
            return 200, None
        if path in ("/generate", "/v1/completions"):
            if self.released:  # SGLang computes on freed memory; a sleeping vLLM queues it until it wakes
                return 503, {"error": {"message": f"generating with {sorted(self.released)} released"}}
            self.events.append("generate")
            self.busy = self.busy_polls
            stop = (body.get("sampling_params") or {}).get("stop_token_ids") if sglang else body["stop_token_ids"]
            if sglang:
                return 200, {"meta_info": {"output_token_logprobs": [[-0.25, stop[0], None]],
                                           "finish_reason": {"type": "stop"}}}
            return 200, {"choices": [{"token_ids": [stop[0]], "logprobs": {"token_logprobs": [-0.25]},
                                      "finish_reason": "stop"}]}
        return 404, {"error": {"message": f"no route {path}"}}

    def _event(self, name: str, apply: Any, reply: Any) -> tuple[int, Any]:
        if self.refuse is not None and name.startswith(self.refuse):
            self.events.append(f"refused {name}")
            return 400, {"error": {"message": f"{self.refuse} is not possible now (memory saver busy)"}}
        apply()
        self.events.append(name)
        return 200, reply


MODEL = ModelConfig(name="tiny", num_layers=1, hidden_size=32, num_attention_heads=2, num_query_groups=1,
                    kv_channels=16, ffn_hidden_size=64, num_experts=0, vocab_size=512, max_position_embeddings=256,
                    params_dtype="float32")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_folder(tmp_path_factory.mktemp("served"), MODEL, TOK)


@pytest.fixture
def make_servers() -> Iterator[Any]:
    """``make_servers(engine, count=2, **MemoryServer options)``; all of them shut down after the test."""
    made: list[MemoryServer] = []

    def make(engine: str, count: int = 2, **kwargs: Any) -> list[MemoryServer]:
        made.extend(MemoryServer(engine, **kwargs) for _ in range(count))
        return made[-count:]

    yield make
    for server in made:
        server.close()


def _attach(engine: str, fakes: list[MemoryServer], folder: Path, *, release: bool = True):
    return ENGINES[engine].attach([s.url for s in fakes], folder, eos_token_id=TOK.eos_token_id, startup_timeout_s=10,
                                  request_timeout_s=10, release_memory=release)


def _greedy() -> list[GenerationRequest]:
    return [GenerationRequest(tuple(TOK.encode("hello")), SamplingParams(max_new_tokens=4, temperature=0.0))]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_every_server_releases_and_takes_back_its_memory_around_a_weight_update(engine, model_folder,
                                                                               make_servers) -> None:
    fakes = make_servers(engine)
    weights = load_file(str(model_folder / "model.safetensors"))
    released = _attach(engine, fakes, model_folder)
    try:
        assert isinstance(released, MemoryReleasing) and released.releases_memory
        assert released.generate(_greedy())[0].output_ids == (TOK.eos_token_id,)
        released.release_memory()
        with pytest.raises(EngineError, match="released the GPU memory of their kv_cache and weights; resume_memory"):
            released.generate(_greedy())
        with pytest.raises(EngineError, match=r"released the GPU memory of their weights; resume_memory\('weights'\)"):
            released.update_weights([weights], version=1)
        released.resume_memory("weights")
        released.update_weights([weights], version=1)
        released.resume_memory("kv_cache")
        released.resume_memory("kv_cache")  # nothing released: nothing asked (SGLang would fail on it)
        assert released.generate(_greedy())[0].weight_version == 1
    finally:
        released.close()
    for fake in fakes:
        assert fake.memory_events() == ["release", "resume:weights", "reload", "resume:kv_cache"]
        assert fake.events[0] == "info" and not fake.released  # checked at start; awake at the end
    if engine == "sglang":  # released once its scheduler is idle (it still held the batch just answered)
        assert all(fake.events[fake.events.index("release") - 1] == "flush" for fake in fakes)
        assert fakes[0].requests == [("/release_memory_occupation", {"tags": ["weights", "kv_cache"]}),
                                     ("/resume_memory_occupation", {"tags": ["weights"]}),
                                     ("/resume_memory_occupation", {"tags": ["kv_cache"]})]
    else:  # level 2: the weights are discarded, not copied to host memory (every weight is reloaded next)
        assert fakes[0].requests == [("/sleep?level=2", None), ("/wake_up?tags=weights", None),
                                     ("/wake_up?tags=kv_cache", None)]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_nothing_is_released_or_asked_when_the_setting_is_off(engine, model_folder, make_servers) -> None:
    fakes = make_servers(engine, count=1, memory_flag=False)
    plain = _attach(engine, fakes, model_folder, release=False)
    try:
        assert not plain.releases_memory
        plain.generate(_greedy())
        plain.update_weights([load_file(str(model_folder / "model.safetensors"))], version=1)
    finally:
        plain.close()
    assert fakes[0].events == ["generate", "reload"]


@pytest.mark.parametrize("engine, flag", [("sglang", "--enable-memory-saver"), ("vllm", "--enable-sleep-mode")])
def test_a_server_started_without_the_memory_flag_is_refused_at_start(engine, flag, model_folder,
                                                                      make_servers) -> None:
    able, unable = make_servers(engine, count=1)[0], make_servers(engine, count=1, memory_flag=False)[0]
    with pytest.raises(EngineError) as info:
        _attach(engine, [able, unable], model_folder)
    message = str(info.value)
    assert f"server at {unable.url} cannot release its GPU memory" in message and able.url not in message
    assert f"started without {flag}" in message and "inference.release_memory: false" in message
    assert "release" not in able.events + unable.events
    if engine == "vllm":
        (plain,) = make_servers(engine, count=1, dev_mode=False)
        with pytest.raises(EngineError, match=f"server at {plain.url} cannot release .*no GET /server_info.*"
                                              "VLLM_SERVER_DEV_MODE=1"):
            _attach(engine, [plain], model_folder)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("refuse", ["release", "resume:weights"])
def test_a_refused_release_or_resume_is_an_engine_error_naming_the_server(engine, refuse, model_folder,
                                                                          make_servers) -> None:
    good, bad = make_servers(engine, count=1)[0], make_servers(engine, count=1, refuse=refuse)[0]
    released = _attach(engine, [good, bad], model_folder)
    try:
        if refuse == "release":
            with pytest.raises(EngineError, match=f"server at {bad.url} did not release its GPU memory .*memory "
                                                  "saver busy.*or set inference.release_memory: false"):
                released.release_memory()
        else:
            released.release_memory()
            with pytest.raises(EngineError, match=f"server at {bad.url} did not take back the GPU memory of its "
                                                  "weights .*memory saver busy.*cannot serve until it does"):
                released.resume_memory("weights")
    finally:
        released.close()  # attached servers are left awake, as far as they let it
    assert not good.released and good.memory_events()[-1] == "resume:kv_cache"
    assert bad.released == ({"weights", "kv_cache"} if refuse == "resume:weights" else set())


def test_an_sglang_server_that_never_gets_idle_is_not_told_to_release(model_folder, make_servers) -> None:
    """Told to release while its scheduler holds a request, SGLang fails an assertion and stops: the engine waits for
    it to be idle, at most a request's timeout, then fails naming the server, having asked nothing."""
    (busy,) = make_servers("sglang", count=1, busy_polls=10**9)
    engine = SGLangEngine.attach([busy.url], model_folder, eos_token_id=TOK.eos_token_id, startup_timeout_s=10,
                                 request_timeout_s=1, release_memory=True)
    try:
        engine.generate(_greedy())
        with pytest.raises(EngineError, match=f"server at {busy.url} did not release its GPU memory \\(it still had "
                                              "requests in flight after 1 s .*SGLang stops when told to release"):
            engine.release_memory()
        assert not busy.requests and not busy.released
    finally:
        engine.close()


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_closing_the_engine_wakes_a_server_it_attached_to(engine, model_folder, make_servers) -> None:
    """A run that fails between release and resume (its train step out of memory) leaves the servers of a SLURM job
    awake for the next run to attach to; their weights are whatever the release left, and every run starts with a
    full weight sync."""
    fakes = make_servers(engine, count=1)
    released = _attach(engine, fakes, model_folder)
    released.release_memory()
    released.close()
    released.close()
    assert fakes[0].memory_events() == ["release", "resume:weights", "resume:kv_cache"] and not fakes[0].released


def test_a_vllm_server_left_asleep_by_a_killed_run_is_woken_by_the_next(model_folder, make_servers, caplog) -> None:
    """A run killed between release and resume (no close) leaves an attached server asleep; the next run's engine
    wakes it at start, before its first weight sync reloads every weight. (SGLang says nowhere what it released:
    docs/inference_servers.md.)"""
    (asleep,) = make_servers("vllm", count=1)
    asleep.released = {"weights", "kv_cache"}
    engine = _attach("vllm", [asleep], model_folder)
    try:
        assert not asleep.released and asleep.memory_events() == ["resume:weights", "resume:kv_cache"]
        assert f"vLLM server at {asleep.url} holds no GPU memory for its kv_cache and weights" in caplog.text
        # awake, but with the weights its level-2 sleep discarded: nothing is generated before a complete update
        with pytest.raises(EngineError, match=f"server at {asleep.url} was left asleep .*discarded its weights.*a "
                                              "complete update_weights must succeed before it generates"):
            engine.generate(_greedy())
        assert "generate" not in asleep.events
        engine.update_weights([load_file(str(model_folder / "model.safetensors"))], version=1)
        engine.generate(_greedy())
    finally:
        engine.close()


def test_eval_wakes_every_attached_server_left_asleep_and_each_loads_the_folder_named(model_folder, make_servers,
                                                                                      tmp_path, monkeypatch,
                                                                                      capsys) -> None:
    """`spade-mega eval --hf-weights DIR` on a job's two servers, both left asleep by a colocated run killed during
    its step, with the run's config (release_memory true): eval's engine neither asks whether they can release nor
    releases them; it wakes both, and each loads DIR itself, at its absolute path, before anything is generated. It
    prints what it scored and the seed, which the JSON records too."""
    import shutil

    from spade_mega.cli import main

    fakes = make_servers("vllm", count=2)
    for fake in fakes:
        fake.released = {"weights", "kv_cache"}
    shutil.copytree(model_folder, tmp_path / "scored")
    monkeypatch.chdir(tmp_path)
    assert main(["eval", str(TINY), "rollout.engine=vllm", f"inference.server_urls=[{fakes[0].url}, {fakes[1].url}]",
                 f"inference.hf_weights={model_folder}", "inference.release_memory=true", "logging.progress=false",
                 f"run.output_dir={tmp_path}", "--hf-weights", "scored", "-o", "result.json"]) == 0
    for fake in fakes:
        assert fake.memory_events() == ["resume:weights", "resume:kv_cache", "reload"] and "info" not in fake.events
        assert fake.loaded == [str(tmp_path / "scored")] and fake.events[-1] == "generate"
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["hf_weights"], result["seed"]) == (str(tmp_path / "scored"), 1234)
    assert f"scored {tmp_path / 'scored'}, run.seed 1234\narithmetic (qa)\n" in capsys.readouterr().out


def test_a_vllm_server_without_dev_mode_is_named_as_such(model_folder, make_servers, tmp_path, capsys) -> None:
    """A server started with a plain `vllm serve` (no VLLM_SERVER_DEV_MODE=1) has none of the routes weights are
    loaded and sleep is asked through: `spade-mega eval` on it, and a weight update, say so, naming the server and
    what to do (they said 'HTTP 404: Not Found' and nothing else)."""
    from spade_mega.cli import main

    (plain,) = make_servers("vllm", count=1, dev_mode=False)
    assert main(["eval", str(TINY), "rollout.engine=vllm", f"inference.server_urls=[{plain.url}]",
                 f"inference.hf_weights={model_folder}", "logging.progress=false", f"run.output_dir={tmp_path}",
                 "--hf-weights", str(model_folder)]) == 2
    assert (f"vLLM server at {plain.url} has no GET /is_sleeping: it was started without VLLM_SERVER_DEV_MODE=1"
            in capsys.readouterr().err)
    engine = _attach("vllm", [plain], model_folder, release=False)
    try:
        with pytest.raises(EngineError, match=f"{plain.url} has no POST /collective_rpc: .*restart it with "
                                              "VLLM_SERVER_DEV_MODE=1"):
            engine.update_weights([load_file(str(model_folder / "model.safetensors"))], version=1)
    finally:
        engine.close()


def test_a_folder_load_checks_the_served_config_and_takes_tied_folders_with_or_without_the_head_copy(
        model_folder, make_servers, tmp_path) -> None:
    """load_folder (eval --hf-weights on attached servers, which keep the config.json they started on): a folder of
    the same shapes whose config computes otherwise (rope_theta, whichever transformers wrote it; an untied head on
    a tied server, which would ignore it) is refused naming the setting, before any server is asked. With tied
    embeddings the stored copy of the embedding (lm_head.weight, some checkpoints keep it) is neither required of
    a folder nor of a weight update (the bridge sends no output layer for a tied model)."""
    import shutil

    from safetensors.torch import save_file

    def folder(name: str, config: dict[str, Any], *, head: bool = True) -> Path:
        out = tmp_path / name
        shutil.copytree(model_folder, out)
        written = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**written, **config}))
        if not head:
            tensors = load_file(str(out / "model.safetensors"))
            del tensors["lm_head.weight"]
            save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out

    (fake,) = make_servers("vllm", count=1)
    engine = _attach("vllm", [fake], model_folder, release=False)
    try:
        with pytest.raises(EngineError, match=r"rope/config.json is not the served model's .*: rope_theta 5000.0 "
                                              r"\(served: 1000000.0\)"):
            engine.load_folder(folder("rope", {"rope_theta": 5000.0, "rope_parameters": None}), version=1)
    finally:
        engine.close()
    tied = folder("tied", {"tie_word_embeddings": True})  # it keeps its copy of the embedding
    engine = _attach("vllm", [fake], tied, release=False)
    try:
        engine.load_folder(folder("tied-without-copy", {"tie_word_embeddings": True}, head=False), version=1)
        weights = load_file(str(tied / "model.safetensors"))
        del weights["lm_head.weight"]
        engine.update_weights([weights], version=2)
        with pytest.raises(EngineError, match=r"untied/config.json .*tie_word_embeddings False \(served: True\)"):
            engine.load_folder(folder("untied", {}), version=3)
        assert engine.weight_version == 2
    finally:
        engine.close()
    assert fake.loaded[0] == str(tmp_path / "tied-without-copy") and len(fake.loaded) == 2


def test_the_setting_resolves_per_engine_and_placement(tmp_path) -> None:
    cfg = SpadeConfig()
    assert not releases_memory(cfg)  # hf
    cfg.rollout.engine = "sglang"
    assert releases_memory(cfg) == torch.cuda.is_available()  # colocated (placement auto): on when there is a GPU
    cfg.launch.engine_placement = "separate"
    assert not releases_memory(cfg)
    cfg.inference.release_memory = True
    assert releases_memory(cfg)
    cfg.rollout.engine, cfg.launch.engine_placement = "hf", "auto"
    with pytest.raises(ConfigError) as info:
        cfg.check()
    assert info.value.path == "inference.release_memory" and "hf engine runs inside the trainer's process" in str(
        info.value)
    with pytest.raises(ConfigError, match=r"inference.release_memory.*one of 'auto', True, False"):
        load_config(TINY, ["inference.release_memory=sometimes"])
    if not torch.cuda.is_available():  # a server started here would be on the CPU: refused before it starts
        cfg = load_config(TINY, ["rollout.engine=vllm", "inference.release_memory=true",
                                 f"inference.server_python={tmp_path / 'never-started'}"])
        with pytest.raises(ConfigError, match="inference.release_memory.*on the CPU"):
            VLLMEngine.from_config(cfg, TOK)


def test_the_launcher_gives_the_servers_the_memory_flag_when_they_release() -> None:
    base = ["inference.hf_weights=/ckpt/base", "inference.weight_sync_dir=/shared/sync"]
    colocated = plan_launch(load_config(RECIPE, base)).engines
    assert colocated.placement == "colocated" and "--enable-memory-saver" in colocated.command
    assert "--enable-memory-saver" not in plan_launch(load_config(RECIPE, base + [
        "inference.release_memory=false"])).engines.command
    separate = ["launch.engine_placement=separate", "launch.engine_nodes=1", "rollout.engine=vllm"]
    assert "--enable-sleep-mode" not in plan_launch(load_config(RECIPE, base + separate)).engines.command
    assert "--enable-sleep-mode" in plan_launch(load_config(RECIPE, base + separate + [
        "inference.release_memory=true"])).engines.command


# ---- the self-play loop ------------------------------------------------------------------------------------------

# the real `spade-mega train`, its trainer's forward (old log-probs, the step's first allocation) and optimizer step
# announced to the server before they run, with the rank
TRACED_TRAIN = """
import os, sys, urllib.request
from spade_mega.megatron.train import Trainer

def traced(name, method):
    def call(self, *args, **kwargs):
        url = f"{sys.argv[1]}/trainer/{name}?rank={os.environ.get('RANK', '0')}"
        urllib.request.urlopen(urllib.request.Request(url, data=b"{}", method="POST"), timeout=30).read()
        return method(self, *args, **kwargs)
    return call

Trainer.logprobs, Trainer.train_step = traced("logprobs", Trainer.logprobs), traced("step", Trainer.train_step)
from spade_mega.cli import main
sys.exit(main(["train", *sys.argv[2:]]))
"""


def _train_two_ranks(tmp_path: Path, fake: MemoryServer) -> subprocess.CompletedProcess:
    """The traced `spade-mega train` of two rollouts on two data-parallel ranks, rank 0's engine attached to
    ``fake``."""
    cfg = load_config(TINY)
    folder = write_model_folder(tmp_path / "served", cfg.model, TOK)
    script = tmp_path / "traced_train.py"
    script.write_text(TRACED_TRAIN)
    isolation = [] if strict_missing() is None else ["sandbox.isolation=best-effort"]
    overrides = [f"run.output_dir={tmp_path}", "rollout.engine=sglang", f"inference.server_urls=[{fake.url}]",
                 f"inference.hf_weights={folder}", "inference.release_memory=true", "selfplay.num_rollouts=2",
                 "selfplay.regen_interval=2", "selfplay.designer_delay=4", "selfplay.save_interval=2",
                 "selfplay.global_batch_size=4", "rollout.envs_per_rollout=2", "rollout.agent_trajectories_per_env=2",
                 "rollout.hint_plays_per_env=1", "rollout.max_turns=1", "rollout.max_response_tokens=8",
                 "rollout.max_designer_tokens=8", "curriculum.corpus.token_budget=64", "eval.interval=2",
                 "eval.before_train=false", "logging.tensorboard=false", "logging.progress=false",
                 "sandbox.warm_workers=1", *isolation]
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), fake.url, str(TINY), *overrides], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_loop_releases_before_any_rank_steps_and_resumes_around_the_weight_sync(tmp_path, make_servers) -> None:
    """Two data-parallel ranks, rank 0's engine attached to an SGLang-speaking server: in each rollout every
    generation comes first, then the release (once the server is idle), then both ranks' forward and steps, then
    resume(weights), the reload, resume(kv_cache); evaluation generates after that."""
    fake = make_servers("sglang", count=1)[0]
    proc = _train_two_ranks(tmp_path, fake)
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = [e for e in fake.events if e != "info"]
    rounds, current = [], []
    for event in events:  # one list per rollout, cut at each KV cache resume (evaluation's generations follow)
        current.append(event)
        if event == "resume:kv_cache":
            rounds.append(current)
            current = []
    assert len(rounds) == 2 and set(current) == {"generate"}  # rollout 2's evaluation, after the resume
    assert rounds[0][0] == "reload"  # the run's first sync, before any rollout
    for events in (rounds[0][1:], rounds[1]):
        release = events.index("release")
        assert events[release - 1] == "flush" and set(events[:release - 1]) == {"generate"} and release > 1
        trainer = events[release + 1:-3]
        assert {e.rsplit(":", 1)[0] for e in trainer} == {"trainer:logprobs", "trainer:step"}
        assert {e.rsplit(":", 1)[1] for e in trainer} == {"0", "1"}  # no rank starts before the release
        assert events[-3:] == ["resume:weights", "reload", "resume:kv_cache"]
    records = [json.loads(line) for line in (tmp_path / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in records if "time/rollout_s" in r]  # evaluation's record of rollout 2 comes on its own
    assert [r["step"] for r in rollouts] == [1, 2]
    assert all(r["time/engine_release_s"] >= 0 and r["time/engine_resume_s"] >= 0 for r in rollouts)
    # the engine's fault tolerance counts (docs/inference_servers.md) reach every rollout's record: nothing failed
    assert all(r["inference/request_retries"] == 0 and r["inference/server_restarts"] == 0 for r in rollouts)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_resume_the_server_refuses_stops_every_rank_naming_it(tmp_path, make_servers) -> None:
    """The server refuses to take back its weights' memory after rollout 1's step: rank 0 raises the engine's error,
    rank 1 (waiting for it, not in a collective of its own) stops naming it, and the job ends; nothing is reloaded
    into the released memory and nothing generates after the release."""
    fake = make_servers("sglang", count=1, refuse="resume:weights")[0]
    proc = _train_two_ranks(tmp_path, fake)
    assert proc.returncode != 0
    refused = f"SGLang server at {fake.url} did not take back the GPU memory of its weights"
    assert refused in proc.stderr and f"rank 0 failed, so rank 1 stops too: EngineError: {refused}" in proc.stderr
    after = fake.events[fake.events.index("release"):]
    assert "reload" not in after and "generate" not in after and "refused resume:weights" in after
    assert {e.rsplit(":", 1)[1] for e in after if e.startswith("trainer:step")} == {"0", "1"}  # both stepped first
