"""The SGLang server engine: SGLang's native HTTP API (``python -m sglang.launch_server``), the rollout engine of
the SPADE recipe on GPU.

NOT RUN HERE: SGLang cannot be installed without CUDA, so this client is written against SGLang's documented API
and only its request/response translation is tested (tests/test_inference_vllm.py, no server). The calls:
``POST /generate`` with ``input_ids``, ``sampling_params`` and ``return_logprob`` (reply: ``meta_info`` with
``output_token_logprobs`` as ``[logprob, token_id, text]`` triples and ``finish_reason.type``),
``POST /update_weights_from_disk`` (``model_path``, ``weight_version``; reply ``success``/``message``), ``GET /health``.
A server colocated with the trainer (``inference.release_memory``, started with ``--enable-memory-saver``, which
``GET /get_server_info`` reports as ``enable_memory_saver``) frees its memory with ``POST /release_memory_occupation``
``{"tags": ["weights", "kv_cache"]}`` and takes it back tag by tag with ``POST /resume_memory_occupation`` ``{"tags":
[tag]}`` (both answer ``null``; an error is HTTP 400 ``{"error": {"message"}}``). Its scheduler asserts that it
holds no request when told to release (a failed assertion stops the server), and it still holds the batch whose results
were just answered for a step or so (the overlap scheduler runs one more): the release first waits until ``POST
/flush_cache`` answers 200, which it does only when idle (slime does the same). Only what was released is resumed:
SGLang's scheduler fails on a tag it holds (``offload_tags.remove``); and since no endpoint says what a server has
released, one left released by a run killed between the two calls is not woken by the next (restart it).

Log-probs. SGLang's sampler returns the log-probs of the temperature-scaled distribution before top-p/top-k
truncation, exactly what the trainer recomputes, unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` asks for the raw
model's; the engine's servers run with it off. Greedy requests (temperature 0) get temperature-1 log-probs.
Per-request seeds (``sampling_seed``) are honoured by a server started with ``--enable-deterministic-inference``,
which the engine's server command includes.

Weights. Each update is staged as safetensors (see :mod:`spade_mega.inference.server`) and loaded with
``/update_weights_from_disk``, which also flushes the prefix cache. SGLang's faster tensor/NCCL update paths need
the trainer to share CUDA memory or a process group with the server: not wired here.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

from spade_mega.inference.base import MEMORY_TAGS, EngineError, GenerationRequest, MemoryTag
from spade_mega.inference.server import HTTPStatusError, Server, ServerEngine


class SGLangEngine(ServerEngine):
    name = "SGLang"
    generate_path = "/generate"

    @classmethod
    def server_command(cls, python: str, model_dir: str, *, host: str, port: int, tensor_parallel: int, dtype: str,
                       max_model_len: int, extra_args: Sequence[str] = ()) -> list[str]:
        return [python, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", host, "--port", str(port),
                "--tp-size", str(tensor_parallel), "--dtype", dtype, "--context-length", str(max_model_len),
                "--enable-deterministic-inference", *extra_args]

    @classmethod
    def server_env(cls) -> dict[str, str]:
        return {"SGLANG_RETURN_ORIGINAL_LOGPROB": "0", "HF_HUB_OFFLINE": "1"}

    def _payload(self, server: Server, request: GenerationRequest) -> dict[str, Any]:
        sampling = request.sampling
        params: dict[str, Any] = {
            "max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "stop_token_ids": self._stop_ids(request), "ignore_eos": False,
            "no_stop_trim": True, "skip_special_tokens": False,
        }
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        return {"input_ids": list(request.prompt_ids), "sampling_params": params, "return_logprob": True,
                "return_text_in_logprobs": False}

    def _parse(self, reply: Any) -> tuple[list[int], list[float], str]:
        meta = reply["meta_info"]
        entries = meta["output_token_logprobs"]
        reason = meta["finish_reason"]
        kind = reason["type"] if reason.get("type") in ("stop", "length") or not reason.get("message") else \
            f"{reason['type']}: {reason['message']}"  # an abort's message says why
        return [entry[1] for entry in entries], [entry[0] for entry in entries], kind

    def _reload(self, server: Server, folder: Any, version: int) -> None:
        reply = server.request("POST", "/update_weights_from_disk",
                               {"model_path": str(folder), "weight_version": str(version)},
                               timeout_s=self.request_timeout_s)
        if not (isinstance(reply, dict) and reply.get("success")):
            message = reply.get("message") if isinstance(reply, dict) else reply
            raise EngineError(f"SGLang server at {server.url} refused the weights in {folder}: {message}")

    memory_release_flag = "--enable-memory-saver"

    def _release(self, server: Server) -> None:
        self._wait_idle(server)
        server.request("POST", "/release_memory_occupation", {"tags": list(MEMORY_TAGS)},
                       timeout_s=self.request_timeout_s)

    def _wait_idle(self, server: Server) -> None:
        """Return once ``server``'s scheduler holds no request (its /flush_cache succeeds: HTTP 200, else 400), at
        most a request's timeout later (a request of ours still running then has timed out here anyway)."""
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            try:
                server.request("POST", "/flush_cache", timeout_s=self.request_timeout_s, json_reply=False)
                return
            except HTTPStatusError as exc:
                if exc.status != 400:
                    raise
                if time.monotonic() > deadline:
                    raise EngineError(f"it still had requests in flight after {self.request_timeout_s:.0f} s (POST "
                                      "/flush_cache kept answering HTTP 400), and SGLang stops when told to release "
                                      "then") from None
            time.sleep(0.1)

    def _resume(self, server: Server, tag: MemoryTag, *, last: bool) -> None:
        server.request("POST", "/resume_memory_occupation", {"tags": [tag]}, timeout_s=self.request_timeout_s)

    def _release_problem(self, server: Server) -> Optional[str]:
        info = server.request("GET", "/get_server_info", timeout_s=120.0)
        if not isinstance(info, dict) or "enable_memory_saver" not in info:
            return f"GET /get_server_info does not say whether it has enable_memory_saver: {str(info)[:300]}"
        return None if info["enable_memory_saver"] else \
            "it was started without --enable-memory-saver (its release would free nothing): restart it with it"


from_config = SGLangEngine.from_config
