"""Weights & Biases logging (logging.wandb) with the real wandb package in offline mode: no network, no login.

Each scenario runs in a fresh process, as a training run does: wandb keeps process-wide state (its settings, read
from the environment once, and its service process), which would leak from one scenario into the next. The W&B
runs written are read back with wandb's own reader of ``.wandb`` files (``wandb leet inspect --json``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from spade_mega.config.errors import ConfigError
from spade_mega.config.loader import load_config, to_dict
from spade_mega.config.schema import LoggingConfig, WandbConfig
from spade_mega.monitor import MetricsLogger
from spade_mega.monitor.wandb_sink import (FINISH_TIMEOUT_S, RUN_ID_FILE, STEP_METRIC, WandbError, _finish_timeout,
                                           check_wandb_version, require_wandb)
from sandbox_support import strict_missing
from test_launch import _stand_in_env, _stand_in_job, _training_step_is

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"

# The records a training loop logs: gathered from several calls per step (commit=False), a prefix, step 0 (the
# evaluation before training), a non-finite loss, an int, GPU stats off (this machine has none)
LOG_STEPS = """
import math, sys
from spade_mega.config.schema import LoggingConfig, WandbConfig
from spade_mega.monitor import MetricsLogger

def log_steps(run_dir, steps, resume_step=None, **wandb):
    cfg = LoggingConfig(tensorboard=False, gpu_stats=False, wandb=WandbConfig(enabled=True, **wandb))
    config = {"run": {"name": "w"}, "rl": {"kl": 0.0}}
    with MetricsLogger(run_dir, cfg, resume_step=resume_step, run_config=config) as m:
        for s in steps:
            if s == 0:
                m.log(0, {"eval/arithmetic/accuracy": 0.25})
                continue
            m.log(s, {"agent/return": s / 4, "envs/designer": s}, commit=False)
            m.log(s, {"loss": math.nan if s == 2 else 1 / s, "grad_norm": math.inf if s == 3 else 1.0}, prefix="train")
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Offline W&B with its files, settings and cache under tmp_path, and no key or login of this machine's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wandb-files"), WANDB_SILENT="true",
               WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"), WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
               WANDB_DATA_DIR=str(tmp_path / "wandb-data"), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.update(extra)
    (tmp_path / "wandb-files").mkdir(exist_ok=True)
    return env


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _wandb_records(files: Path) -> list[list[dict]]:
    """The records of every W&B run (attempt) written under ``files``, oldest first. Its directory is named
    ``<mode>-run-<second>-<id>``, with ``-<k>`` added for a k-th attempt in the same second (whose name would sort
    before the first's)."""
    def started(path: Path) -> tuple[str, int]:
        stem, _, k = path.parent.name.partition(path.stem.removeprefix("run-"))
        return stem, int(k.lstrip("-") or 0)

    out = []
    for path in sorted(files.rglob("run-*.wandb"), key=started):
        proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out.append([json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")])
    return out


def _wandb_runs(files: Path, attempts: list[list[dict]] | None = None) -> list[tuple[dict, list[dict]]]:
    """Every W&B run (attempt) written under ``files`` (or of ``attempts``, their records already read), oldest
    first: its run record and its history items."""
    return [(next(r["run"] for r in records if r["type"] == "run"),
             [r["history"]["item"] for r in records if r["type"] == "history"])
            for records in (_wandb_records(files) if attempts is None else attempts)]


def _ours(item: dict) -> dict:
    """A history item without wandb's own keys (_step, _runtime, _timestamp) and the x-axis (``rollout``)."""
    return {k: v for k, v in item.items() if not k.startswith("_") and k != STEP_METRIC}


def _x_axes(records: list[dict]) -> dict:
    """The run's define_metric records: metric name (or glob) -> its x-axis (None for the x-axis itself)."""
    return {m.get("name") or m["glob_name"]: m.get("step_metric") for m in
            (r["metric"] for r in records if r["type"] == "metric")}


def _jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_an_offline_wandb_run_holds_the_jsonl_records_and_the_resolved_config(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "tiny"
    _python(LOG_STEPS + f"log_steps({str(run_dir)!r}, [0, 1, 2, 3], project='spade-test', group='ablation', "
                        "tags=['t1', 't2'])", _env(tmp_path))
    [records] = _wandb_records(tmp_path / "wandb-files")
    [(run, history)] = _wandb_runs(tmp_path / "wandb-files", [records])
    assert _x_axes(records) == {"rollout": None, "*": "rollout"}  # every metric is drawn over the rollout
    assert run["run_id"] == (run_dir / RUN_ID_FILE).read_text().strip()
    assert (run["project"], run["run_group"], run["display_name"], run["tags"]) == \
        ("spade-test", "ablation", "tiny", ["t1", "t2"])
    config = run["config"]["update"]
    assert (config["run"], config["rl"]) == ({"name": "w"}, {"kl": 0})
    # record for record and name for name what metrics.jsonl holds (NaN and inf written alike: "NaN", "Infinity")
    records = _jsonl(run_dir)
    assert [item["rollout"] for item in history] == [r["step"] for r in records] == [0, 1, 2, 3]
    assert [_ours(item) for item in history] == [{k: v for k, v in r.items() if k not in ("step", "time")}
                                                 for r in records]
    assert history[2]["train/loss"] == "NaN" and history[3]["train/grad_norm"] == "Infinity"
    assert history[3]["envs/designer"] == 3
    assert math.isclose(history[3]["train/loss"], 1 / 3)


# an attempt that dies after rollout 3 (an out-of-memory error raised inside the logger's `with`)
DIES_AFTER_ROLLOUT_3 = """
cfg = LoggingConfig(tensorboard=False, gpu_stats=False, wandb=WandbConfig(enabled=True))
try:
    with MetricsLogger(RUN_DIR, cfg) as m:
        for s in (1, 2, 3):
            m.log(s, {"agent/return": s / 4})
        raise RuntimeError("out of memory")
except RuntimeError:
    pass
"""
# the resumed attempt first redoes the evaluation of its checkpoint's rollout (the loop's _evaluation_missing), then
# logs rollout 4 and its evaluation scores, a second record of that step
REDO_EVALUATION = """
cfg = LoggingConfig(tensorboard=False, gpu_stats=False, wandb=WandbConfig(enabled=True))
with MetricsLogger(RUN_DIR, cfg, resume_step=2) as m:
    m.log(2, {"eval/arithmetic/accuracy": 0.5})
    for s in (3, 4):
        m.log(s, {"agent/return": s / 4})
    m.log(4, {"eval/arithmetic/accuracy": 0.75})
"""


def test_a_resumed_run_continues_its_wandb_run_and_a_new_run_starts_another(tmp_path: Path) -> None:
    """An attempt that dies after rollout 3 (checkpoint at 2, its evaluation not logged) and its requeued job
    resuming from step 2 log to one W&B run, on the same x-axis: the redone evaluation of rollout 2 lands at rollout
    2, although W&B holds rows up to 3 (an online W&B run ignores a row logged at an earlier step=). A second record
    of a step (rollout 4's evaluation scores after its metrics) is a row of its own, sent at once (no row kept open
    for a later record), at that rollout. W&B's run state (finished / failed) is how a sweep's crashed runs are
    found: the attempt whose loop raised reports exit code 1, the others 0. Starting the run over (no checkpoint) in
    the same directory logs to a new one."""
    run_dir = tmp_path / "runs" / "tiny"
    env = _env(tmp_path, WANDB_PROJECT="from-env")  # logging.wandb.project unset: W&B's own variable decides
    _python(LOG_STEPS + f"RUN_DIR = {str(run_dir)!r}" + DIES_AFTER_ROLLOUT_3, env)
    first_id = (run_dir / RUN_ID_FILE).read_text().strip()
    _python(LOG_STEPS + f"RUN_DIR = {str(run_dir)!r}" + REDO_EVALUATION, env)
    assert (run_dir / RUN_ID_FILE).read_text().strip() == first_id
    _python(LOG_STEPS + f"log_steps({str(run_dir)!r}, [1])", env)
    new_id = (run_dir / RUN_ID_FILE).read_text().strip()
    written = _wandb_records(tmp_path / "wandb-files")
    attempts = _wandb_runs(tmp_path / "wandb-files", written)
    assert [(run["run_id"], [item["rollout"] for item in history]) for run, history in attempts] == \
        [(first_id, [1, 2, 3]), (first_id, [2, 3, 4, 4]), (new_id, [1])]
    assert [(item["rollout"], _ours(item)) for item in attempts[1][1]] == \
        [(2, {"eval/arithmetic/accuracy": 0.5}), (3, {"agent/return": 0.75}), (4, {"agent/return": 1.0}),
         (4, {"eval/arithmetic/accuracy": 0.75})]
    assert all(_x_axes(records) == {"rollout": None, "*": "rollout"} for records in written)
    assert new_id != first_id and attempts[1][0]["resume"]
    assert {run["project"] for run, _ in attempts} == {"from-env"}
    assert [[r["exit"].get("exit_code", 0) for r in records if r["type"] == "exit"] for records in written] == \
        [[1], [0], [0]]


# two rollouts of the tiny model, as small as a run gets
SHORT_RUN = ["selfplay.num_rollouts=2", "selfplay.global_batch_size=4", "rollout.envs_per_rollout=1",
             "rollout.agent_trajectories_per_env=2", "rollout.hint_plays_per_env=1", "rollout.max_turns=1",
             "rollout.max_response_tokens=8", "rollout.max_designer_tokens=16", "curriculum.corpus.token_budget=32",
             "logging.tensorboard=false", "logging.progress=false", "eval.interval=0", "eval.before_train=false"]


@pytest.mark.slow
def test_a_training_run_logs_its_records_and_resolved_config_to_wandb(tmp_path: Path) -> None:
    """`spade-mega train` with logging.wandb on and no WANDB_DIR: the W&B run lives in the run directory, its
    history is metrics.jsonl's, and its config is the run's config.yaml."""
    env = _env(tmp_path)
    del env["WANDB_DIR"]
    isolation = [] if strict_missing() is None else ["sandbox.isolation=best-effort"]
    overrides = [f"run.output_dir={tmp_path / 'runs'}", *SHORT_RUN, *isolation, "logging.wandb.enabled=true",
                 "logging.wandb.tags=[cpu]"]
    proc = subprocess.run([sys.executable, "-m", "spade_mega.cli", "train", str(TINY), *overrides],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "runs" / "tiny_cpu"
    [(run, history)] = _wandb_runs(run_dir / "wandb")
    assert run["run_id"] == (run_dir / RUN_ID_FILE).read_text().strip()
    assert (run["project"], run["display_name"], run["tags"]) == ("spade-mega", "tiny_cpu", ["cpu"])
    records = _jsonl(run_dir)
    assert [item["rollout"] for item in history] == [r["step"] for r in records] == [1, 2]
    assert [_ours(item) for item in history] == [{k: v for k, v in r.items() if k not in ("step", "time")}
                                                 for r in records]
    assert {"agent/return", "train/loss", "time/rollout_s"} <= set(history[0])
    config = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
    assert config == to_dict(load_config(run_dir / "config.yaml"))


# The W&B service process dies between two records (what a W&B outage looks like from the trainer: every call to it
# fails); the process's own children are found by pid and only the W&B ones are killed
SERVICE_DIES = """
import logging, psutil, sys
from spade_mega.config.schema import LoggingConfig, WandbConfig
from spade_mega.monitor import MetricsLogger

logging.basicConfig(level=logging.INFO)
cfg = LoggingConfig(gpu_stats=False, wandb=WandbConfig(enabled=True))
with MetricsLogger(sys.argv[1], cfg) as m:
    m.log(1, {"agent/return": 0.5})
    service = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("wandb-")]
    assert service, "no wandb service process"
    for p in service:
        p.kill()
    psutil.wait_procs(service, timeout=30)
    for s in (2, 3, 4):
        m.log(s, {"agent/return": s / 2})
print("trained on")
"""


@pytest.mark.slow
def test_a_wandb_failure_mid_run_is_said_once_and_jsonl_and_tensorboard_go_on(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", SERVICE_DIES, str(run_dir)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=_env(tmp_path))
    assert proc.returncode == 0 and "trained on" in proc.stdout, proc.stderr[-4000:]
    assert proc.stderr.count("W&B logging failed") == 1, proc.stderr[-4000:]
    assert "W&B logging failed at step 2" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert [r["step"] for r in _jsonl(run_dir)] == [1, 2, 3, 4]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("agent/return")] == [(1, 0.5), (2, 1.0), (3, 1.5), (4, 2.0)]


class _StandInWandbServer(ThreadingHTTPServer):
    """The W&B API as far as an online wandb.init and run need it (the login check, the run's upsert, its file
    stream: each answered the way api.wandb.ai's GraphQL answers them), until ``outage`` exists: from then on every
    request waits unanswered, a network gone dark. With ``history_rows``, every run asked about exists, started, with
    that many history rows (W&B's _step 0 to history_rows - 1) and config ``rl.kl: 0.5, gone: 3``: a run to resume.
    ``configs`` holds every config the runs sent."""

    daemon_threads = True

    def __init__(self, outage: Path, history_rows: int | None = None) -> None:
        self.outage, self.released, self.history_rows = outage, threading.Event(), history_rows
        self.configs: list[dict] = []
        super().__init__(("127.0.0.1", 0), _StandInWandbHandler)


class _StandInWandbHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _StandInWandbServer

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.server.outage.exists():
            self.server.released.wait()
            return
        request = json.loads(body or b"{}")
        query, variables = request.get("query", ""), request.get("variables") or {}
        data: dict = {}
        if "upsertBucket" in query:
            if variables.get("config"):
                self.server.configs.append(json.loads(variables["config"]))
            project = {"id": "UHJvamVjdDox", "name": variables.get("project"), "entity": {"id": "RW50aXR5OjE=",
                                                                                          "name": "lab"}}
            data = {"upsertBucket": {"inserted": True, "bucket": {
                "id": "QnVja2V0OjE=", "name": variables.get("name"), "displayName": variables.get("displayName"),
                "description": "", "config": "{}", "sweepName": None, "historyLineCount": 0, "project": project}}}
        elif "viewer" in query:
            data = {"viewer": {"id": "VXNlcjox", "entity": "lab", "username": "lab", "flags": "{}",
                               "teams": {"edges": []}}}
        elif "RunResumeStatus" in query:
            rows, bucket = self.server.history_rows, None
            if rows is not None:  # wandbConfig's "t" (telemetry) is how wandb tells a started run
                bucket = {"id": "QnVja2V0OjE=", "name": variables.get("name"), "displayName": "run", "notes": None,
                          "summaryMetrics": "{}", "tags": [], "wandbConfig": '{"t": {}}',
                          "config": json.dumps({"rl": {"value": {"kl": 0.5}}, "gone": {"value": 3}}),
                          "logLineCount": 0, "eventsLineCount": 0, "eventsTail": "[]", "historyLineCount": rows,
                          "historyTail": json.dumps([json.dumps({"_step": rows - 1})])}
            data = {"model": {"id": "UHJvamVjdDox", "name": variables.get("project"), "bucket": bucket,
                              "entity": {"id": "RW50aXR5OjE=", "name": "lab"}}}
        reply = json.dumps({"data": data}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


# An online run whose network goes dark after its first record: the run's end (close) would wait on W&B's retries
NETWORK_DIES = """
import logging, pathlib, sys, time
from spade_mega.config.schema import LoggingConfig, WandbConfig
from spade_mega.monitor import MetricsLogger

logging.basicConfig(level=logging.INFO)
wandb = WandbConfig(enabled=True, mode="online", finish_timeout_s=3)
cfg = LoggingConfig(tensorboard=False, gpu_stats=False, wandb=wandb)
m = MetricsLogger(sys.argv[1], cfg, run_config={"run": {"name": "online"}})
m.log(1, {"agent/return": 0.5})
pathlib.Path(sys.argv[2]).touch()
m.log(2, {"agent/return": 1.0})
began = time.monotonic()
m.close()
print(f"closed in {time.monotonic() - began:.1f} s")
"""


def test_a_network_outage_at_the_end_of_an_online_run_does_not_hold_the_job(tmp_path: Path) -> None:
    """The network goes dark mid-run: W&B retries its uploads for many minutes (measured: still blocked after 20
    min), so the run's end waits logging.wandb.finish_timeout_s at most, says where the data is kept for `wandb
    sync`, and metrics.jsonl holds every record. The API key is written nowhere in the run directory."""
    key = "local-" + "5ecret" * 7
    outage = tmp_path / "outage"
    server = _StandInWandbServer(outage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = _env(tmp_path, WANDB_MODE="online", WANDB_API_KEY=key, HOME=str(tmp_path / "home"),
               WANDB_BASE_URL=f"http://127.0.0.1:{server.server_address[1]}")
    del env["WANDB_DIR"]
    run_dir = tmp_path / "run"
    try:
        proc = subprocess.run([sys.executable, "-c", NETWORK_DIES, str(run_dir), str(outage)], capture_output=True,
                              text=True, timeout=120, cwd=ROOT, env=env)
    finally:
        server.released.set()
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0 and "closed in" in proc.stdout, proc.stderr[-4000:]
    assert float(proc.stdout.split("closed in ")[1].split()[0]) < 30, proc.stdout
    assert proc.stderr.count("did not finish uploading") == 1, proc.stderr[-4000:]
    assert "wandb sync --include-online" in proc.stderr, proc.stderr[-4000:]
    kept = Path(proc.stderr.split("is kept in ")[1].split(":")[0])
    assert kept.parent == run_dir / "wandb" and list(kept.glob("run-*.wandb")), kept
    assert [r["step"] for r in _jsonl(run_dir)] == [1, 2]
    assert key not in proc.stdout + proc.stderr
    leaks = [path for path in run_dir.rglob("*") if path.is_file() and key.encode() in path.read_bytes()]
    assert not leaks, leaks


# A requeued job resuming from the checkpoint of rollout 2 an online W&B run that holds rows up to _step 3 (the
# interrupted attempt's rollouts 1 to 3): it redoes rollout 2's evaluation, then plays rollout 3
ONLINE_RESUME = """
import pathlib, sys
from spade_mega.config.schema import LoggingConfig, WandbConfig
from spade_mega.monitor import MetricsLogger

wandb = WandbConfig(enabled=True, mode="online", finish_timeout_s=3)
m = MetricsLogger(sys.argv[1], LoggingConfig(tensorboard=False, gpu_stats=False, wandb=wandb), resume_step=2,
                  run_config={"rl": {"kl": 0.0}})
m.log(2, {"eval/arithmetic/accuracy": 0.5})
m.log(3, {"agent/return": 0.75})
pathlib.Path(sys.argv[2]).touch()  # the end's file uploads have nowhere to go: the stand-in stores no files
m.close()
"""


def test_a_resumed_online_run_keeps_the_records_of_rollouts_wandb_has_passed(tmp_path: Path) -> None:
    """wandb drops a row logged with step= below the resumed run's current _step (4 here): the redone evaluation of
    rollout 2 and the replayed rollout 3 never reached W&B (both dropped before). Logged without step=, over the
    x-axis `rollout`, both are rows of the resumed run, at their rollouts. The run's config is this attempt's
    (a resume with a changed setting shows it); W&B keeps a top-level key only the earlier attempt had."""
    outage = tmp_path / "outage"
    server = _StandInWandbServer(outage, history_rows=4)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = _env(tmp_path, WANDB_MODE="online", WANDB_API_KEY="local-" + "5ecret" * 7, HOME=str(tmp_path / "home"),
               WANDB_BASE_URL=f"http://127.0.0.1:{server.server_address[1]}")
    del env["WANDB_DIR"]
    run_dir = tmp_path / "run"
    try:
        proc = subprocess.run([sys.executable, "-c", ONLINE_RESUME, str(run_dir), str(outage)], capture_output=True,
                              text=True, timeout=120, cwd=ROOT, env=env)
    finally:
        server.released.set()
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stderr[-4000:]
    [(run, history)] = _wandb_runs(run_dir / "wandb")
    assert run["resume"] and [item["_step"] for item in history] == [4, 5]  # continuing W&B's own count
    assert [(item["rollout"], _ours(item)) for item in history] == \
        [(2, {"eval/arithmetic/accuracy": 0.5}), (3, {"agent/return": 0.75})]
    config = server.configs[-1]
    assert (config["rl"]["value"], config["gone"]["value"]) == ({"kl": 0.0}, 3)


def test_the_finish_timeout_is_the_setting_else_wandbs_variable_else_two_minutes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_FINISH_TIMEOUT", raising=False)
    assert _finish_timeout(WandbConfig()) == FINISH_TIMEOUT_S == 120
    assert _finish_timeout(WandbConfig(finish_timeout_s=0)) == 0  # wandb's own default: wait until uploaded
    monkeypatch.setenv("WANDB_FINISH_TIMEOUT", "30")
    assert _finish_timeout(WandbConfig()) is None  # wandb reads its variable itself
    assert _finish_timeout(WandbConfig(finish_timeout_s=5)) == 5


# wandb.init failing for real: online mode with no API key anywhere (no $WANDB_API_KEY, no ~/.netrc)
INIT_FAILS = LOG_STEPS + """
from spade_mega.monitor import WandbError
try:
    log_steps(sys.argv[1], [1, 2], mode="online")
except WandbError as exc:
    print("refused:", exc)
log_steps(sys.argv[1], [3, 4], resume_step=2, mode="online")
log_steps(sys.argv[1] + "-offline", [1], mode="offline")  # the setting over $WANDB_MODE: no key needed
print("trained on")
"""


def test_wandb_failing_at_start_stops_a_new_run_and_not_a_resumed_one(tmp_path: Path) -> None:
    """A new run learns at once that W&B cannot start (before its first rollout); a requeued run resuming from its
    checkpoint (a network outage at that moment) goes on with metrics.jsonl and TensorBoard, saying so once."""
    (tmp_path / "home").mkdir()
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", INIT_FAILS, str(run_dir)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=_env(tmp_path, WANDB_MODE="online", HOME=str(tmp_path / "home")))
    assert proc.returncode == 0 and "trained on" in proc.stdout, proc.stderr[-4000:]
    assert "refused: logging.wandb: online mode and no W&B API key" in proc.stdout and "wandb login" in proc.stdout
    assert proc.stderr.count("W&B logging failed") == 1, proc.stderr[-4000:]
    assert [r["step"] for r in _jsonl(run_dir)] == [3, 4]
    assert list((tmp_path / "wandb-files" / "wandb").glob("offline-run-*"))


# `spade-mega train` with logging.wandb on, in a process where wandb cannot be imported (sys.modules['wandb'] = None
# makes every `import wandb` raise ImportError, as for a package that is not installed); building the trainer or
# starting torch.distributed leaves a mark
SPY_BUILD = """
import pathlib, sys
import spade_mega.selfplay.loop as loop
from spade_mega.cli import main

mark = pathlib.Path(sys.argv[1])
for name in SPIED:
    built = getattr(loop, name)
    def spy(*args, _built=built, _name=name, **kwargs):
        mark.write_text(_name)
        return _built(*args, **kwargs)
    setattr(loop, name, spy)
sys.exit(main(sys.argv[2:]))
"""
MISSING = 'import sys\nsys.modules["wandb"] = None\nSPIED = ("Trainer", "init_distributed")\n' + SPY_BUILD


@pytest.mark.slow
def test_without_the_wandb_extra_the_run_fails_at_start_naming_it(tmp_path: Path) -> None:
    mark = tmp_path / "built"
    proc = subprocess.run([sys.executable, "-c", MISSING, str(mark), "train", str(TINY),
                           f"run.output_dir={tmp_path / 'runs'}", "logging.wandb.enabled=true"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env(tmp_path))
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "pip install 'spade-mega[wandb]'" in proc.stderr and "logging.wandb.enabled" in proc.stderr
    assert not mark.exists() and not (tmp_path / "runs").exists()  # nothing built, nothing written


@pytest.mark.multiproc
def test_a_new_run_whose_wandb_cannot_start_stops_every_rank_before_the_model_is_built(tmp_path: Path) -> None:
    """Two ranks of `spade-mega train` (started as srun starts its tasks), online W&B with a key but no network:
    wandb.init fails on rank 0 within logging's start, before the trainer is built, and both ranks stop with that
    error in one line (exit 2); rank 1 does not wait for rank 0 in a collective. WANDB_INIT_TIMEOUT shortens wandb's
    90 s wait for its server."""
    from spade_mega.inference.server import free_port

    env = _env(tmp_path, WANDB_MODE="online", WANDB_API_KEY="local-" + "5ecret" * 7, WANDB_INIT_TIMEOUT="5",
               HOME=str(tmp_path / "home"), WANDB_BASE_URL=f"http://127.0.0.1:{free_port()}",  # nothing listens
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    code = 'SPIED = ("Trainer",)\n' + SPY_BUILD
    marks = [tmp_path / f"built-{r}" for r in range(2)]
    ranks = [subprocess.Popen([sys.executable, "-c", code, str(marks[r]), "train", str(TINY),
                               f"run.output_dir={tmp_path / 'runs'}", "logging.wandb.enabled=true"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]
    try:
        errors = [rank.communicate(timeout=240)[1] for rank in ranks]
    finally:  # a rank left waiting for its peer (the failure this test looks for) must not outlive it
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    assert [rank.returncode for rank in ranks] == [2, 2], errors
    refused = "logging.wandb: wandb.init failed for run id "
    lasts = [error.strip().splitlines()[-1] for error in errors]
    assert lasts[0].startswith(f"spade-mega: error: {refused}") and "connection refused" in lasts[0], errors[0]
    assert "logging.wandb.mode=offline" in lasts[0]
    assert lasts[1].startswith(f"spade-mega: error: rank 0 failed, so rank 1 stops too: WandbError: {refused}"), \
        errors[1]
    assert not any(mark.exists() for mark in marks)  # no rank built its model


# `spade-mega train`'s W&B start on a terminal (an interactive srun, torchrun in a shell): online, no API key
ON_A_TERMINAL = LOG_STEPS + """
from spade_mega.monitor import WandbError
try:
    log_steps(sys.argv[1], [1], mode="online")
except WandbError as exc:
    print("refused:", exc)
"""


def test_an_online_run_without_an_api_key_on_a_terminal_fails_instead_of_prompting(tmp_path: Path) -> None:
    """wandb.init asks for an API key when stdin and stderr are a terminal, and waits for the answer (measured:
    still waiting after 40 s): a job would hang there on rank 0. It fails at once, saying how to log in or go
    offline. The process gets a real pseudo-terminal, and wandb's output is not silenced (silent mode never asks)."""
    import pty
    import select
    import time

    (tmp_path / "home").mkdir()
    env = _env(tmp_path, WANDB_MODE="online", HOME=str(tmp_path / "home"), TERM="xterm")
    del env["WANDB_SILENT"]
    terminal, child_end = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", ON_A_TERMINAL, str(tmp_path / "run")], stdin=child_end,
                            stdout=subprocess.PIPE, stderr=child_end, text=True, cwd=ROOT, env=env)
    os.close(child_end)
    shown, began = b"", time.monotonic()
    try:
        while proc.poll() is None and time.monotonic() - began < 60:  # drain the terminal: a full one blocks too
            if select.select([terminal], [], [], 0.5)[0]:
                try:
                    shown += os.read(terminal, 65536)
                except OSError:  # the child closed its end: it is exiting (reaped a moment later, so wait for it)
                    break
        try:
            out = proc.communicate(timeout=max(5.0, 60 - (time.monotonic() - began)))[0]
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after 60 s; the terminal shows {shown[-500:]!r}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(terminal)
    assert proc.returncode == 0 and "refused: logging.wandb: online mode and no W&B API key" in out, (out, shown)
    assert "wandb login" in out and "logging.wandb.mode=offline" in out
    assert b"Enter your choice" not in shown


def test_a_wandb_older_than_the_oldest_supported_is_refused_naming_the_version() -> None:
    for version in ("0.31.0", "0.31.1rc2", "0.32", "1.0.0"):
        check_wandb_version(version)
    for version in ("0.30.9", "0.19.11", "0.9.7"):
        with pytest.raises(WandbError, match=f"wandb {version} is older than 0.31.*pip install -U 'wandb>=0.31'"):
            check_wandb_version(version)


def test_a_wandb_that_breaks_on_import_is_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed wandb whose import raises something other than ImportError (a protobuf it does not support raises
    TypeError, say) stops the run naming wandb and the error, not with a traceback from inside wandb."""
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "__init__.py").write_text('raise TypeError("Descriptors cannot be created directly.")\n')
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(WandbError, match=r"importing wandb failed \(TypeError: Descriptors cannot be created "
                                         r"directly\.\).*logging\.wandb\.enabled=false"):
        require_wandb(WandbConfig(enabled=True, mode="offline"))


def test_a_disabled_wandb_needs_no_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    require_wandb(WandbConfig())  # off by default
    require_wandb(WandbConfig(enabled=True, mode="disabled"))
    monkeypatch.setenv("WANDB_MODE", "disabled")  # W&B's own switch, e.g. for a debugging run
    require_wandb(WandbConfig(enabled=True))


def test_only_the_writing_rank_starts_a_wandb_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of a job checks and drops its records: it never imports wandb (made unimportable here, so an import
    would raise) and writes no run id."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = LoggingConfig(tensorboard=False, gpu_stats=False, wandb=WandbConfig(enabled=True, mode="offline"))
    with MetricsLogger(tmp_path / "run", cfg, rank=1) as metrics:
        metrics.log(1, {"agent/return": 1.0})
    assert not (tmp_path / "run").exists()


NO_WANDB_IMPORT = """
import sys
from spade_mega.config.schema import LoggingConfig, WandbConfig
from spade_mega.monitor import MetricsLogger
for wandb in (WandbConfig(), WandbConfig(enabled=True, mode="disabled")):
    with MetricsLogger(sys.argv[1], LoggingConfig(tensorboard=False, gpu_stats=False, wandb=wandb)) as m:
        m.log(1, {"agent/return": 1.0})
assert "wandb" not in sys.modules, "wandb imported"
"""


def test_the_monitor_without_wandb_on_never_imports_it(tmp_path: Path) -> None:
    env = _env(tmp_path)
    del env["WANDB_MODE"]
    proc = subprocess.run([sys.executable, "-c", NO_WANDB_IMPORT, str(tmp_path / "run")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("override, path", [
    ("logging.wandb.project=team/project", "logging.wandb.project"),
    ("logging.wandb.entity=''", "logging.wandb.entity"),
    ("logging.wandb.name=''", "logging.wandb.name"),
    ("logging.wandb.tags=[a, a]", "logging.wandb.tags"),
    (f"logging.wandb.tags=[{'x' * 65}]", "logging.wandb.tags[0]"),
    ("logging.wandb.mode=dryrun", "logging.wandb.mode"),
    ("logging.wandb.projet=x", "logging.wandb.projet"),
    ("logging.wandb.finish_timeout_s=-1", "logging.wandb.finish_timeout_s"),
])
def test_wandb_settings_errors_name_the_key(override: str, path: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    assert err.value.path == path


@pytest.mark.parametrize("name", ["WANDB_API_KEY", "HF_TOKEN", "wandb_api_key"])
def test_a_key_in_launch_env_is_refused_before_it_is_written_anywhere(name: str) -> None:
    """launch.env lands in the sbatch script, config.yaml, report.html and the W&B run's config: a verl habit of
    putting WANDB_API_KEY there would publish it to everyone who can see the W&B project."""
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [f"launch.env={{{name}: k3y, NCCL_DEBUG: INFO}}"])
    assert err.value.path == f"launch.env.{name}" and "export it in the shell that submits" in str(err.value)
    assert load_config(TINY, ["launch.env={NCCL_DEBUG: INFO, HF_HOME: /scratch/hf}"]).launch.env["NCCL_DEBUG"] == "INFO"


def test_the_slurm_job_passes_the_submitters_wandb_settings_to_the_training_step(tmp_path: Path) -> None:
    """sbatch exports the submitting shell's environment (WANDB_API_KEY from the login node) and the script's
    SLURM_EXPORT_ENV=ALL hands it to every step."""
    script = _stand_in_job(tmp_path, ["logging.wandb.enabled=true"])
    seen = tmp_path / "seen"
    _training_step_is(tmp_path, f"import os, pathlib; pathlib.Path({str(seen)!r}).write_text(' '.join(os.environ.get("
                                "k, '-') for k in ('WANDB_API_KEY', 'WANDB_MODE', 'WANDB_ENTITY')))")
    env = {**_stand_in_env(tmp_path), "WANDB_API_KEY": "k3y", "WANDB_MODE": "offline", "WANDB_ENTITY": "lab"}
    result = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert seen.read_text() == "k3y offline lab"
