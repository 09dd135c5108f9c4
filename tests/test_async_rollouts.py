"""selfplay.async_rollouts: rank 0 plays rollout r+1 on a thread while the trainer steps on rollout r (one-step
off-policy). The real loop (agent-only, the tiny Megatron model on gloo, the in-process hf engine, environment programs
in sandbox workers), four rollouts, one optimizer step each:

- A: saves at rollout 2 (a drain point) and 4 (the last). Rollout 2 plays during train(1) and rollout 4 during
  train(3), by the weights before that training (engine calls on the rollout thread, timed, start before the step
  ends); rollout 3 plays after rollout 2's weights are synced and saved, by them. The transcripts' weight versions,
  rollout/policy_lag and the log-prob gap metrics say which.
- B: saves only at the end; SIGUSR1 during train(2), while rollout 3 plays ahead (regenerating the set): it saves
  rollout 2 without waiting for rollout 3, whose effects (environments, memory rows, transcript) are not in the
  checkpoint, which equals A's of rollout 2, its save point (loop state, model and optimizer, bit for bit); rollout 3
  is abandoned at its engine call. Resumed from that checkpoint, B continues exactly as A did after its save point
  (metrics, final checkpoint, memory).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from sandbox_support import strict_missing

from spade_mega import bridge
from spade_mega.config.errors import ConfigError
from spade_mega.config.loader import load_config
from spade_mega.curriculum.memory import EnvMemory
from spade_mega.inference.hf import HFEngine
from spade_mega.monitor.transcripts import rollouts_written, transcript_path
from spade_mega.selfplay import loop
from spade_mega.selfplay.loop import SelfPlay
from spade_mega.selfplay.state import CheckpointStore

ROOT = Path(__file__).resolve().parents[1]
TIMING = ("time", "time/", "perf/", "train/tokens_per_s", "train/step_time_s", "gpu/")
ROLLOUT_THREAD = "spade-rollout"


def _config(out: Path, name: str, *extra: str) -> Any:
    isolation = [] if strict_missing() is None else ["sandbox.isolation=best-effort"]
    return load_config(ROOT / "examples" / "configs" / "tiny_learn.yaml", [
        f"run.output_dir={out}", f"run.name={name}", "logging.progress=false", "logging.tensorboard=false",
        *isolation, "rollout.agent_trajectories_per_env=4", "selfplay.global_batch_size=4", "selfplay.num_rollouts=4",
        "selfplay.keep_checkpoints=null", "selfplay.async_rollouts=true", "selfplay.regen_interval=2",
        f"selfplay.environments=[{{path: {ROOT / 'examples' / 'envs' / 'first_char.py'}, hint: h, skill: logic}}]",
        *extra])


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(TIMING)}


def _tensors(checkpoint: Path, out: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)


def _same_checkpoint(a: Path, b: Path, tmp: Path) -> None:
    """The loop states and every model and optimizer tensor of two checkpoints are equal."""
    assert CheckpointStore(a.parent.parent).read_state(a) == CheckpointStore(b.parent.parent).read_state(b)
    saved = [_tensors(c, tmp / f"{i}.pt") for i, c in enumerate((a, b))]
    assert saved[0].keys() == saved[1].keys() and any(k.startswith("optimizer.state.exp_avg") for k in saved[0])
    for key, value in saved[0].items():
        assert torch.equal(value, saved[1][key]) if isinstance(value, torch.Tensor) else value == saved[1][key], key


def _memory(run_dir: Path, name: str = "memory.sqlite") -> list[dict]:
    with EnvMemory(run_dir / name, create=False) as memory:
        rows = [r.to_dict() for r in memory.iter_records()]
    for row in rows:
        row.pop("created_at")
        row.pop("proposals")
    return rows


def _checkpoint_of(run_dir: Path, rollout: int) -> Path:
    store = CheckpointStore(run_dir)
    (found,) = [c for c in sorted(store.root.glob("step_*")) if store.read_state(c).rollout == rollout]
    return found


def _rollout_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(ROLLOUT_THREAD)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One torch thread (the loop's; the rollout thread takes as many): with two, the engine's log-probs of a rollout
    played while the trainer computes differed between two identical runs in the last bits (~5e-7, one sample in
    some runs), so runs are compared bit for bit with one, as the end-to-end tests run (OMP_NUM_THREADS=1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield _runs(tmp_path_factory.mktemp("async_rollouts"))
    finally:
        torch.set_num_threads(threads)


def _runs(base: Path) -> dict[str, Any]:
    events: list[tuple[str, int, float, float, str]] = []  # (what, rollout, start, end, thread)
    intra_op: set[int] = set()  # torch threads of the rollout thread
    generate, rollout, train = HFEngine.generate, loop._Actor.rollout, SelfPlay._train
    sync_weights = bridge.sync_weights

    def timed_sync(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = sync_weights(*args, **kwargs)
        events.append(("sync", -1, started, time.perf_counter(), threading.current_thread().name))
        return out

    generated_ahead = threading.Event()

    def timed_generate(self: HFEngine, requests: Any) -> Any:
        started = time.perf_counter()
        if threading.current_thread().name.startswith(ROLLOUT_THREAD):
            generated_ahead.set()
        out = generate(self, requests)
        events.append(("generate", -1, started, time.perf_counter(), threading.current_thread().name))
        return out

    def timed_rollout(self: Any, r: int) -> Any:
        if threading.current_thread().name.startswith(ROLLOUT_THREAD):
            intra_op.add(torch.get_num_threads())
        started = time.perf_counter()
        out = rollout(self, r)
        events.append(("rollout", r, started, time.perf_counter(), threading.current_thread().name))
        return out

    def timed_train(self: SelfPlay, trainer: Any, samples: Any, r: int) -> Any:
        started = time.perf_counter()
        out = train(self, trainer, samples, r)
        if r in (1, 3):  # train(r) ends once rollout r + 1 has generated, which a loop that plays it after train(r)
            # (on this thread, or on another it waits for) never does: it is seen timing out
            events.append(("generated_ahead", r, started, time.perf_counter(), str(generated_ahead.wait(120))))
            generated_ahead.clear()
        events.append(("train", r, started, time.perf_counter(), threading.current_thread().name))
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HFEngine, "generate", timed_generate)
        patch.setattr(loop._Actor, "rollout", timed_rollout)
        patch.setattr(SelfPlay, "_train", timed_train)
        patch.setattr(bridge, "sync_weights", timed_sync)
        SelfPlay(_config(base, "a", "selfplay.save_interval=2")).run()
    threads_after_a = _rollout_threads()

    # B: SIGUSR1 during train(2), rollout 3 playing ahead: it regenerates the set (the environments and their memory
    # rows change), then its play waits until the stop's save is done: a loop that waited for the rollout ahead before
    # saving would hang here. Its engine call, made after the save, is refused: the rollout is abandoned.
    seen: dict[str, Any] = {}
    saved = threading.Event()

    def stop_in_train_2(self: SelfPlay, trainer: Any, samples: Any, r: int) -> Any:
        if r == 2:  # SLURM's time-limit warning
            os.kill(os.getpid(), signal.SIGUSR1)
        return train(self, trainer, samples, r)

    def play_3_after_the_save(self: Any, r: int, transcript: Any) -> Any:
        if r == 3:
            seen["saved_first"] = saved.wait(120)
        try:
            return play(self, r, transcript)
        except loop._Abandoned:
            seen["abandoned"] = r
            raise

    def saved_when(self: SelfPlay, trainer: Any, actor: Any, r: int, **kwargs: Any) -> None:
        seen.setdefault("saves", []).append((r, actor is not None and actor.ahead is not None))
        save(self, trainer, actor, r, **kwargs)
        saved.set()

    save, play = SelfPlay._save, loop._Actor.play
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SelfPlay, "_train", stop_in_train_2)
        patch.setattr(SelfPlay, "_save", saved_when)
        patch.setattr(loop._Actor, "play", play_3_after_the_save)
        stopped = SelfPlay(_config(base, "c", "selfplay.save_interval=4")).run()
    c_at_stop = {"transcripts": rollouts_written(base / "c"), "memory": _memory(base / "c"),
                 "records": sorted(_records(base / "c")), "checkpoints": sorted(
                     p.name for p in CheckpointStore(base / "c").root.glob("step_*"))}
    shutil.copytree(base / "c", base / "c_stopped")
    c_resumed = SelfPlay(_config(base, "c", "selfplay.save_interval=4")).run()
    return {"base": base, "events": events, "intra_op": intra_op, "threads_after_a": threads_after_a, "seen": seen,
            "stopped": stopped, "c_at_stop": c_at_stop, "c_resumed": c_resumed}


@pytest.mark.slow
def test_the_next_rollout_plays_while_the_trainer_steps_except_after_a_drain_point(runs: dict[str, Any]) -> None:
    events = runs["events"]
    rollouts = {r: (start, end, thread) for what, r, start, end, thread in events if what == "rollout"}
    trains = {r: (start, end) for what, r, start, end, _ in events if what == "train"}
    assert [(r, came) for what, r, _, _, came in events if what == "generated_ahead"] == [(1, "True"), (3, "True")]
    assert sorted(rollouts) == [1, 2, 3, 4] and sorted(trains) == [1, 2, 3, 4]
    # rollouts 2 and 4 on the rollout thread, their first engine call before the step of the rollout before ends
    for r in (2, 4):
        start, end, thread = rollouts[r]
        assert thread.startswith(ROLLOUT_THREAD), (r, thread)
        calls = [s for what, _, s, e, t in events if what == "generate" and start <= s <= end]
        assert calls and start < trains[r - 1][1] and min(calls) < trains[r - 1][1], (r, calls, trains[r - 1])
    # rollout 1 (the first) and 3 (after the save of rollout 2) on the loop's own thread, after the step before
    for r in (1, 3):
        assert rollouts[r][2] == "MainThread"
    assert rollouts[3][0] > trains[2][1]
    # no weight sync while a rollout plays (the first is the run's start, before any)
    syncs = [(start, end) for what, _, start, end, _ in events if what == "sync"]
    assert len(syncs) == 5  # the run's start, then each rollout's new weights
    for start, end in syncs:
        assert not any(s < end and start < e for s, e, _ in rollouts.values()), (start, end)
    assert runs["threads_after_a"] == []
    assert runs["intra_op"] == {1}  # as many torch threads as the loop's  # the rollout thread does not outlive the run


@pytest.mark.slow
def test_each_rollout_is_played_by_the_weights_before_the_step_it_overlaps_and_the_lag_is_recorded(
        runs: dict[str, Any]) -> None:
    run_dir = runs["base"] / "a"
    records = _records(run_dir)
    step = {r: int(records[r]["train/optimizer_step"]) for r in records}
    assert step == {1: 1, 2: 2, 3: 3, 4: 4}  # one optimizer step per rollout
    # the weights that played r: those before train(r - 1) when r overlapped it, those after it otherwise (r = 3
    # after the drain point 2, r = 1 the initial ones); a synchronous run would show [0, 1, 2, 3]
    played_by = {1: 0, 2: 0, 3: step[2], 4: step[2]}
    for r in (1, 2, 3, 4):
        with gzip.open(transcript_path(run_dir, r), "rt") as f:
            versions = {json.loads(line)["weight_version"] for line in f}
        assert versions == {played_by[r]}, (r, versions)
        assert records[r]["rollout/weight_version"] == played_by[r]
        lag = (step[r - 1] if r > 1 else 0) - played_by[r]
        assert records[r]["rollout/policy_lag"] == lag == (1 if r in (2, 4) else 0)
        # the engine-vs-trainer gap under the same weights keeps its name and meaning; a lagged one has its own
        if lag == 0:
            assert records[r]["train/rollout_logprob_abs_diff_max"] < 1e-4
            assert "train/offpolicy_logprob_abs_diff" not in records[r]
        else:
            assert "train/rollout_logprob_abs_diff" not in records[r]
            assert records[r]["train/offpolicy_logprob_abs_diff_max"] > 1e-3  # lr 0.01 moved the policy
        assert 0 <= records[r]["time/rollout_wait_s"] and records[r]["time/iteration_s"] > 0


@pytest.mark.slow
def test_sigusr1_while_the_next_rollout_plays_saves_without_it_and_the_resume_continues_as_the_straight_run(
        runs: dict[str, Any], tmp_path: Path) -> None:
    base, seen, at_stop = runs["base"], runs["seen"], runs["c_at_stop"]
    assert runs["stopped"].stopped and runs["stopped"].rollouts == 2
    # saved while rollout 3 waited (it had regenerated), which was then abandoned at its engine call
    assert seen["saves"] == [(2, True)] and seen["saved_first"] and seen["abandoned"] == 3
    assert at_stop["records"] == [1, 2] and at_stop["transcripts"] == [1, 2]
    # the memory rows rollout 3 wrote (its set's verdicts) are dropped: the memory is A's as of rollout 2
    shutil.copy(base / "a" / "memory.sqlite", tmp_path / "a_memory.sqlite")
    with EnvMemory(tmp_path / "a_memory.sqlite") as memory:
        memory.discard_after(2)
    assert at_stop["memory"] == _memory(tmp_path, "a_memory.sqlite")
    # the checkpoint of rollout 2 is the one A saved there (a drain point for A): loop state, model and optimizer
    stopped = base / "c_stopped"
    assert at_stop["checkpoints"] == [_checkpoint_of(stopped, 2).name]
    _same_checkpoint(_checkpoint_of(stopped, 2), _checkpoint_of(base / "a", 2), tmp_path)
    # resumed, rollout 3 plays after the sync (as in A, after its drain point) and the run continues as A did
    assert runs["c_resumed"].resumed_from == 2
    ra, rc = _records(base / "a"), _records(base / "c")
    for r in (3, 4):
        assert _untimed(ra[r]) == _untimed(rc[r]), {k: (ra[r].get(k), rc[r].get(k)) for k in ra[r] | rc[r]
                                                    if ra[r].get(k) != rc[r].get(k) and not k.startswith(TIMING)}
    _same_checkpoint(_checkpoint_of(base / "a", 4), _checkpoint_of(base / "c", 4), tmp_path)
    assert _memory(base / "a") == _memory(base / "c")
    assert _rollout_threads() == []


class _Broken(Exception):
    """A failure inside the rollout ahead (an engine lost, a bug)."""


@pytest.mark.slow
def test_a_failure_in_the_rollout_ahead_stops_the_run_with_its_error(tmp_path: Path) -> None:
    play = loop._Actor.play

    def breaks_in_rollout_2(self: Any, r: int, transcript: Any) -> Any:
        if r == 2:
            assert threading.current_thread().name.startswith(ROLLOUT_THREAD)
            raise _Broken("rollout 2 broke")
        return play(self, r, transcript)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop._Actor, "play", breaks_in_rollout_2)
        with pytest.raises(_Broken, match="rollout 2 broke"):
            SelfPlay(_config(tmp_path, "broken", "selfplay.save_interval=4")).run()
    assert sorted(_records(tmp_path / "broken")) == [1]  # rollout 1 trained and logged, then the error
    assert _rollout_threads() == []


def _child_processes() -> set[int]:
    """This process's children (sandbox workers, bubblewrap), from /proc."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == os.getpid():
            found.add(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_a_failure_in_training_while_the_next_rollout_plays_stops_it_before_the_engine_and_sandbox_close(
        tmp_path: Path) -> None:
    """train(1) fails while rollout 2 is inside an engine call on the rollout thread: the run raises train's error,
    the call in flight finishes, the rollout stops at its next engine call, and its thread is joined before the
    engine and the sandbox pool are closed (no worker process left)."""
    from spade_mega.envs.sandbox.pool import SandboxPool

    train, generate, close_pool, close_engine = SelfPlay._train, HFEngine.generate, SandboxPool.close, HFEngine.close
    in_call, failed = threading.Event(), threading.Event()
    closed_beside: list[tuple[str, list[str]]] = []  # (what closed, the rollout threads alive then)

    def held_generate(self: HFEngine, requests: Any) -> Any:
        if threading.current_thread().name.startswith(ROLLOUT_THREAD) and not in_call.is_set():
            in_call.set()
            assert failed.wait(120)  # still in the call when training fails
        return generate(self, requests)

    def fails_in_train_1(self: SelfPlay, trainer: Any, samples: Any, r: int) -> Any:
        if r == 1:
            assert in_call.wait(120)
            failed.set()
            raise _Broken("train(1) broke")
        return train(self, trainer, samples, r)

    def recorded(name: str, close: Any) -> Any:
        def wrapped(self: Any) -> None:
            closed_beside.append((name, [t.name for t in _rollout_threads()]))
            close(self)
        return wrapped

    before = _child_processes()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HFEngine, "generate", held_generate)
        patch.setattr(SelfPlay, "_train", fails_in_train_1)
        patch.setattr(SandboxPool, "close", recorded("pool", close_pool))
        patch.setattr(HFEngine, "close", recorded("engine", close_engine))
        with pytest.raises(_Broken, match=r"train\(1\) broke"):
            SelfPlay(_config(tmp_path, "train_broke", "selfplay.save_interval=4")).run()
    assert sorted(name for name, _ in closed_beside) == ["engine", "pool"]
    assert all(alive == [] for _, alive in closed_beside), closed_beside
    assert _rollout_threads() == []
    assert _child_processes() <= before
    assert not (tmp_path / "train_broke" / "metrics.jsonl").exists() or _records(tmp_path / "train_broke") == {}


@pytest.mark.slow
@pytest.mark.multiproc
def test_an_abandoned_rollout_ahead_leaves_no_designer_reward_in_the_memory(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Rollout 2, played ahead, releases rollout 1's designer samples and pays the valid one on its evaluation of
    rollout 1, which the memory's discard_after(1) keeps. Abandoned at a stop, it must leave that reward unwritten: the
    resumed run plays rollout 2 anew by other weights, whose reward may differ or be masked (nothing overwrites it
    then). A rollout the loop keeps writes it. (test_solvability's scripted solver and designer, real sandbox.)"""
    from test_solvability import scripted_designer_actor

    actor, good, _ = scripted_designer_actor(tmp_path, monkeypatch, "selfplay.async_rollouts=true")

    def rewards() -> dict[int, Any]:
        return {e.iteration: e.designer_reward for e in actor.memory.get(good.content_hash).evaluations}

    try:
        actor.keep(actor.rollout(1))  # releases nothing yet (designer_delay 1)
        actor.start_ahead(2)
        assert actor.ahead is not None
        played = actor.ahead[2].result()  # played to its end: it paid rollout 1's designer
        assert played.metrics["designer/released"] == 2
        actor.abandon_ahead()  # a stop
        abandoned = rewards()
        actor.keep(actor.rollout(2))  # the resumed run's rollout 2, kept
        kept = rewards()
    finally:
        actor.close()
    assert abandoned == {1: None}
    assert kept[1] is not None and kept[1] > 0


@pytest.mark.parametrize("overrides", [
    ["inference.release_memory=true", "rollout.engine=vllm"],
    ["rollout.engine=sglang"],  # colocated (placement auto) servers release their memory (auto) on a GPU machine
    ["rollout.engine=vllm", "launch.engine_placement=colocated"],
])
def test_an_engine_that_releases_its_memory_for_training_is_refused(overrides: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(ROOT / "examples" / "configs" / "tiny_cpu.yaml", ["selfplay.async_rollouts=true", *overrides])
    assert info.value.path == "selfplay.async_rollouts"
    assert "launch.engine_placement separate" in str(info.value) and "inference.release_memory false" in str(
        info.value)


def test_a_trainer_forced_to_release_its_memory_while_the_engine_generates_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(ROOT / "examples" / "configs" / "tiny_cpu.yaml",
                    ["selfplay.async_rollouts=true", "parallel.offload_trainer=true"])
    assert info.value.path == "parallel.offload_trainer" and "auto or false" in str(info.value)


@pytest.mark.parametrize("overrides", [
    [],  # the in-process hf engine
    ["rollout.engine=vllm", "inference.release_memory=false"],
    ["rollout.engine=sglang", "launch.engine_placement=separate", "launch.engine_nodes=1"],
])
def test_engines_that_keep_their_memory_are_accepted(overrides: list[str]) -> None:
    cfg = load_config(ROOT / "examples" / "configs" / "tiny_cpu.yaml", ["selfplay.async_rollouts=true", *overrides])
    assert cfg.selfplay.async_rollouts


@pytest.mark.slow
def test_a_server_engine_generates_the_next_rollout_while_the_trainer_steps_and_reloads_only_between(
        tmp_path: Path) -> None:
    """rollout.engine vllm attached to a vLLM-speaking server in a thread (tests/test_engine_memory.py's emulator,
    which records every call): the server answers rollout 2's and 4's generations while train(1) and train(3) run,
    and every weight reload comes between rollouts, after the one played ahead was collected."""
    from test_engine_memory import TOK, MemoryServer

    from spade_mega.inference.server import write_model_folder

    server = MemoryServer("vllm")
    try:
        cfg = _config(tmp_path, "served", "selfplay.save_interval=2", "rollout.engine=vllm",
                      f"inference.server_urls=[{server.url}]", "inference.release_memory=false",
                      "inference.request_timeout_s=30")
        cfg.inference.hf_weights = str(write_model_folder(tmp_path / "folder", cfg.model, TOK))
        train, rollout = SelfPlay._train, loop._Actor.rollout

        def generated_ahead(r: int) -> bool:  # a generation of rollout r + 1 since train(r) began
            events = list(server.events)
            if f"rollout:{r + 1}" not in events:
                return False
            since = max(events.index(f"train:{r}"), events.index(f"rollout:{r + 1}"))
            return "generate" in events[since:]

        def traced_train(self: SelfPlay, trainer: Any, samples: Any, r: int) -> Any:
            with server.lock:
                server.events.append(f"train:{r}")
            out = train(self, trainer, samples, r)
            if r in (1, 3):  # rollout r + 1 generates meanwhile: train(r) ends once the server saw it
                deadline = time.monotonic() + 120
                while not generated_ahead(r):
                    assert time.monotonic() < deadline, server.events
                    time.sleep(0.01)
            with server.lock:
                server.events.append(f"trained:{r}")
            return out

        def traced_rollout(self: Any, r: int) -> Any:
            with server.lock:
                server.events.append(f"rollout:{r}")
            out = rollout(self, r)
            with server.lock:
                server.events.append(f"played:{r}")
            return out

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(SelfPlay, "_train", traced_train)
            patch.setattr(loop._Actor, "rollout", traced_rollout)
            SelfPlay(cfg).run()
    finally:
        server.close()
    events = [e for e in server.events if e in ("generate", "reload") or ":" in e]
    for r in (1, 3):  # rollout r + 1 started before train(r) ended and generated during it
        start, end = events.index(f"train:{r}"), events.index(f"trained:{r}")
        since = max(start, events.index(f"rollout:{r + 1}"))
        assert since < end and "generate" in events[since:end], events
    played = False
    for event in events:  # no reload between a rollout's start and its end
        if event.startswith(("rollout:", "played:")):
            played = event.startswith("rollout:")
        assert not (played and event == "reload"), events
    assert events.count("reload") == 5  # the run's start, then each rollout's weights
    assert _rollout_threads() == []


BROKEN_AHEAD = """
import sys, threading
from spade_mega.selfplay import loop
play = loop._Actor.play
def broken(self, r, transcript):
    if r == 2:
        raise RuntimeError(f"rollout 2 broke on the {threading.current_thread().name.split('_')[0]} thread")
    return play(self, r, transcript)
loop._Actor.play = broken
from spade_mega.cli import main
sys.exit(main(["train", *sys.argv[1:]]))
"""


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_failure_in_the_rollout_ahead_stops_every_rank_naming_it(tmp_path: Path) -> None:
    """Two data-parallel ranks: rank 0's rollout ahead fails while both ranks train on rollout 1; rank 0 raises it when
    it collects the rollout and rank 1, waiting for that rollout's samples, stops naming it."""
    import subprocess
    import sys

    script = tmp_path / "broken_ahead.py"
    script.write_text(BROKEN_AHEAD)
    isolation = [] if strict_missing() is None else ["sandbox.isolation=best-effort"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
         str(ROOT / "examples" / "configs" / "tiny_learn.yaml"), f"run.output_dir={tmp_path}", "logging.progress=false",
         "logging.tensorboard=false", *isolation, "rollout.agent_trajectories_per_env=4", "selfplay.global_batch_size=4",
         "selfplay.num_rollouts=4", "selfplay.save_interval=4", "selfplay.async_rollouts=true"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert "[rank0]: RuntimeError: rollout 2 broke on the spade-rollout thread" in proc.stderr, proc.stderr[-4000:]
    assert "rank 0 failed, so rank 1 stops too: RuntimeError: rollout 2 broke on the spade-rollout thread" in \
        proc.stderr
    assert sorted(_records(tmp_path / "tiny_learn")) == [1]
