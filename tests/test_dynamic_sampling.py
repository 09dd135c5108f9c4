"""DAPO-style dynamic sampling (``rl.filter_zero_std_groups``): an environment's agent group whose rewards are all equal
carries no policy gradient and is left out of the optimizer steps. The filter itself (fast), then the real loop
(agent-only, the tiny Megatron model on gloo, the in-process engine, environment programs in sandbox workers): what
is trained changes, what is measured does not, a rollout where every group is flat takes no optimizer step, and a run
resumed after such a rollout continues as the straight run."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch
from sandbox_support import strict_missing

from spade_mega.cli import main
from spade_mega.config.errors import ConfigError
from spade_mega.config.loader import load_config
from spade_mega.config.schema import KernelsConfig, RLConfig
from spade_mega.selfplay.batch import Trajectory, advantages, filter_zero_std_groups, train_samples
from spade_mega.selfplay.loop import SelfPlay
from spade_mega.selfplay.state import CheckpointStore, derive_seed

ROOT = Path(__file__).resolve().parents[1]
LEARN = ROOT / "examples" / "configs" / "tiny_learn.yaml"
TIMING = ("time/", "perf/", "train/tokens_per_s", "train/step_time_s", "gpu/")


def _trajectory(role: str, reward: float, group: str, valid: bool = True) -> Trajectory:
    return Trajectory([1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -1.0, -2.0], role, reward, group,  # type: ignore[arg-type]
                      valid)


# --- the filter ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("std_normalize", [True, False])
def test_flat_agent_groups_are_filtered_and_every_other_sample_trains_as_before(std_normalize: bool) -> None:
    batch = [_trajectory("agent", 1.0, "env0"), _trajectory("agent", 1.0, "env0"),  # always won
             _trajectory("agent", 0.0, "env1"), _trajectory("agent", 0.0, "env1"),  # always lost
             _trajectory("agent", 1.0, "env2"), _trajectory("agent", 0.0, "env2"),  # wins and losses
             _trajectory("agent", 0.5, "env3"),  # a group of one (its other plays broke)
             _trajectory("designer", -0.5, "logic"), _trajectory("designer", -0.5, "logic"),  # flat, never dropped
             _trajectory("designer", 0.3, "maths", valid=False)]  # masked: not trained, not filtered
    marked, groups = filter_zero_std_groups(batch)
    assert groups == 3
    assert [t.filtered for t in marked] == [True] * 4 + [False, False, True, False, False, False]
    assert [t.trains for t in marked] == [False] * 4 + [True, True, False, True, True, False]
    assert all(m is t for m, t in zip(marked, batch) if not m.filtered)  # untouched ones are the same objects
    assert all(m.token_ids is t.token_ids for m, t in zip(marked, batch))  # the transcript finds records by them
    rl = RLConfig(adv_std_normalize=std_normalize)
    before = advantages(batch, 2.0, rl, KernelsConfig(enabled=False))
    after = advantages(marked, 2.0, rl, KernelsConfig(enabled=False))
    assert torch.equal(before, after)
    assert (after[[0, 1, 2, 3, 6]] == 0).all()  # what is dropped carried exactly no policy gradient
    samples = train_samples(marked, after)
    kept = [4, 5, 7, 8]
    assert len(samples) == len(kept)
    for sample, k in zip(samples, kept):
        assert sample.role == batch[k].role and float(sample.advantages[-1]) == float(after[k])
    off = train_samples(batch, before)  # the option off: every valid sample, as before
    assert len(off) == 9


def test_equal_means_equal_as_the_advantage_op_reads_the_rewards() -> None:
    # 1 and 1 + 1e-9 are one float32: the advantage op gives them exactly 0, so they are a flat group
    close = [_trajectory("agent", 1.0, "env0"), _trajectory("agent", 1.0 + 1e-9, "env0")]
    apart = [_trajectory("agent", 1.0, "env0"), _trajectory("agent", 1.0 + 1e-6, "env0")]
    assert filter_zero_std_groups(close)[1] == 1 and filter_zero_std_groups(apart)[1] == 0
    assert filter_zero_std_groups([]) == ([], 0)


def test_the_option_is_off_by_default_and_refused_with_groups_of_one() -> None:
    assert RLConfig().filter_zero_std_groups is False
    for path in ("tiny_cpu.yaml", "tiny_learn.yaml", "qwen3_30b_a3b_games.yaml"):
        assert load_config(ROOT / "examples" / "configs" / path).rl.filter_zero_std_groups is False
    load_config(LEARN, ["rl.filter_zero_std_groups=true", "rollout.agent_trajectories_per_env=2"])
    with pytest.raises(ConfigError) as info:
        load_config(LEARN, ["rl.filter_zero_std_groups=true", "rollout.agent_trajectories_per_env=1"])
    assert info.value.path == "rl.filter_zero_std_groups" and "agent_trajectories_per_env" in str(info.value)


# --- the real loop ------------------------------------------------------------------------------------------------

# Won by a reply whose first character has an even code point (about half of a random model's), except on odd reset
# seeds, where every play wins: the rollouts of an odd seed have a flat group, chosen by run.seed (derive_seed).
COIN = '''class Coin:
    max_turns = 1

    def reset(self, seed):
        self.flat = seed % 2 == 1
        return "Say something."

    def step(self, action):
        won = self.flat or ord((action or " ")[0]) % 2 == 0
        return "Done.", 1.0 if won else 0.0, True, False, {}
'''
LOSE = '''class Wall:
    max_turns = 1

    def reset(self, seed):
        return "Say something."

    def step(self, action):
        return "No.", 0.0, True, False, {}
'''
PLAYS = 6


def _seed() -> int:
    """A run.seed whose coin environment (slot 0) has plays that differ at rollouts 1 and 3 and a flat group at 2."""
    return next(s for s in range(10_000)
                if [derive_seed(s, "reset", r, 0) % 2 for r in (1, 2, 3)] == [0, 1, 0])


def _config(tmp_path: Path, name: str, *extra: str):
    (tmp_path / "coin.py").write_text(COIN)
    (tmp_path / "wall.py").write_text(LOSE)
    isolation = [] if strict_missing() is None else ["sandbox.isolation=best-effort"]
    return load_config(LEARN, [
        f"run.output_dir={tmp_path}", f"run.name={name}", f"run.seed={_seed()}", "logging.progress=false",
        "logging.tensorboard=false", *isolation, f"rollout.agent_trajectories_per_env={PLAYS}",
        "rollout.hint_plays_per_env=2", "rollout.envs_per_rollout=2", "selfplay.global_batch_size=4",
        "selfplay.save_interval=1", "selfplay.keep_checkpoints=3",
        "optimizer.lr=1e-4",  # tiny_learn's 1e-2 learns the coin in two steps: rollout 3's plays were all alike
        f"selfplay.environments=[{{path: {tmp_path / 'coin.py'}, hint: h, skill: logic}}, "
        f"{{path: {tmp_path / 'wall.py'}, hint: h, skill: logic}}]", *extra])


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _episodes(run_dir: Path, rollout: int) -> list[dict]:
    with gzip.open(run_dir / "rollouts" / f"rollout_{rollout:06d}.jsonl.gz", "rt") as f:
        return [r for r in map(json.loads, f) if r["kind"] == "episode"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``plain``: one rollout without the filter. ``filtered``: three with it, saved after each (rollout 2's flat
    groups take no step, so its checkpoint replaces rollout 1's, the same trainer step). ``resumed``: a copy of
    ``filtered`` as if the job died after rollout 2's checkpoint, resumed to the end."""
    base = tmp_path_factory.mktemp("dynamic_sampling")
    SelfPlay(_config(base, "plain", "selfplay.num_rollouts=1")).run()
    SelfPlay(_config(base, "filtered", "selfplay.num_rollouts=3", "rl.filter_zero_std_groups=true")).run()
    shutil.copytree(base / "filtered", base / "resumed")
    store = CheckpointStore(base / "resumed")
    for checkpoint in store.root.glob("step_*"):
        if store.read_state(checkpoint).rollout > 2:
            shutil.rmtree(checkpoint)
    SelfPlay(_config(base, "resumed", "selfplay.num_rollouts=3", "rl.filter_zero_std_groups=true")).run()
    return {name: base / name for name in ("plain", "filtered", "resumed")}


@pytest.mark.slow
def test_filtering_changes_what_is_trained_never_what_is_measured(runs: dict[str, Path]) -> None:
    off, on = _records(runs["plain"])[1], _records(runs["filtered"])[1]
    measured = {k for k in off if not k.startswith(("train/", "step", "time", "agent/trained_episodes"))
                and not k.startswith(TIMING)}
    assert {"agent/return", "agent/win_rate", "agent/hint_return", "designer/regret", "agent/episodes"} <= measured
    assert {k: on[k] for k in measured} == {k: off[k] for k in measured}
    assert "agent/filtered_groups" not in off  # the option off logs exactly what it logged before
    # rollout 1: the coin's plays differ (seed chosen so), the wall's are all lost
    episodes = _episodes(runs["filtered"], 1)
    coin = {e["reward"] for e in episodes if e["group"] == "env0" and not e["hinted"]}
    assert coin == {0.0, 1.0}, coin
    assert on["agent/filtered_groups"] == 1 and on["agent/filtered_episodes"] == PLAYS
    assert (off["agent/trained_episodes"], on["agent/trained_episodes"]) == (2 * PLAYS, PLAYS)
    assert (off["train/samples_agent"], on["train/samples_agent"]) == (2 * PLAYS, PLAYS)
    assert (off["train/steps"], on["train/steps"]) == (3, 2)  # 12 samples in steps of 4, then 6


@pytest.mark.slow
def test_the_transcript_marks_filtered_plays_as_not_trained(runs: dict[str, Path],
                                                            capsys: pytest.CaptureFixture) -> None:
    for e in _episodes(runs["filtered"], 1):
        if e["hinted"]:  # played for regret, never trained, never filtered
            assert (e["trained"], e["filtered"], e["advantage"]) == (False, False, None)
        elif e["group"] == "env1":  # the wall: all lost
            assert (e["trained"], e["filtered"], e["advantage"]) == (False, True, 0.0), e
        else:
            assert (e["trained"], e["filtered"]) == (True, False) and e["advantage"] != 0.0, e
    assert not any(e["filtered"] for e in _episodes(runs["plain"], 1))
    assert main(["rollouts", str(runs["filtered"]), "--rollout", "1", "--role", "agent"]) == 0
    assert capsys.readouterr().out.count("not trained (filtered: its group's rewards are all equal)") == PLAYS
    report = (runs["filtered"] / "report.html").read_text()  # plotted with the agent's metrics, in the summary
    assert "agent/filtered_groups" in report and "agent/filtered_episodes" in report


@pytest.mark.slow
def test_a_rollout_whose_groups_are_all_flat_takes_no_step_and_a_resume_continues_as_the_straight_run(
        runs: dict[str, Path]) -> None:
    on = _records(runs["filtered"])
    assert on[2]["agent/filtered_groups"] == 2 and on[2]["agent/filtered_episodes"] == 2 * PLAYS
    assert on[2]["agent/win_rate"] == 0.5  # measured as ever: the coin always won, the wall never
    assert on[2]["train/steps"] == 0 and "train/loss" not in on[2] and on[2]["agent/trained_episodes"] == 0
    assert [on[r]["train/optimizer_step"] for r in (1, 2, 3)] == [2, 2, 4]
    assert all(not e["trained"] for e in _episodes(runs["filtered"], 2))
    # rollout 2 changed no weight, so none was sent to the engine again (rollouts 1 and 3 sent theirs): it served
    # step 2's weights on, under that version, through rollout 3's plays
    assert "perf/sync_mb_per_s" in on[1] and "perf/sync_mb_per_s" in on[3], on[3]
    assert "perf/sync_mb_per_s" not in on[2] and on[2]["time/sync_s"] == 0.0, on[2]
    assert {e["weight_version"] for e in _episodes(runs["filtered"], 3)} == {2}
    store = CheckpointStore(runs["filtered"])
    # rollout 2's checkpoint is the trainer's step 2 again, beside the loop state of rollout 2
    assert [(c.name, store.read_state(c).rollout) for c in sorted(store.root.glob("step_*"))] == \
        [("step_00000002", 2), ("step_00000004", 3)]
    resumed = _records(runs["resumed"])
    assert sorted(resumed) == [1, 2, 3]

    def untimed(record: dict) -> dict:
        return {k: v for k, v in record.items() if k != "time" and not k.startswith(TIMING)}

    assert untimed(resumed[3]) == untimed(on[3])
    assert on[3]["train/steps"] == 2 and on[3]["agent/filtered_groups"] == 1
    states = [CheckpointStore(runs[name]) for name in ("filtered", "resumed")]
    assert [s.read_state(s.latest()) for s in states][0] == [s.read_state(s.latest()) for s in states][1]


class _Killed(Exception):
    """The job killed (a time limit, a node lost) as it begins a trainer checkpoint."""


@pytest.fixture(scope="module")
def killed(runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``filtered`` run killed as it begins its second trainer save after rollout 1's, then resumed to the end."""
    from spade_mega.megatron.train import Trainer

    base = tmp_path_factory.mktemp("dynamic_sampling_killed")
    save, calls = Trainer.save, []

    def dies_the_second_time(self: Trainer, *args, **kwargs) -> str:
        calls.append(self.step)
        if len(calls) == 2:
            raise _Killed(f"killed at the save of trainer step {self.step}")
        return save(self, *args, **kwargs)

    cfg = _config(base, "killed", "selfplay.num_rollouts=3", "rl.filter_zero_std_groups=true")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Trainer, "save", dies_the_second_time)
        with pytest.raises(_Killed):
            SelfPlay(cfg).run()
    SelfPlay(cfg).run()
    return base / "killed"


@pytest.mark.slow
def test_a_job_killed_while_saving_after_a_rollout_without_a_step_loses_no_metrics_record(
        runs: dict[str, Path], killed: Path) -> None:
    """Rollout 2 takes no step: its loop state goes beside the trainer's checkpoint of step 2, which nothing changed,
    so it is not written again. (Written again, a kill during that save left rollout 2's state on disk, the resumed
    run went on at rollout 3, and rollout 2's metrics record, logged after the save, was never written.)"""
    straight, resumed = _records(runs["filtered"]), _records(killed)
    assert sorted(resumed) == [1, 2, 3]

    def untimed(record: dict) -> dict:
        return {k: v for k, v in record.items() if k != "time" and not k.startswith(TIMING)}

    assert all(untimed(resumed[r]) == untimed(straight[r]) for r in (1, 2, 3))
    stores = [CheckpointStore(run) for run in (runs["filtered"], killed)]
    assert stores[0].read_state(stores[0].latest()) == stores[1].read_state(stores[1].latest())
