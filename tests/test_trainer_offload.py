"""parallel.offload_trainer: the trainer's device memory released while the rollout engine generates, restored bit for
bit before its next training (spade_mega/megatron/offload.py). On CPU (offload_trainer true forces it): the storages
are released (size 0) during a real rollout's generation, a SelfPlay run with it trains exactly as one without over
three rollouts and a save/resume, and a trainer's whole state comes back bit for bit; the multi-process check (two
expert-parallel ranks, the distributed optimizer) is tests/megatron/test_megatron_offload.py."""

from __future__ import annotations

import gc
import json
import os
import weakref
from pathlib import Path

import pytest
import torch
from test_engine_memory import make_servers  # noqa: F401  (the fixture)
from test_run_resources import _config

from spade_mega.config import load_config
from spade_mega.bridge import export_hf, load_hf
from spade_mega.config.errors import ConfigError
from spade_mega.inference.hf import HFEngine
from spade_mega.megatron import Trainer, TrainSample
from spade_mega.megatron.offload import offloads_trainer
from spade_mega.selfplay import loop
from spade_mega.selfplay.loop import SelfPlay
from spade_mega.selfplay.state import CheckpointStore

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"
# what differs between two runs of the same rollouts: wall-clock figures, and what only the offloading run reports
VARYING = ("time", "time/", "perf/", "train/tokens_per_s", "train/step_time_s", "memory/trainer_offloaded_gb")


def make_batch(seed: int) -> list[TrainSample]:
    """Six samples of both roles whose advantages and old log-probs make a step move the weights."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate((16, 16, 12, 12, 10, 10)):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[3:n - 1] = True
        samples.append(TrainSample(torch.randint(0, 512, (n,), generator=g), mask,
                                   torch.where(mask, torch.tensor((-1.0) ** i * (0.5 + i / 10)), torch.tensor(0.0)),
                                   role="designer" if i % 3 == 2 else "agent",
                                   old_logprobs=-6.2 + 0.3 * torch.randn(n, generator=g)))
    return samples


def _distinct_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _state_tensors(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every device tensor of the trainer's state by name: parameters, grad buffers, optimizer params and state."""
    out: dict[str, torch.Tensor] = {}
    for c, chunk in enumerate(trainer.model):
        for name, p in chunk.module.named_parameters():
            out[f"{c}.{name}"] = p
        for b, buffer in enumerate(chunk.buffers + chunk.expert_parallel_buffers):
            out[f"{c}.grad_buffer{b}"] = buffer.grad_data
            if buffer.param_data is not None:
                out[f"{c}.param_buffer{b}"] = buffer.param_data
    for o, opt in enumerate(getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])):
        for g, group in enumerate(opt.optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                out[f"opt{o}.group{g}.{i}"] = p
                for key, value in opt.optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        out[f"opt{o}.group{g}.{i}.{key}"] = value
    return out


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [["model.params_dtype=bfloat16"], ["optimizer.distributed=false"]],
                         ids=["distributed_bf16_fp32_main_shards", "fp32_params_outside_buffers"])
def test_offload_releases_every_state_storage_and_reload_restores_it_bit_for_bit(overrides: list[str]) -> None:
    """After a step (Adam's state exists): offloaded, every parameter, gradient, main parameter and moment has an
    empty storage and a forward or save is refused by name; reloaded, all equal their values before (gradients zeroed),
    the views inside the DDP buffers included, and the next step is the one the trainer would have taken."""
    trainer = Trainer(load_config(TINY, ["parallel.max_tokens_per_gpu=64", *overrides]))
    try:
        trainer.train_step(make_batch(1))
        state = _state_tensors(trainer)
        assert any(".exp_avg_sq" in k for k in state) and any("grad_buffer" in k for k in state)
        # the parameters are views of a DDP param buffer under the distributed optimizer, own storages without it
        assert any("param_buffer" in k for k in state) == ("optimizer.distributed=false" not in overrides)
        before = {k: v.detach().clone() for k, v in state.items()}
        assert any(float(v.abs().max()) > 0 for k, v in before.items() if "grad_buffer" in k)  # the step's gradients
        # each storage once however many tensors view it (a parameter, its DDP buffer, the optimizer's shard of it)
        kept = _distinct_bytes(v for k, v in state.items() if "grad_buffer" not in k)
        freed = _distinct_bytes(v for k, v in state.items() if "grad_buffer" in k)
        done = trainer.offloader.offload()
        assert trainer.offloader.offloaded
        assert all(v.untyped_storage().size() == 0 for v in state.values()), \
            [k for k, v in state.items() if v.untyped_storage().size()]
        assert (done.copied_nbytes, done.nbytes - done.copied_nbytes) == (kept, freed)
        with pytest.raises(RuntimeError, match="a forward: the trainer's memory is offloaded"):
            trainer.logprobs(make_batch(2))
        with pytest.raises(RuntimeError, match="a save: the trainer's memory is offloaded"):
            trainer.save("/nonexistent")
        with pytest.raises(RuntimeError, match="a load: the trainer's memory is offloaded"):
            trainer.load("/nonexistent")
        # each of these read or wrote the released storages: a segmentation fault on CPU (a bad address on CUDA)
        with pytest.raises(RuntimeError, match="a step: the trainer's memory is offloaded"):
            trainer.train_step(make_batch(2))
        with pytest.raises(RuntimeError, match="a weight export: the trainer's memory is offloaded"):
            export_hf(trainer)
        with pytest.raises(RuntimeError, match="a weight load: the trainer's memory is offloaded"):
            load_hf(trainer, "/nonexistent")
        assert trainer.offloader.reload() > 0 and not trainer.offloader.offloaded
        for key, value in state.items():
            want = torch.zeros_like(before[key]) if "grad_buffer" in key else before[key]
            assert torch.equal(value, want), key
        reloaded = trainer.train_step(make_batch(2)).metrics
        assert trainer.offloader.reload() == 0.0  # nothing offloaded: nothing to do
    finally:
        trainer.close()
    twin = Trainer(load_config(TINY, ["parallel.max_tokens_per_gpu=64", *overrides]))
    try:
        twin.train_step(make_batch(1))
        straight = twin.train_step(make_batch(2)).metrics
    finally:
        twin.close()
    timing = ("tokens_per_s", "step_time_s")
    assert {k: v for k, v in reloaded.items() if k not in timing} == \
        {k: v for k, v in straight.items() if k not in timing}


def test_offload_trainer_resolves_as_documented() -> None:
    assert offloads_trainer(True, False) and not offloads_trainer(False, True)
    assert offloads_trainer("auto", True) == torch.cuda.is_available()
    assert not offloads_trainer("auto", False)
    cfg = load_config(TINY, ["parallel.offload_trainer=true"])
    assert cfg.parallel.offload_trainer is True
    with pytest.raises(ConfigError, match="parallel.offload_trainer"):
        load_config(TINY, ["parallel.offload_trainer=sometimes"])


def _metrics(run_dir: Path) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        steps.setdefault(record["step"], {}).update({k: v for k, v in record.items() if not k.startswith(VARYING)})
    return steps


def _checkpoint_tensors(checkpoint: Path, out: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_a_run_offloading_the_trainer_trains_as_one_without_and_releases_it_while_generating(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three rollouts (distributed optimizer, Adam's state from the first step on): straight without offloading, and
    with it stopped after two and resumed. Their metrics and final checkpoints (model and optimizer) are the same bit
    for bit; every generation of the offloading run (its rollouts' plays, with the engine in the trainer's process)
    ran with the trainer's parameters, gradients and optimizer state released."""
    trainers: list[Trainer] = []

    class Recorded(Trainer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            trainers.append(self)

    seen: list[tuple[bool, int]] = []  # per generate call: offloaded, live state bytes
    generate = HFEngine.generate

    def observed(self, requests):
        if trainers:
            state = _state_tensors(trainers[-1])
            seen.append((trainers[-1].offloader.offloaded, sum(v.untyped_storage().size() for v in state.values())))
        return generate(self, requests)

    monkeypatch.setattr(loop, "Trainer", Recorded)
    monkeypatch.setattr(HFEngine, "generate", observed)

    def run(name: str, rollouts: int, offload: bool) -> Path:
        cfg = _config(tmp_path, name)
        cfg.selfplay.num_rollouts, cfg.selfplay.save_interval, cfg.selfplay.keep_checkpoints = rollouts, 1, None
        cfg.parallel.offload_trainer = offload
        SelfPlay(cfg).run()
        return tmp_path / name

    plain = run("plain", 3, False)
    assert seen and not any(offloaded for offloaded, _ in seen)
    seen.clear()
    run("offloaded", 2, True)
    offloaded = run("offloaded", 3, True)  # resumed from rollout 2's checkpoint
    assert len(seen) >= 3 and all(off and live == 0 for off, live in seen), seen
    a, b = _metrics(plain), _metrics(offloaded)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert a == b, {k: (a[s].get(k), b[s].get(k)) for s in a for k in a[s] | b[s] if a[s].get(k) != b[s].get(k)}
    records = [json.loads(line) for line in (offloaded / "metrics.jsonl").read_text().splitlines()]
    assert all(r["memory/trainer_offloaded_gb"] > 0 and r["time/trainer_reload_s"] > 0 for r in records)
    saved = [_checkpoint_tensors(CheckpointStore(run_dir).latest(), tmp_path / f"{run_dir.name}.pt")
             for run_dir in (plain, offloaded)]
    assert saved[0].keys() == saved[1].keys() and any(k.startswith("optimizer.state.exp_avg") for k in saved[0])
    for key, value in saved[0].items():
        assert torch.equal(value, saved[1][key]) if isinstance(value, torch.Tensor) else value == saved[1][key], key


TRACED_TRAIN = """
import sys, urllib.request
from spade_mega.megatron.offload import TrainerOffload
from spade_mega.megatron.train import Trainer

def traced(name, method):
    def call(self, *args, **kwargs):
        request = urllib.request.Request(f"{sys.argv[1]}/trainer/{name}?rank=0", data=b"{}", method="POST")
        urllib.request.urlopen(request, timeout=30).read()
        return method(self, *args, **kwargs)
    return call

for cls, name in ((Trainer, "logprobs"), (Trainer, "save"), (TrainerOffload, "offload"), (TrainerOffload, "reload")):
    setattr(cls, name, traced(name, getattr(cls, name)))
from spade_mega.cli import main
sys.exit(main(["train", *sys.argv[2:]]))
"""


@pytest.mark.slow
def test_with_a_server_engine_the_trainer_offloads_before_the_engine_takes_its_kv_cache_back(
        tmp_path: Path, make_servers) -> None:
    """One rank, its engine attached to an SGLang-speaking server that releases its memory: the run offloads the
    trainer after the first weight sync, before anything generates; each rollout generates, the server releases, the
    trainer reloads, computes its log-probs, resume(weights) and the weight reload (the trainer still holding them),
    the save, then the trainer offloads, and only then resume(kv_cache)."""
    import subprocess
    import sys

    from sandbox_support import strict_missing

    from spade_mega.inference.server import write_model_folder
    from spade_mega.tokenizer import byte_tokenizer

    fake = make_servers("sglang", count=1)[0]
    folder = write_model_folder(tmp_path / "served", load_config(TINY).model, byte_tokenizer())
    script = tmp_path / "traced_train.py"
    script.write_text(TRACED_TRAIN)
    isolation = [] if strict_missing() is None else ["sandbox.isolation=best-effort"]
    overrides = [f"run.output_dir={tmp_path}", "rollout.engine=sglang", f"inference.server_urls=[{fake.url}]",
                 f"inference.hf_weights={folder}", "inference.release_memory=true", "parallel.offload_trainer=true",
                 "selfplay.num_rollouts=2", "selfplay.save_interval=1", "selfplay.global_batch_size=4",
                 "rollout.envs_per_rollout=1", "rollout.agent_trajectories_per_env=4", "rollout.hint_plays_per_env=0",
                 "rollout.max_turns=1", "rollout.max_response_tokens=4", "rollout.max_context_tokens=1024",
                 f"selfplay.environments=[{{path: {ROOT / 'examples' / 'envs' / 'first_char.py'}, hint: h, "
                 "skill: logic}]", "eval.interval=0", "eval.before_train=false", "logging.tensorboard=false",
                 "logging.progress=false", "sandbox.warm_workers=1", *isolation]
    proc = subprocess.run([sys.executable, str(script), fake.url, str(TINY), *overrides], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = [e.removesuffix(":0") for e in fake.events if e not in ("info", "flush")]
    assert events[:2] == ["reload", "trainer:offload"]  # the first sync, then the trainer's memory to the engine
    rounds = "|".join(events[2:]).split("resume:kv_cache")
    assert len(rounds) == 3 and rounds[-1] == ""
    for played in rounds[:2]:
        calls = [e for e in played.split("|") if e]
        assert set(calls[:calls.index("release")]) == {"generate"}
        assert calls[calls.index("release"):] == ["release", "trainer:reload", "trainer:logprobs", "resume:weights",
                                                  "reload", "trainer:save", "trainer:offload"], calls
    records = [json.loads(line) for line in (tmp_path / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["time/trainer_offload_s"] > 0 and r["time/engine_resume_s"] >= 0 for r in records)


def test_host_copies_are_replaced_not_doubled_when_the_optimizer_state_appears(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's first offload comes before any step (no Adam state yet); the one after the first step needs larger
    host copies. The earlier copies are freed before the new ones are allocated: on CUDA they are pinned, and torch's
    pinned allocator keeps a freed block cached for a request of its size, so copies still alive then would stay
    pinned for the rest of the run beside the new ones (params and fp32 main copies: 23 GB a GPU at Qwen3-30B-A3B)."""
    from spade_mega.megatron import offload

    made: list[weakref.ref] = []
    alive_at_allocation: list[int] = []
    allocate = offload.host_copies

    def observed(*args, **kwargs):
        gc.collect()
        alive_at_allocation.append(sum(ref() is not None for ref in made))
        copies = allocate(*args, **kwargs)
        made.extend(weakref.ref(c) for c in copies)
        return copies

    monkeypatch.setattr(offload, "host_copies", observed)
    trainer = Trainer(load_config(TINY, ["parallel.max_tokens_per_gpu=64", "model.params_dtype=bfloat16",
                                         "rl.kl_coef=0.1"]))
    try:
        trainer.offloader.offload()  # the run's start: parameters and fp32 main shards only
        with pytest.raises(RuntimeError, match="a reference forward: the trainer's memory is offloaded"):
            trainer.reference_logprobs(make_batch(1))  # its capture read the released parameters (a crash)
        first = trainer.offloader.host_nbytes
        trainer.offloader.reload()
        trainer.train_step(make_batch(1))
        done = trainer.offloader.offload()  # Adam's moments too: copies of another size
        assert alive_at_allocation == [0, 0], alive_at_allocation
        assert trainer.offloader.host_nbytes == done.copied_nbytes > first
        trainer.offloader.reload()
        trainer.offloader.offload()  # the same sizes: the copies are reused
        assert len(alive_at_allocation) == 2
    finally:
        trainer.close()


HOST_OUT_OF_MEMORY = """
import json, resource, sys, torch
from test_trainer_offload import TINY, make_batch
from spade_mega.config import load_config
from spade_mega.config.errors import ConfigError
from spade_mega.megatron import Trainer

torch.set_num_threads(1)
trainer = Trainer(load_config(TINY, ["parallel.max_tokens_per_gpu=64", "model.vocab_size=131072"]))
trainer.train_step(make_batch(1))
weights = [p.detach().clone() for chunk in trainer.model for p in chunk.module.parameters()]
vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize")) * 1024
limit = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), limit[1]))  # 64 MB more address space; the copies need ~200
try:
    trainer.offloader.offload()
    error = None
except ConfigError as exc:
    error = {"path": exc.path, "message": str(exc)}
resource.setrlimit(resource.RLIMIT_AS, limit)
now = [p for chunk in trainer.model for p in chunk.module.parameters()]
kept = all(torch.equal(a, p) for a, p in zip(weights, now))
trainer.train_step(make_batch(2))  # the trainer goes on, on its device
print(json.dumps({"error": error, "offloaded": trainer.offloader.offloaded, "weights_kept": kept}))
"""


@pytest.mark.slow
def test_host_memory_the_offload_cannot_get_is_a_config_error_naming_the_setting_and_the_trainer_goes_on() -> None:
    """A node without the host memory for the copies (its address space limited here, a real allocation failure):
    the offload names parallel.offload_trainer, the bytes needed and the way out instead of torch's allocator error
    (on CUDA, a pinned allocation's 'CUDA error: out of memory', read as the GPU's); nothing was released."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", HOST_OUT_OF_MEMORY], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["error"] is not None and report["error"]["path"] == "parallel.offload_trainer", report
    assert "GB of host memory" in report["error"]["message"] and "can't allocate memory" in report["error"]["message"]
    assert "set parallel.offload_trainer false" in report["error"]["message"]
    assert not report["offloaded"] and report["weights_kept"], report
