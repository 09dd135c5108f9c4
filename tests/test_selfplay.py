"""The self-play loop: its batch building and saved state (fast), and the loop itself end to end (slow): the real
`spade-mega train` command with the in-process engine, real sandbox workers and the Megatron trainer on gloo, run
straight and again interrupted then resumed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sandbox_support import strict_missing

from spade_mega.config.errors import ConfigError
from spade_mega.config.loader import load_config
from spade_mega.config.schema import KernelsConfig, RLConfig
from spade_mega.curriculum.memory import EnvMemory
from spade_mega.envs import library
from spade_mega.selfplay.loop import SelfPlay
from spade_mega.selfplay.state import ActiveEnv, CheckpointStore, LoopState, ResumeError, derive_seed
from spade_mega.selfplay.batch import Trajectory, advantages, optimizer_batches, train_samples

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"
SCRIPT = Path(sys.executable).with_name("spade-mega")

# --- the batch --------------------------------------------------------------------------------------------------


def _trajectory(role: str, reward: float, group: str, n: int = 6, valid: bool = True) -> Trajectory:
    return Trajectory(list(range(1, n + 1)), [0, 0, 0] + [1] * (n - 3), [0.0, 0.0, 0.0] + [-1.5] * (n - 3),
                      role, reward, group, valid)  # type: ignore[arg-type]


def test_agent_advantages_are_per_environment_and_designer_ones_per_skill_times_the_scale() -> None:
    batch = [_trajectory("agent", r, "env0") for r in (1.0, 0.0)] + \
        [_trajectory("agent", r, "env1") for r in (0.0, 0.0)] + \
        [_trajectory("designer", 0.8, "logic"), _trajectory("designer", 0.2, "logic"),
         _trajectory("designer", -0.5, "maths"), _trajectory("designer", 9.0, "logic", valid=False)]
    adv = advantages(batch, 8.0, RLConfig(), KernelsConfig())
    assert adv[0] > 0 > adv[1] and adv[0] == pytest.approx(-adv[1])
    assert adv[2:4].tolist() == [0.0, 0.0]  # a group whose rewards are all equal teaches nothing
    assert adv[4:7].tolist() == pytest.approx([0.3 * 8, -0.3 * 8, 0.0])  # centred per skill (masked row left out)
    assert adv[7] == 0.0
    samples = train_samples(batch, adv)
    assert len(samples) == 7  # the masked designer sample is not trained on
    first = samples[0]
    assert first.role == "agent" and first.advantages[:3].tolist() == [0.0] * 3
    assert torch.equal(first.advantages[3:], torch.full((3,), float(adv[0])))
    assert first.rollout_logprobs.tolist() == [0.0] * 3 + [-1.5] * 3 and samples[4].role == "designer"


def test_optimizer_batches_cover_every_sample_once_in_a_seeded_order() -> None:
    batch = [_trajectory("agent", float(i % 2), f"env{i // 2}") for i in range(10)]
    samples = train_samples(batch, advantages(batch, 1.0, RLConfig(), KernelsConfig()))
    steps = optimizer_batches(samples, 4, seed=7)
    assert [len(s) for s in steps] == [4, 4, 2]
    assert sorted(id(s) for step in steps for s in step) == sorted(id(s) for s in samples)
    again = optimizer_batches(samples, 4, seed=7)
    assert [[id(s) for s in step] for step in steps] == [[id(s) for s in step] for step in again]


def test_derived_seeds_are_stable_and_distinct() -> None:
    assert derive_seed(1234, "play", 3, 0) == derive_seed(1234, "play", 3, 0)
    seeds = {derive_seed(1234, "play", r, e) for r in range(20) for e in range(20)}
    assert len(seeds) == 400 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(1234, "play", 1, 2) != derive_seed(1235, "play", 1, 2)


# --- the saved state --------------------------------------------------------------------------------------------


def _state() -> LoopState:
    program = library.get("grid_maze").program()
    return LoopState(rollout=3, active_skills=["navigation"], environments=[ActiveEnv(program, "library", 0, 3)],
                     buffer={"format": "x"}, scheduler={"cursor": 1}, trackers={"skills": {}})


def test_loop_state_round_trips_through_its_json_file(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = store.write_state(5, _state())
    (store.root / "step_00000005").mkdir()
    (store.root / "step_00000005" / "spade_checkpoint.json").write_text("{}")
    restored = store.read_state(store.root / "step_00000005")
    assert restored == _state() and restored.environments[0].env_id == _state().environments[0].env_id
    assert path.name == "step_00000005.json" and not list(store.states.glob("*.tmp"))


def test_loop_states_without_their_checkpoint_are_pruned_and_a_missing_one_is_named(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for step in (2, 4):
        store.write_state(step, _state())
    (store.root / "step_00000004").mkdir()
    (store.root / "step_00000004" / "spade_checkpoint.json").write_text("{}")
    store.prune_states()
    assert [p.name for p in store.states.iterdir()] == ["step_00000004.json"]
    (store.root / "step_00000006").mkdir()
    with pytest.raises(ResumeError, match="no loop state beside it"):
        store.read_state(store.root / "step_00000006")


def test_a_damaged_loop_state_is_refused_by_name(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    data = _state().to_dict()
    data["environments"][0]["program"]["source"] += "\n# edited"
    store.states.mkdir(parents=True)
    store.state_path(1).write_text(json.dumps(data))
    with pytest.raises(ResumeError, match="content hash does not match"):
        store.read_state(store.root / "step_00000001")
    store.state_path(1).write_text(json.dumps({**_state().to_dict(), "rollout": -1}))
    with pytest.raises(ResumeError, match="rollout must be an int >= 0"):
        store.read_state(store.root / "step_00000001")
    store.state_path(1).write_text("{")
    with pytest.raises(ResumeError, match="cannot read the loop state"):
        store.read_state(store.root / "step_00000001")


# --- config and resume errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("override, path", [("selfplay.save_interval=0", "selfplay.save_interval"),
                                            ("selfplay.keep_checkpoints=0", "selfplay.keep_checkpoints"),
                                            ("selfplay.library_fallback=3", "selfplay.library_fallback")])
def test_selfplay_config_errors_name_the_key(override: str, path: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [override])
    assert info.value.path == path


def test_resume_must_without_a_checkpoint_and_never_over_checkpoints_are_refused(tmp_path: Path) -> None:
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "run.resume=must", "launch.requeue=false"])
    with pytest.raises(ResumeError, match="holds no complete checkpoint"):
        SelfPlay(cfg).run()
    ckpt = tmp_path / "tiny_cpu" / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "spade_checkpoint.json").write_text("{}")
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "run.resume=never", "launch.requeue=false"])
    with pytest.raises(ResumeError, match="would overwrite them"):
        SelfPlay(cfg).run()


# --- end to end -------------------------------------------------------------------------------------------------

# Three rollouts, environments regenerated at rollouts 1 and 3, designer samples of rollout 1 released at rollout 2.
E2E = ["selfplay.num_rollouts=3", "selfplay.regen_interval=2", "selfplay.designer_delay=1", "selfplay.save_interval=1",
       "selfplay.keep_checkpoints=null", "selfplay.global_batch_size=4", "rollout.envs_per_rollout=2",
       "rollout.agent_trajectories_per_env=2", "rollout.hint_plays_per_env=1", "rollout.max_turns=2",
       "rollout.max_response_tokens=16", "rollout.max_designer_tokens=48", "curriculum.corpus.token_budget=64",
       "rewards.invalid_program_penalty=-0.5", "optimizer.lr=0.01", "logging.tensorboard=false",
       "logging.progress=false", "eval.interval=2", "eval.before_train=false"]  # held-out scores at rollout 2
# one torch thread per process, as the Megatron tests run: two threads on this shared 2-core machine made the first
# rollout 3x slower (72 s against 20 s), and the trainer's numerics must not depend on a changing thread count
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}
# what legitimately differs between two runs of the same rollouts: wall-clock times and throughputs
TIMING = ("time", "time/", "perf/", "train/tokens_per_s", "train/step_time_s")


# A Hugging Face checkpoint of the tiny model whose final norm is 3.0 everywhere (initialised at 1.0): a run started
# from it shows it in its checkpoints, since training moves a weight by about lr (0.01) per step. Its tokenizer's
# files beside the weights, as convert to-hf writes them (a folder without them is started from with a warning).
HF_START = """
import sys
from spade_mega.bridge import save_hf
from spade_mega.config.loader import load_config
from spade_mega.megatron import Trainer
from spade_mega.tokenizer import byte_tokenizer
trainer = Trainer(load_config(sys.argv[1], ["run.seed=7"]))
trainer.model[0].module.decoder.final_layernorm.weight.data.fill_(3.0)
save_hf(trainer, sys.argv[2], tokenizer=byte_tokenizer())
"""


def _train(out: Path, *extra: str, signal_after: str | None = None) -> str:
    """Run `spade-mega train` to its end; with ``signal_after``, send it SIGUSR1 once that text is logged. Its
    standard output."""
    isolation = [] if strict_missing() is None else ["sandbox.isolation=best-effort"]
    proc = subprocess.Popen([str(SCRIPT), "train", str(TINY), f"run.output_dir={out}", *E2E, *isolation, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ONE_THREAD)
    early = []
    if signal_after is not None:
        assert proc.stderr is not None
        for line in proc.stderr:
            early.append(line)
            if signal_after in line:
                proc.send_signal(signal.SIGUSR1)
                break
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, ("".join(early) + stderr)[-4000:]
    with open(out / "stderr.log", "a") as log:
        log.write("".join(early) + stderr)
    return stdout


def _records(run_dir: Path) -> dict[int, dict]:
    """Each step's metrics (a rollout's and, where it was evaluated, its scores, a record of their own), timings
    aside."""
    steps: dict[int, dict] = {}
    for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        steps.setdefault(r["step"], {}).update({k: v for k, v in r.items() if not k.startswith(TIMING)})
    return steps


def _memory(run_dir: Path) -> list[dict]:
    with EnvMemory(run_dir / "memory.sqlite", create=False) as memory:
        rows = [r.to_dict() for r in memory.iter_records()]
    for row in rows:
        row.pop("created_at")
    return rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Run A: three rollouts straight, from a Hugging Face checkpoint. Run B: a copy of A's directory as if the job
    died after the checkpoint of rollout 1 (its later checkpoints gone, but the memory rows and metrics of rollouts 2
    and 3 left behind), resumed and stopped by SIGUSR1 (SLURM's time-limit warning) during rollout 2, then resumed
    again."""
    base = tmp_path_factory.mktemp("selfplay")
    made = subprocess.run([sys.executable, "-c", HF_START, str(TINY), str(base / "hf")], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=ONE_THREAD)
    assert made.returncode == 0, made.stderr[-4000:]
    _train(base / "a", f"inference.hf_weights={base / 'hf'}")
    straight = base / "a" / "tiny_cpu"
    resumed = base / "b" / "tiny_cpu"
    shutil.copytree(straight, resumed)
    store = CheckpointStore(resumed)
    for ckpt in sorted(store.root.glob("step_*")):
        if store.read_state(ckpt).rollout > 1:
            shutil.rmtree(ckpt)
    stdout = _train(base / "b", f"inference.hf_weights={base / 'hf'}", signal_after="resumed from")
    assert "stopped on SIGUSR1 after 2 rollouts" in stdout and "resumed at rollout 1" in stdout
    assert [store.read_state(ckpt).rollout for ckpt in sorted(store.root.glob("step_*"))] == [1, 2]
    # rollout 2 was due its evaluation (eval.interval 2): the stopped job left it to the resumed one
    assert not any(k.startswith("eval/") for k in _records(resumed)[2])
    assert "resumed at rollout 2" in _train(base / "b", f"inference.hf_weights={base / 'hf'}")
    assert "evaluating the checkpoint of rollout 2 first" in (base / "b" / "stderr.log").read_text()
    return straight, resumed


@pytest.mark.slow
def test_the_loop_logs_its_metrics_saves_checkpoints_and_writes_the_report(runs: tuple[Path, Path]) -> None:
    run_dir = runs[0]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 2, 3]  # rollout 2's scores: a record after the rollout's own
    assert {k for k in records[2] if not k.startswith(("eval/", "gpu/"))} == {"step", "time", "time/eval_s"}
    records = [records[0], records[1], records[3]]
    for r in records:
        for key in ("agent/return", "agent/win_rate", "designer/regret", "train/loss", "time/rollout_s",
                    "time/train_s", "perf/agent/generated_tokens_per_s", "envs/designer", "envs/library"):
            assert key in r, key
        assert r["envs/designer"] + r["envs/library"] == 2  # a random model writes no valid program: library fill
    assert "designer/valid_rate" in records[0] and "designer/valid_rate" in records[2]
    assert [step for step, r in _records(run_dir).items() if "eval/arithmetic/accuracy" in r] == [2]  # interval 2
    assert (run_dir / "report.html").is_file() and (run_dir / "config.yaml").is_file()
    store = CheckpointStore(run_dir)
    states = [store.read_state(ckpt) for ckpt in sorted(store.root.glob("step_*"))]
    assert [s.rollout for s in states] == [1, 2, 3]
    assert len(states[-1].environments) == 2 and states[-1].buffer["pending"]  # rollout 3's designer samples wait


@pytest.mark.slow
def test_a_run_prints_no_notice_its_user_cannot_act_on(runs: tuple[Path, Path]) -> None:
    """make demo printed seven notices between its progress lines that ask megatron-core's authors, not our users, to
    act (Apex missing, GPTModel deprecated, DDP's parameter layout, MIMO experimental, a non-leaf .grad in its
    optimizer) and one of ours (a float of a tensor that requires grad); a resumed run, five more from torch's
    distributed checkpoint as megatron-core calls it."""
    stderr = (runs[0].parent / "stderr.log").read_text()
    for notice in ("Warning", "WARNING", "DEPRECATED", "deprecated"):
        assert notice not in stderr, stderr[-4000:]
    resumed = (runs[1].parent / "stderr.log").read_text()  # a SIGUSR1 stop (our own WARNING says so), then the end
    for notice in ("Warning:", "DEPRECATED", "deprecated"):
        assert notice not in resumed, resumed[-4000:]


@pytest.mark.slow
def test_a_new_run_starts_from_the_hugging_face_weights_the_engine_serves(runs: tuple[Path, Path]) -> None:
    """inference.hf_weights starts the trainer too (else the first sync would hand the engine random weights)."""
    store = CheckpointStore(runs[0])
    norm = _checkpoint_tensors(store.latest(), runs[0].parent / "norm.pt")["decoder.final_layernorm.weight"]
    assert (norm - 3.0).abs().max() < 0.5, norm


@pytest.mark.slow
def test_designer_penalties_flow_through_the_delayed_buffer(runs: tuple[Path, Path]) -> None:
    records = _records(runs[0])
    assert "designer/released" not in records[1]
    assert records[2]["designer/released"] == records[2]["designer/penalised"] == 2  # rollout 1's two outputs
    assert records[2]["designer/reward"] == -0.5 and records[2]["train/samples_designer"] == 2
    assert records[1]["train/samples_designer"] == records[3]["train/samples_designer"] == 0


@pytest.mark.slow
def test_weights_reach_the_engine(runs: tuple[Path, Path]) -> None:
    """The engine's behaviour log-probs of each rollout's agent tokens equal the trainer's under the weights it
    holds: the initial weights (rollout 1), then those after each rollout's optimizer steps (lr 0.01 moves them far
    more than this tolerance)."""
    for step, r in _records(runs[0]).items():
        assert r["train/rollout_logprob_abs_diff_max"] < 1e-4, (step, r["train/rollout_logprob_abs_diff_max"])


@pytest.mark.slow
def test_a_resumed_run_continues_as_the_straight_run(runs: tuple[Path, Path]) -> None:
    """Everything but wall-clock figures is bitwise the same: samples, rewards, losses, gradient norms, the loop
    state, the saved model and optimizer, the memory (its `proposals` counts aside); the crashed run's later records
    are set aside."""
    straight, resumed = runs
    a, b = _records(straight), _records(resumed)
    assert sorted(b) == [1, 2, 3]
    for step in (2, 3):
        assert a[step] == b[step], {k: (a[step].get(k), b[step].get(k)) for k in a[step] | b[step]
                                    if a[step].get(k) != b[step].get(k)}
    assert list(resumed.glob("metrics.aside-*.jsonl"))
    last = [CheckpointStore(run).read_state(sorted(CheckpointStore(run).root.glob("step_*"))[-1])
            for run in (straight, resumed)]
    assert last[0] == last[1]
    saved = [_checkpoint_tensors(sorted(CheckpointStore(run).root.glob("step_*"))[-1], tmp)
             for run, tmp in ((straight, straight.parent / "a.pt"), (resumed, resumed.parent / "b.pt"))]
    assert saved[0].keys() == saved[1].keys() and any(k.startswith("optimizer.state.exp_avg") for k in saved[0])
    for key, value in saved[0].items():
        assert torch.equal(value, saved[1][key]) if isinstance(value, torch.Tensor) else value == saved[1][key], key
    assert [{k: v for k, v in row.items() if k != "proposals"} for row in _memory(straight)] == \
        [{k: v for k, v in row.items() if k != "proposals"} for row in _memory(resumed)]


def _checkpoint_tensors(checkpoint: Path, out: Path) -> dict:
    """Every tensor of a checkpoint (model and optimizer state), read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_data_parallel_ranks_train_on_rank_zeros_rollouts(tmp_path: Path) -> None:
    """Under torchrun every rank builds the trainer and rank 0 alone plays: each rollout's samples reach both ranks
    (the global batch is split between them) and the weights they train reach rank 0's engine. (The designer's
    delay is 2, so its long samples are not trained here: they cost time and the single-process run has them.)"""
    isolation = [] if strict_missing() is None else ["sandbox.isolation=best-effort"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                           "spade_mega.cli", "train", str(TINY), f"run.output_dir={tmp_path}", *E2E, *isolation,
                           "selfplay.num_rollouts=2", "selfplay.designer_delay=2"], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "tiny_cpu"
    records = _records(run_dir)
    assert sorted(records) == [1, 2]
    for r in records.values():
        assert r["train/samples_agent"] == 4 and r["train/rollout_logprob_abs_diff_max"] < 1e-4
    assert "eval/arithmetic/accuracy" in records[2] and "eval/arithmetic/accuracy" not in records[1]
    store = CheckpointStore(run_dir)
    manifest = json.loads((store.latest() / "spade_checkpoint.json").read_text())
    assert manifest["world_size"] == 2 and manifest["layout"].endswith("DP2")
    assert store.read_state(store.latest()).rollout == 2


@pytest.mark.multiproc
def test_a_failure_on_rank_zero_stops_every_rank(tmp_path: Path) -> None:
    """Rank 0 alone builds the actor and plays; when that fails (here: its rollout refuses a context longer than a
    trainer row), the other ranks stop at once with rank 0's error (exit 2, one line). Ranks started by srun directly
    (launch.launcher srun: no torchrun agent to stop them) waited in their next collective for rank 0: over gloo they
    died with a 'connection closed by peer' traceback once rank 0 exited, over NCCL only at the collective timeout."""
    isolation = [] if strict_missing() is None else ["sandbox.isolation=best-effort"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([str(SCRIPT), "train", str(TINY), f"run.output_dir={tmp_path}", *E2E, *isolation,
                               "parallel.max_tokens_per_gpu=1024"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT,
                              env={**ONE_THREAD, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"})
             for rank in (0, 1)]
    try:
        errors = [proc.communicate(timeout=180)[1] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [2, 2], errors
    assert "parallel.max_tokens_per_gpu" in errors[0]
    assert "rank 0 failed, so rank 1 stops too" in errors[1] and "parallel.max_tokens_per_gpu" in errors[1], errors[1]
