"""The sandbox pool with real isolated workers: the API the rollout uses, isolation as verified from outside,
resource limits, typed failures, worker replacement, batches, and the strict / best-effort modes."""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spade_mega.config.schema import SandboxConfig
from spade_mega.envs.sandbox import (ContractViolation, LoadError, NonFiniteReward, OutputLimitExceeded, ProgramError,
                                     SandboxCrash, SandboxPool, SandboxUnavailable, StepResult)
from spade_mega.envs.sandbox.process import MAX_REPLY_VALUES, Reply, _decode

from sandbox_support import (GUESS_NUMBER, TEST_UID, assert_nothing_left_behind, pid_gone, program, strict_config,
                             strict_missing, strict_pool, wait_warm)

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def pool():
    with strict_pool() as p:
        yield p


def env_source(reset_body: str, step_body: str = "return 'ok', 0.0, True, False, {}", header: str = "",
               max_turns: int = 5) -> str:
    return textwrap.dedent(header) + textwrap.dedent(f"""
class Env:
    max_turns = {max_turns}

    def reset(self, seed):
{textwrap.indent(textwrap.dedent(reset_body), "        ")}

    def step(self, action):
{textwrap.indent(textwrap.dedent(step_body), "        ")}
""")


def test_open_reset_step_plays_an_episode(pool: SandboxPool) -> None:
    with pool.open(program(GUESS_NUMBER)) as env:
        assert (env.class_name, env.max_turns) == ("GuessNumber", 8)
        assert env.reset(7).startswith("I picked a number")
        low, high, result = 1, 100, None
        for _ in range(env.max_turns):
            guess = (low + high) // 2
            result = env.step(str(guess))
            assert isinstance(result, StepResult)
            if result.terminated:
                break
            low, high = (guess + 1, high) if "higher" in result.observation else (low, guess - 1)
        assert result is not None and result.terminated and result.reward == 1.0
        observation, reward, terminated, truncated, info = result  # a plain 5-tuple for callers
        assert (observation, truncated, info) == ("Correct!", False, {})


def test_isolation_is_strict_and_verified_from_outside(pool: SandboxPool) -> None:
    report = pool.isolation
    assert report is not None and report.missing_for_strict() == [], report.describe()
    assert report.uid == TEST_UID
    with pool.open(program(env_source("return 'x'"))) as env:
        status = Path(f"/proc/{env.worker_pid}/status").read_text()
        assert f"Uid:\t{TEST_UID}\t{TEST_UID}" in status and "Seccomp:\t2" in status and "NoNewPrivs:\t1" in status
        assert "CapEff:\t0000000000000000" in status
        for ns in ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup"):
            assert os.readlink(f"/proc/{env.worker_pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
        if report.cgroups:  # where this machine lets us create cgroups, the worker sits in its own, limited
            cgroups = Path(f"/proc/{env.worker_pid}/cgroup").read_text()
            assert "spade-sandbox-" in cgroups


def test_workers_see_a_minimal_read_only_root_and_an_empty_environment(pool: SandboxPool) -> None:
    source = env_source("""
        import json, os
        def can_write(path):
            try:
                open(path, "w").close()
                return True
            except OSError:
                return False
        return json.dumps({"root": sorted(os.listdir("/")), "env": dict(os.environ), "etc": os.path.exists("/etc"),
                           "home": os.path.exists("/home"), "work": os.path.exists("/work"),
                           "usr_w": can_write("/usr/lib/x"), "tmp_w": can_write("/tmp/x"),
                           "uid": os.getuid(), "pid": os.getpid(), "hostname": os.uname().nodename})
    """)
    with pool.open(program(source)) as env:
        seen = json.loads(env.reset(0))
    assert set(seen["root"]) <= {"usr", "lib", "lib64", "bin", "proc", "dev", "tmp", "spade", "root", "etc", "sbin"}
    assert seen["env"] == {"PYTHONHASHSEED": "0"}
    assert not seen["home"] and not seen["work"] and not seen["usr_w"] and seen["tmp_w"]
    assert (seen["uid"], seen["pid"], seen["hostname"]) == (TEST_UID, 2, "sandbox")  # pid 1: bubblewrap's init


def test_fixed_hash_seed_makes_fresh_workers_agree() -> None:
    source = env_source("return str(hash('spade')) + ','.join({'a', 'b', 'c', 'd', 'e', 'f'})")
    with strict_pool(warm_workers=2) as first, strict_pool(warm_workers=1, hash_seed=1) as other:
        observations = [first.open(program(source)).reset(0) for _ in range(2)]
        assert observations[0] == observations[1]
        assert other.open(program(source)).reset(0) != observations[0]


def test_workers_start_and_play_when_the_trainer_holds_descriptors_numbered_above_1024() -> None:
    """The pool lifts the open-file limit so the trainer can hold hundreds of workers, whose descriptors then number
    past 1024: starting a worker must not rely on select() (it refuses them: 'filedescriptor out of range')."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard open-file limit ({hard}) leaves no room past 1024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 4096, hard))
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        with strict_pool(warm_workers=1) as numbered_high:
            with numbered_high.open(program(env_source("return 'start'"))) as env:
                assert env.reset(0) == "start"
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_each_reset_builds_a_fresh_instance(pool: SandboxPool) -> None:
    source = env_source("""
        self.count = getattr(self, "count", 0) + 1
        return str(self.count)
    """)
    with pool.open(program(source)) as env:
        assert [env.reset(s) for s in (0, 1, 2)] == ["1", "1", "1"]


def test_program_output_is_captured_per_call_and_capped(pool: SandboxPool) -> None:
    source = env_source("""
        print("hello from reset")
        return "start"
    """, """
        import os, sys
        os.write(1, b"raw write ")
        print("step said", action, file=sys.stderr)
        return "ok", 0.0, False, False, {}
    """)
    with pool.open(program(source)) as env:
        env.reset(0)
        assert env.last_output == "hello from reset\n"
        env.step("hi")
        assert env.last_output == "raw write step said hi\n"
        env.step("again")
        assert "hi" not in env.last_output  # drained after every call


@pytest.mark.parametrize(("step_body", "error_type", "needle"), [
    ("raise KeyError(action)", ProgramError, "KeyError: 'boom'"),
    ("return 'obs', float('nan'), True, False, {}", NonFiniteReward, "nan"),
    ("return 'obs', 0.0, 1, False, {}", ContractViolation, "terminated must be a bool"),
    ("return 'obs', 0.0, True, False, {1: 'x'}", ContractViolation, "keys must be str"),
    ("return 'obs', '1.0', True, False, {}", ContractViolation, "reward must be a float"),
    ("return ['o', 0.0, True, False]", ContractViolation, "got 4 values"),
])
def test_contract_breaches_are_typed_and_retire_the_worker(pool: SandboxPool, step_body: str, error_type: type,
                                                           needle: str) -> None:
    with pool.open(program(env_source("return 'start'", step_body))) as env:
        env.reset(0)
        old = env.worker_pid
        with pytest.raises(error_type, match=needle.replace("(", r"\(").replace("[", r"\[")):
            env.step("boom")
        assert env.worker_pid is None and pid_gone(old)
        with pytest.raises(RuntimeError, match="reset"):
            env.step("again")  # the episode ended with the failure
        assert env.reset(1) == "start" and env.worker_pid not in (None, old)  # a fresh worker, program reloaded


def test_load_failures_raise_load_error_with_its_kind(pool: SandboxPool) -> None:
    with pytest.raises(LoadError) as caught:
        pool.open(program("def broken(:\n"))
    assert caught.value.kind == "syntax"
    with pytest.raises(LoadError) as caught:
        pool.open(program("raise SystemExit('no')\n"))
    assert caught.value.kind == "load_error" and "SystemExit" in str(caught.value)


def test_step_many_runs_environments_concurrently_and_keeps_failures_in_their_entry(pool: SandboxPool) -> None:
    sleeper = env_source("return 'start'", """
        import time
        if action == "crash":
            import os
            os._exit(1)
        time.sleep(0.5)
        return action, 0.5, True, False, {"echo": action}
    """)
    envs = [pool.open(program(sleeper)) for _ in range(5)]
    try:
        assert pool.reset_many([(env, i) for i, env in enumerate(envs)]) == ["start"] * 5
        started = time.monotonic()
        results = pool.step_many([(env, "crash" if i == 2 else f"a{i}") for i, env in enumerate(envs)])
        elapsed = time.monotonic() - started
        assert isinstance(results[2], SandboxCrash)
        assert [r.info for i, r in enumerate(results) if i != 2] == [{"echo": f"a{i}"} for i in (0, 1, 3, 4)]
        assert elapsed < 1.6, f"four 0.5 s steps took {elapsed:.2f} s: they did not run concurrently"
        assert pool.reset_many([(envs[2], 0)]) == ["start"]  # the crashed one came back with a fresh worker
        with pytest.raises(ValueError, match="at most once"):
            pool.step_many([(envs[0], "x"), (envs[0], "y")])
    finally:
        for env in envs:
            env.close()
    assert_nothing_left_behind(pool)


def test_cpu_limit_kills_a_runaway_and_handles_renew_workers_at_half_budget() -> None:
    burner = env_source("return 'start'", """
        import time
        end = time.process_time() + float(action)
        while time.process_time() < end:
            pass
        return "burnt", 0.0, False, False, {}
    """)
    with strict_pool(warm_workers=1, cpu_s=1, call_timeout_s=5.0) as small:
        with small.open(program(burner)) as env:
            env.reset(0)
            env.step("0.6")
            first = env.worker_pid
            env.reset(0)  # 0.6 s of its 1 s budget used: the handle moves to a fresh worker before the episode
            assert env.worker_pid != first
            with pytest.raises(SandboxCrash, match="SIGKILL"):  # RLIMIT_CPU, long before the 5 s deadline
                env.step("3")


def test_best_effort_without_bubblewrap_runs_and_says_so_loudly(caplog: pytest.LogCaptureFixture) -> None:
    cfg = SandboxConfig(isolation="best-effort", bwrap="/nonexistent/bwrap", warm_workers=1, uid=TEST_UID,
                        gid=TEST_UID)
    with caplog.at_level(logging.WARNING, logger="spade_mega.sandbox"), SandboxPool(cfg) as weak:
        assert weak.isolation is not None and not weak.isolation.bubblewrap
        assert any("INCOMPLETE" in r.message and "bubblewrap" in r.message for r in caplog.records)
        source = env_source("""
            import socket
            try:
                socket.socket()
                return "socket allowed"
            except OSError as exc:
                return type(exc).__name__
        """)
        with weak.open(program(source)) as env:
            assert env.reset(0) == ("PermissionError" if weak.isolation.seccomp else "socket allowed")
    assert weak.live_workers == 0


def test_strict_refuses_to_start_without_bubblewrap_and_says_what_to_install() -> None:
    with pytest.raises(SandboxUnavailable, match="bubblewrap is not available.*apt-get install bubblewrap"):
        SandboxPool(SandboxConfig(bwrap="/nonexistent/bwrap"))


@pytest.fixture
def broken_bwrap(tmp_path: Path) -> str:
    """A bubblewrap that fails the way it does where the platform refuses namespaces."""
    script = tmp_path / "bwrap"
    script.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    script.chmod(0o755)
    return str(script)


def test_strict_reports_what_bubblewrap_said_when_it_cannot_start(broken_bwrap: str) -> None:
    if strict_missing():
        pytest.skip(f"strict sandbox isolation unavailable: {strict_missing()}")
    with pytest.raises(SandboxUnavailable, match="failed to start.*No permissions to create new namespace"):
        SandboxPool(strict_config(bwrap=broken_bwrap))


def test_best_effort_falls_back_when_bubblewrap_cannot_start(broken_bwrap: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    cfg = SandboxConfig(isolation="best-effort", bwrap=broken_bwrap, warm_workers=1, uid=TEST_UID, gid=TEST_UID)
    with caplog.at_level(logging.WARNING, logger="spade_mega.sandbox"), SandboxPool(cfg) as weak:
        assert weak.isolation is not None and not weak.isolation.bubblewrap
        assert any("WITHOUT bubblewrap" in r.message and "No permissions" in r.message for r in caplog.records)
        with weak.open(program(GUESS_NUMBER)) as env:
            assert env.reset(0).startswith("I picked")


def test_close_kills_every_worker_and_the_pool_refuses_work() -> None:
    pool = strict_pool(warm_workers=2)
    env = pool.open(program(GUESS_NUMBER))
    env.reset(0)
    wait_warm(pool)
    pids = pool.processes()
    assert len(pids) == 9  # three workers (two warm, one open), each with bubblewrap's launcher and init
    pool.close()
    assert all(pid_gone(pid) for pid in pids)
    with pytest.raises(SandboxUnavailable, match="closed"):
        pool.open(program(GUESS_NUMBER))


CLINGY = env_source("""
    import threading, time
    threading.Thread(target=time.sleep, args=(3600,)).start()  # a non-daemon thread that would outlive main()
    return "clinging"
""")


def test_killing_the_trainer_takes_every_worker_with_it(tmp_path: Path) -> None:
    if strict_missing():
        pytest.skip(f"strict sandbox isolation unavailable: {strict_missing()}")
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from spade_mega.config.schema import SandboxConfig
        from spade_mega.envs.sandbox import SandboxPool
        from spade_mega.envs.program import EnvProgram
        pool = SandboxPool(SandboxConfig(warm_workers=3, uid={TEST_UID}, gid={TEST_UID}))
        env = pool.open(EnvProgram({CLINGY!r}, "", ""))
        env.reset(0)
        while pool.warm_workers < 3:
            time.sleep(0.01)
        print(" ".join(map(str, sorted(pool.processes()))), flush=True)
        time.sleep(600)
    """))
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in trainer.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 12
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 5
        while not all(pid_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(pid_gone(p) for p in pids), [p for p in pids if not pid_gone(p)]
    finally:
        trainer.kill()
        trainer.wait()
    stale = list(Path("/sys/fs/cgroup/pids").glob(f"spade-sandbox-{trainer.pid}-*"))
    if stale:  # cgroups were available: the next pool removes the dead trainer's directories
        with strict_pool(warm_workers=1):
            assert not any(p.exists() for p in stale)


_PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4) | st.integers(0, 9), inner,
                                                                 max_size=4), max_leaves=8)
_ENVELOPES = st.tuples(st.integers(0, 5), st.integers(-1, 2), _PLAIN, _PLAIN, _PLAIN).map(list)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=64) | (_PLAIN | _ENVELOPES).map(lambda value: msgpack.packb(value)))
def test_any_reply_bytes_decode_to_a_reply_or_a_stated_problem(body: bytes) -> None:
    decoded = _decode(body, seq=3)
    assert isinstance(decoded, (Reply, str))
    if isinstance(decoded, Reply):
        assert type(decoded.output) is str and type(decoded.output_overflow) is bool


def _step_reply(observation: str, info: dict) -> bytes:
    return msgpack.packb([3, 0, [observation, 0.0, False, False, info], "", False])


def test_reply_decoding_builds_only_what_the_protocol_needs() -> None:
    # 13 values around the info list: envelope (6: itself and its 5 fields), step value (5), the key "n", the list
    at_limit = _step_reply("", {"n": [0.5] * (MAX_REPLY_VALUES - 13)})
    assert len(at_limit) > MAX_REPLY_VALUES and isinstance(_decode(at_limit, 3), Reply)
    over = _step_reply("", {"n": [0.5] * (MAX_REPLY_VALUES - 12)})
    assert f"more than {MAX_REPLY_VALUES} values" in _decode(over, 3)
    observation = _step_reply("x" * (1 << 20), {})  # a long observation is one value: decoded as usual
    assert _decode(observation, 3, max_string=1 << 20).value[0] == "x" * (1 << 20)
    assert "exceeds max_str_len" in _decode(observation, 3, max_string=(1 << 20) - 1)
    for extension in (msgpack.ExtType(1, b""), msgpack.ExtType(7, b"abc"), msgpack.Timestamp(0)):
        assert "undecodable" in _decode(_step_reply("", {"t": extension}), 3)


COUNTER = env_source("""
    self.n = 0
    return "start"
""", """
    self.n += 1
    return f"n={self.n} {action}", 0.0, False, False, {}
""", max_turns=50)


def test_a_handle_outliving_its_pool_never_reaches_another_pools_worker() -> None:
    with strict_pool(warm_workers=1) as first:
        stale = first.open(program(COUNTER))
        stale.reset(0)
    with strict_pool(warm_workers=1) as second:  # its pipes may reuse the closed pool's descriptor numbers
        with second.open(program(COUNTER)) as env:
            env.reset(0)
            with pytest.raises(SandboxCrash, match="already killed"):
                stale.step("from the closed pool")
            assert env.step("mine").observation == "n=1 mine"  # untouched by the stale handle


def test_an_action_that_is_not_valid_text_fails_the_batch_before_anything_is_sent(pool: SandboxPool) -> None:
    envs = [pool.open(program(COUNTER)) for _ in range(2)]
    try:
        pool.reset_many([(env, 0) for env in envs])
        with pytest.raises(ValueError, match="UTF-8"):
            pool.step_many([(envs[0], "fine"), (envs[1], "lone surrogate \udc80")])
        with pytest.raises(ValueError, match="UTF-8"):
            envs[1].step("\ud800")
        assert [r.observation for r in pool.step_many([(env, "next") for env in envs])] == ["n=1 next"] * 2
    finally:
        for env in envs:
            env.close()
    assert_nothing_left_behind(pool)


def test_a_source_that_cannot_be_sent_does_not_leak_its_worker(pool: SandboxPool) -> None:
    wait_warm(pool)
    with pytest.raises(ValueError):
        pool.open(program(COUNTER + "# \udc80\n"))
    wait_warm(pool)
    assert pool.live_workers == pool.warm_workers  # no worker held by nobody
    assert_nothing_left_behind(pool)


def test_a_worker_that_fails_to_start_once_is_retried_not_reported_to_the_caller(tmp_path: Path) -> None:
    if strict_missing():
        pytest.skip(f"strict sandbox isolation unavailable: {strict_missing()}")
    starts = tmp_path / "starts"
    flaky = tmp_path / "bwrap"  # starts 2 to 4 fail, as fork or bubblewrap do on a briefly overloaded machine
    flaky.write_text(f"#!/bin/sh\nn=$(($(cat {starts} 2>/dev/null || echo 0) + 1))\necho $n > {starts}\n"
                     f"if [ $n -ge 2 ] && [ $n -le 4 ]; then echo 'bwrap: Resource temporarily unavailable' >&2; "
                     f"exit 1; fi\nexec {shutil.which('bwrap')} \"$@\"\n")
    flaky.chmod(0o755)
    with SandboxPool(strict_config(bwrap=str(flaky), warm_workers=1, spawners=1)) as flaky_pool:
        with flaky_pool.open(program(GUESS_NUMBER)) as first:
            first.reset(0)
            deadline = time.monotonic() + 10
            while not (starts.exists() and starts.read_text().strip() not in ("", "1")):
                assert time.monotonic() < deadline
                time.sleep(0.005)
            with flaky_pool.open(program(GUESS_NUMBER)) as second:  # waits for the retry
                assert second.reset(0).startswith("I picked")


def test_output_that_is_not_utf8_stays_within_the_output_limit() -> None:
    """Each invalid byte decodes to a 3-byte replacement character: the reply must still fit its frame, and a reply
    over the limit is an output-limit failure, not a protocol error blamed on a garbled pipe."""
    binary = env_source("return 'start'", """
        import os
        os.write(1, b"\\xff" * int(action))
        return "ok", 0.0, False, False, {}
    """)
    with strict_pool(warm_workers=1, output_limit_kb=64, reply_limit_kb=16) as small:
        with small.open(program(binary)) as env:
            env.reset(0)
            env.step("3000")
            assert env.last_output == "\ufffd" * 3000
            with pytest.raises(OutputLimitExceeded, match="over the sandbox limit"):
                env.step("60000")
            env.reset(0)
            with pytest.raises(OutputLimitExceeded, match="more than sandbox.output_limit_kb"):
                env.step("70000")


def test_a_trainer_that_reaps_orphans_is_left_no_zombies(tmp_path: Path) -> None:
    """A trainer that is its container's PID 1, or a subreaper, inherits bubblewrap's exited init: it reaps it."""
    if strict_missing():
        pytest.skip(f"strict sandbox isolation unavailable: {strict_missing()}")
    crash = env_source("return 'start'", "import os\nos._exit(3)")
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(f"""
        import ctypes, os, time
        from spade_mega.config.schema import SandboxConfig
        from spade_mega.envs.sandbox import SandboxCrash, SandboxPool
        from spade_mega.envs.program import EnvProgram
        assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
        with SandboxPool(SandboxConfig(warm_workers=1, uid={TEST_UID}, gid={TEST_UID})) as pool:
            for source in [{crash!r}, {GUESS_NUMBER!r}] * 3:
                with pool.open(EnvProgram(source, "", "")) as env:
                    env.reset(0)
                    try:
                        env.step("50")
                    except SandboxCrash:
                        pass
        time.sleep(0.2)
        me = str(os.getpid())
        zombies = [p for p in os.listdir("/proc") if p.isdigit() and os.path.exists(f"/proc/{{p}}/status")
                   and "State:\\tZ" in open(f"/proc/{{p}}/status").read()
                   and f"PPid:\\t{{me}}\\n" in open(f"/proc/{{p}}/status").read()]
        print(len(zombies))
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0"], done.stdout


def test_a_pool_lifts_a_low_open_file_soft_limit_so_many_environments_stay_open(tmp_path: Path) -> None:
    if strict_missing():
        pytest.skip(f"strict sandbox isolation unavailable: {strict_missing()}")
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(f"""
        import resource
        from spade_mega.config.schema import SandboxConfig
        from spade_mega.envs.sandbox import SandboxPool
        from spade_mega.envs.program import EnvProgram
        with SandboxPool(SandboxConfig(warm_workers=1, uid={TEST_UID}, gid={TEST_UID}, cgroups=False)) as pool:
            envs = [pool.open(EnvProgram({GUESS_NUMBER!r}, "", "")) for _ in range(12)]
            assert all(env.reset(i).startswith("I picked") for i, env in enumerate(envs))
            print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
    """))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 256:
        pytest.skip(f"the hard open-file limit ({hard}) leaves nothing to lift")

    def low_soft_limit() -> None:  # 40 descriptors: fewer than 12 open environments need
        resource.setrlimit(resource.RLIMIT_NOFILE, (40, hard))

    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          preexec_fn=low_soft_limit)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.strip()) > 40
