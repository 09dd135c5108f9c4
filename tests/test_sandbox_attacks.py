"""Hostile environment programs against strict isolation, for real.

For every attack: the trainer (this process) survives, the attack fails (checked from outside where it could leave a
trace), the worker that ran it is killed and replaced from the warm pool, and no process is left behind. Attack
programs report what they tried by raising (the message travels back in the ProgramError), so every attack ends in a
failed call, and every failed call retires its worker.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import msgpack
import pytest

from spade_mega.envs.sandbox import (ContractViolation, EnvHandle, OutputLimitExceeded, ProgramError, ProtocolError,
                                     SandboxCrash, SandboxError, SandboxPool, SandboxTimeout)
from spade_mega.envs.sandbox.process import MAX_REPLY_VALUES

from sandbox_support import (GUESS_NUMBER, TEST_UID, assert_nothing_left_behind, pid_gone, program, strict_missing,
                             strict_pool)

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def pool():
    with strict_pool(warm_workers=2, call_timeout_s=2.0, memory_mb=512) as p:
        yield p


def attack_program(step_code: str, reset_code: str = "return 'ready'") -> str:
    return (f"class Attack:\n    max_turns = 3\n\n    def reset(self, seed):\n"
            f"{textwrap.indent(textwrap.dedent(reset_code).strip(), ' ' * 8)}\n\n"
            f"    def step(self, action):\n{textwrap.indent(textwrap.dedent(step_code).strip(), ' ' * 8)}\n")


def launch(pool: SandboxPool, step_code: str, reset_code: str = "return 'ready'",
           expect: type[SandboxError] = ProgramError, phase: str = "step") -> tuple[SandboxError, EnvHandle, int]:
    """Run the attack; returns the error it ended in, its handle and the host pid of the worker that ran it."""
    trainer = os.getpid()
    env = pool.open(program(attack_program(step_code, reset_code)))
    worker = env.worker_pid
    assert worker is not None
    with pytest.raises(expect) as caught:
        if phase == "reset":
            env.reset(0)
        else:
            env.reset(0)
            env.step("go")
    assert os.getpid() == trainer  # the trainer survived (still running this very test)
    assert pid_gone(worker), "the worker that ran the attack must be dead and reaped"
    return caught.value, env, worker


def replaced_and_clean(pool: SandboxPool, env: EnvHandle, old: int, reloads: bool = True,
                       also: tuple[SandboxPool, ...] = ()) -> None:
    """The handle comes back on a fresh worker (when the program's reset is harmless), the pool still serves,
    and every sandbox process alive is a live worker of the pool."""
    if reloads:
        assert env.reset(1) == "ready" and env.worker_pid not in (None, old)
    env.close()
    with pool.open(program(GUESS_NUMBER)) as good:
        assert good.reset(0).startswith("I picked")
    assert_nothing_left_behind(pool, also=also)


def report(error: SandboxError) -> dict:
    """The JSON an attack program raised with ``raise RuntimeError("REPORT" + json.dumps(...))``."""
    message = error.message
    assert "REPORT" in message, message
    return json.loads(message.split("REPORT", 1)[1].rsplit(" (line", 1)[0])


TRY = """
import json
results = {}
def attempt(name, fn):
    try:
        results[name] = "SUCCEEDED: " + repr(fn())[:80]
    except BaseException as exc:
        results[name] = type(exc).__name__ + ": " + str(exc)[:80]
"""


def test_infinite_loop_is_killed_at_the_deadline(pool: SandboxPool) -> None:
    started = time.monotonic()
    error, env, old = launch(pool, "while True:\n    pass", expect=SandboxTimeout)
    assert "did not answer within 2.0 s" in str(error) and time.monotonic() - started < 15
    replaced_and_clean(pool, env, old)


def test_memory_bomb_hits_the_address_space_limit(pool: SandboxPool) -> None:
    rss_before = _rss_mb()
    error, env, old = launch(pool, TRY + """
attempt("one_huge_block", lambda: len(bytearray(8 << 30)))
hoard = []
attempt("many_blocks", lambda: [hoard.append(bytes(64 << 20)) for _ in range(1000)])
hoard.clear()
raise RuntimeError("REPORT" + json.dumps(results))
""")
    tried = report(error)
    assert all(outcome.startswith("MemoryError") for outcome in tried.values()), tried
    assert _rss_mb() - rss_before < 100  # the trainer's own memory is untouched
    replaced_and_clean(pool, env, old)


def test_fork_bomb_cannot_create_processes_and_threads_are_capped(pool: SandboxPool) -> None:
    error, env, old = launch(pool, TRY + """
import os, subprocess, threading, time
attempt("fork", os.fork)
attempt("fork_loop", lambda: [os.fork() for _ in range(1000)])
attempt("posix_spawn", lambda: os.posix_spawn("/usr/bin/true", ["true"], {}))
attempt("subprocess", lambda: subprocess.Popen(["/bin/sh", "-c", "sleep 100"]))
started = []
def thread_bomb():
    for _ in range(1000):
        t = threading.Thread(target=time.sleep, args=(30,), daemon=True)
        t.start()
        started.append(t)
attempt("threads", thread_bomb)
results["threads_started"] = len(started)
raise RuntimeError("REPORT" + json.dumps(results))
""")
    tried = report(error)
    for name in ("fork", "fork_loop", "posix_spawn", "subprocess"):
        assert not tried[name].startswith("SUCCEEDED"), tried
    assert tried["fork"].startswith("PermissionError")
    assert tried["threads"].startswith("RuntimeError") and tried["threads_started"] < pool.cfg.threads, tried
    replaced_and_clean(pool, env, old)


def test_cannot_connect_to_a_listening_port_of_the_trainer(pool: SandboxPool) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        error, env, old = launch(pool, TRY + f"""
import socket
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=0.5))
attempt("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", {port})))
attempt("unix", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
attempt("socketpair", socket.socketpair)
raise RuntimeError("REPORT" + json.dumps(results))
""")
        tried = report(error)
        assert all(outcome.startswith("PermissionError") for outcome in tried.values()), tried
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody ever connected
    finally:
        listener.close()
    replaced_and_clean(pool, env, old)


def test_raw_socket_through_ctypes_is_refused(pool: SandboxPool) -> None:
    error, env, old = launch(pool, TRY + """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def raw(call):
    result = call()
    return (result, ctypes.get_errno())
attempt("libc_raw_icmp", lambda: raw(lambda: libc.socket(2, 3, 1)))
attempt("libc_packet", lambda: raw(lambda: libc.socket(17, 3, 0x0300)))
attempt("syscall_socket", lambda: raw(lambda: libc.syscall(41, 2, 3, 1)))
attempt("syscall_socketpair", lambda: raw(lambda: libc.syscall(53, 1, 1, 0, ctypes.byref((ctypes.c_int * 2)()))))
raise RuntimeError("REPORT" + json.dumps(results))
""")
    tried = report(error)
    assert all(outcome == "SUCCEEDED: (-1, 1)" for outcome in tried.values()), tried  # -1 with errno EPERM
    replaced_and_clean(pool, env, old)


def test_x32_abi_syscalls_do_not_bypass_the_filter(pool: SandboxPool) -> None:
    error, env, old = launch(pool, """
import ctypes
ctypes.CDLL(None).syscall(0x40000000 | 41, 2, 3, 1)  # socket() through the x32 ABI
raise RuntimeError("the x32 socket call returned")
""", expect=SandboxCrash)
    assert "SIGSYS" in str(error) or "SIGKILL" in str(error), str(error)
    replaced_and_clean(pool, env, old)


def test_cannot_write_outside_scratch(pool: SandboxPool, tmp_path: Path) -> None:
    target = tmp_path / "open_to_all"
    target.mkdir(mode=0o777)
    target.chmod(0o777)
    error, env, old = launch(pool, TRY + f"""
def write(path):
    with open(path, "w") as f:
        f.write("pwned")
    return path
attempt("usr", lambda: write("/usr/lib/pwned"))
attempt("stdlib", lambda: write(json.__file__))
attempt("host_dir", lambda: write({str(target / "pwned")!r}))
attempt("proc", lambda: write("/proc/sys/kernel/hostname"))
attempt("dev", lambda: write("/dev/pwned"))
attempt("scratch", lambda: write("/tmp/inside_scratch"))
raise RuntimeError("REPORT" + json.dumps(results))
""")
    tried = report(error)
    assert tried.pop("scratch") == "SUCCEEDED: '/tmp/inside_scratch'"
    assert not any(outcome.startswith("SUCCEEDED") for outcome in tried.values()), tried
    assert not (target / "pwned").exists() and not Path("/usr/lib/pwned").exists()
    assert not Path("/tmp/inside_scratch").exists()
    replaced_and_clean(pool, env, old)


def test_cannot_read_secrets_or_the_trainer_environment(pool: SandboxPool, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-VALUE")
    secret.chmod(0o644)
    tmp_path.chmod(0o755)
    monkeypatch.setenv("SPADE_TEST_TOKEN", "TOKEN-IN-TRAINER-ENV")
    error, env, old = launch(pool, TRY + f"""
import os
attempt("secret", lambda: open({str(secret)!r}).read())
attempt("parent_environ", lambda: open("/proc/{os.getpid()}/environ").read())
attempt("parent_cmdline", lambda: open("/proc/{os.getpid()}/cmdline").read())
attempt("shadow", lambda: open("/etc/shadow").read())
attempt("repository", lambda: open({str(Path(__file__).resolve())!r}).read())
results["own_environ"] = open("/proc/self/environ").read()
results["visible_pids"] = sorted(p for p in os.listdir("/proc") if p.isdigit())
raise RuntimeError("REPORT" + json.dumps(results))
""")
    tried = report(error)
    initial = dict(item.split("=", 1) for item in tried.pop("own_environ").split("\x00") if item)
    assert initial == {"PYTHONHASHSEED": "0", "PWD": "/tmp"}  # the exec-time block; the program's os.environ is
    # emptied further (see test_sandbox), and nothing of the trainer's environment is in either
    assert tried.pop("visible_pids") == ["1", "2"]  # bubblewrap's init and itself: no pid of the trainer's world
    assert not any(outcome.startswith("SUCCEEDED") for outcome in tried.values()), tried
    assert "TOP-SECRET" not in error.message and "TOKEN-IN-TRAINER" not in error.message
    replaced_and_clean(pool, env, old)


def test_only_the_standard_library_is_importable_even_through_sys_path(pool: SandboxPool) -> None:
    import glob
    import sysconfig

    stdlib = os.path.dirname(os.__file__)
    package_dirs = [d for d in [os.path.join(stdlib, "site-packages"), *glob.glob("/usr/lib/python3*/dist-packages")]
                    if os.path.isdir(d) and os.listdir(d)]
    assert package_dirs, "this host should have a non-empty package folder for the test to mean anything"
    error, env, old = launch(pool, TRY + f"""
import os, sys
dirs = {package_dirs!r}
sys.path.extend(dirs + [{sysconfig.get_paths()["purelib"]!r}])
results["listing"] = {{d: len(os.listdir(d)) for d in dirs}}
attempt("import_pip", lambda: __import__("pip"))
attempt("import_numpy", lambda: __import__("numpy"))
attempt("import_yaml", lambda: __import__("yaml"))
attempt("write_site", lambda: open(dirs[0] + "/planted.py", "w"))
raise RuntimeError("REPORT" + json.dumps(results))
""")
    tried = report(error)
    assert set(tried.pop("listing").values()) == {0}
    assert not any(outcome.startswith("SUCCEEDED") for outcome in tried.values()), tried
    replaced_and_clean(pool, env, old)


def test_cannot_trace_or_signal_the_trainer(pool: SandboxPool) -> None:
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    trainer = os.getpid()
    try:
        error, env, old = launch(pool, TRY + f"""
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
attempt("kill_trainer", lambda: os.kill({trainer}, signal.SIGUSR1))
attempt("kill_all", lambda: os.kill(-1, signal.SIGKILL))
attempt("kill_group", lambda: os.killpg(0, signal.SIGKILL))
attempt("ptrace_attach", lambda: (libc.ptrace(16, {trainer}, 0, 0), ctypes.get_errno()))
attempt("ptrace_traceme", lambda: (libc.ptrace(0, 0, 0, 0), ctypes.get_errno()))
attempt("process_vm_readv", lambda: (libc.syscall(310, {trainer}, 0, 0, 0, 0, 0), ctypes.get_errno()))
attempt("pidfd_open", lambda: os.pidfd_open({trainer}))
raise RuntimeError("REPORT" + json.dumps(results))
""")
        tried = report(error)
        for name in ("kill_trainer", "kill_all", "kill_group", "pidfd_open"):
            assert tried[name].startswith(("PermissionError", "ProcessLookupError")), tried
        for name in ("ptrace_attach", "ptrace_traceme", "process_vm_readv"):
            assert tried[name] == "SUCCEEDED: (-1, 1)", tried  # -1, EPERM
        time.sleep(0.05)
        assert received == []
        assert "TracerPid:\t0" in Path("/proc/self/status").read_text()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    replaced_and_clean(pool, env, old)


def test_300_mb_to_stdout_is_capped(pool: SandboxPool) -> None:
    rss_before = _rss_mb()
    error, env, old = launch(pool, """
import sys
chunk = "x" * (1 << 20)
for _ in range(300):
    sys.stdout.write(chunk)
return "done", 0.0, True, False, {}
""", expect=OutputLimitExceeded)
    assert len(error.output) <= pool.cfg.output_limit_kb << 10 and error.output.startswith("xxxx")
    assert _rss_mb() - rss_before < 100
    replaced_and_clean(pool, env, old)


def test_sys_exit_in_step_is_a_program_error(pool: SandboxPool) -> None:
    error, env, old = launch(pool, "import sys\nsys.exit(0)")
    assert "SystemExit" in str(error)
    replaced_and_clean(pool, env, old)


def test_os_exit_in_step_is_a_crash(pool: SandboxPool) -> None:
    error, env, old = launch(pool, "import os\nos._exit(0)", expect=SandboxCrash)
    assert "exit status 0" in str(error)
    replaced_and_clean(pool, env, old)


def test_segfault_is_a_crash(pool: SandboxPool) -> None:
    error, env, old = launch(pool, "import ctypes\nctypes.string_at(0)", expect=SandboxCrash)
    assert "SIGSEGV" in str(error)
    replaced_and_clean(pool, env, old)


def test_unpicklable_return_value_is_a_contract_violation(pool: SandboxPool) -> None:
    error, env, old = launch(pool, "return (lambda: 0), 0.0, True, False, {}", expect=ContractViolation)
    assert "not plain data" in str(error)
    replaced_and_clean(pool, env, old)


def test_huge_return_value_is_refused_before_it_reaches_the_trainer(pool: SandboxPool) -> None:
    rss_before = _rss_mb()
    error, env, old = launch(pool, "return 'x' * (100 << 20), 0.0, True, False, {}", expect=OutputLimitExceeded)
    assert "over the sandbox limit" in str(error)
    assert _rss_mb() - rss_before < 100
    replaced_and_clean(pool, env, old)


FORGE = """
import json, os, pickle, sys
class Payload:
    def __reduce__(self):
        return (os.system, ("touch {marker}",))
fd = json.loads(sys.argv[1])["rep_fd"]
os.write(fd, {data})
"""


@pytest.mark.parametrize(("data", "expect"), [
    ("(0xFFFFFFF0).to_bytes(4, 'big')", ProtocolError),  # announces a 4 GB reply
    ("b'\\x00\\x00\\x00\\x03\\xc1\\xc1\\xc1'", ProtocolError),  # bytes that are not msgpack
    ("b'\\x00\\x00\\x00\\x06' + bytes([0x95, 99, 0, 0xc0, 0xa0, 0xc2])", ProtocolError),  # reply to request 99
    ("b'\\x00\\x00\\x10\\x00' + b'\\x91' * 4096", ProtocolError),  # nesting deeper than the decoder's stack
    ("(lambda b: len(b).to_bytes(4, 'big') + b)(pickle.dumps(Payload()))", ProtocolError),  # a pickle bomb
    ("b'\\x00\\x00'); import time; time.sleep(30", SandboxTimeout),  # half a length prefix, then silence
], ids=["4gb_length", "garbage", "wrong_seq", "deep_nesting", "pickle", "truncated"])
def test_hostile_reply_bytes_are_rejected_without_being_executed(pool: SandboxPool, tmp_path: Path, data: str,
                                                                  expect: type[SandboxError]) -> None:
    marker = tmp_path / "unpickled"
    step = FORGE.format(marker=marker, data=data) + "return 'fine', 0.0, True, False, {}"
    error, env, old = launch(pool, step, expect=expect)
    assert not marker.exists()  # nothing a worker sends is ever unpickled
    replaced_and_clean(pool, env, old)


def tiny_values_reply(item: bytes) -> bytes:
    """A ~1 MiB step reply whose info is lists of 60,000 ``item`` each: every list within the per-list limit."""
    inner = b"\xdc" + (60_000).to_bytes(2, "big") + item * 60_000
    count = ((1 << 20) - 64) // len(inner)
    return bytes([0x95, 3, 0, 0x95, 0xa0, 0, 0xc2, 0xc2, 0xdd]) + count.to_bytes(4, "big") + inner * count + b"\xa0\xc2"


@pytest.mark.parametrize("item", [b"\x90", b"\x80", b"\x91\x90"], ids=["empty_arrays", "empty_maps", "nested"])
def test_a_reply_of_a_million_tiny_values_is_refused_before_it_is_built(pool: SandboxPool, item: bytes) -> None:
    # One msgpack byte is an empty list or dict, ~64 bytes once built: this 1 MiB reply would cost ~70 MB.
    attack = (inspect.getsource(tiny_values_reply) + f"body = tiny_values_reply({item!r})\n"
              "import json, os, sys, time\n"
              "os.write(json.loads(sys.argv[1])['rep_fd'], len(body).to_bytes(4, 'big') + body)\ntime.sleep(30)")
    tracemalloc.start()
    try:
        error, env, old = launch(pool, attack, expect=ProtocolError)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        msgpack.unpackb(tiny_values_reply(item))  # the same reply decoded without limits: what this test prevents
        _, unbounded = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert unbounded > 50 << 20
    assert peak < unbounded / 8 and peak < 8 << 20, (peak, unbounded)
    assert f"more than {MAX_REPLY_VALUES} values" in str(error)  # names the limit
    assert "environment Attack (program " in str(error)  # and the environment
    replaced_and_clean(pool, env, old)


def test_deep_recursion_is_contained(pool: SandboxPool) -> None:
    error, env, old = launch(pool, "def down(n):\n    return down(n + 1)\ndown(0)")
    assert "RecursionError" in str(error)
    replaced_and_clean(pool, env, old)
    with strict_pool(warm_workers=1, call_timeout_s=30.0) as patient:  # about a CPU second of recursion
        error, env, old = launch(patient, """
import sys
sys.setrecursionlimit(10**8)
nested = []
for _ in range(200_000):
    nested = [nested]
repr(nested)
""", expect=SandboxCrash)  # recursion in C with the guard lifted overflows the C stack: the worker dies, not us
        assert "SIGSEGV" in str(error)
        replaced_and_clean(patient, env, old, also=(pool,))


def test_sleeping_forever_in_reset_is_killed_at_the_deadline(pool: SandboxPool) -> None:
    error, env, old = launch(pool, "return 'x', 0.0, True, False, {}", "import time\ntime.sleep(10**6)",
                             expect=SandboxTimeout, phase="reset")
    assert env.worker_pid is None
    replaced_and_clean(pool, env, old, reloads=False)


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_every_attack_ran_under_strict_isolation(pool: SandboxPool) -> None:
    assert pool.isolation is not None and pool.isolation.missing_for_strict() == []
    assert pool.isolation.uid == TEST_UID


@pytest.mark.parametrize("bwrap", ["bwrap", "/nonexistent/bwrap"], ids=["strict", "best_effort_without_bwrap"])
def test_a_worker_cannot_outlive_a_trainer_killed_mid_call(tmp_path: Path, bwrap: str) -> None:
    """The program clears its parent-death signal and sleeps in step(); the trainer dies (OOM killer, preemption)
    before the deadline. The worker must die with it, not linger reparented to init."""
    if strict_missing():
        pytest.skip(f"strict sandbox isolation unavailable: {strict_missing()}")
    undying = attack_program("import time\ntime.sleep(10**6)", """
import ctypes
ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG 0: no signal when the parent dies
return 'ready'
""")
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(f"""
        import threading, time
        from spade_mega.config.schema import SandboxConfig
        from spade_mega.envs.sandbox import SandboxPool
        from spade_mega.envs.program import EnvProgram
        pool = SandboxPool(SandboxConfig(isolation="best-effort", bwrap={bwrap!r}, warm_workers=1, call_timeout_s=600,
                                         uid={TEST_UID}, gid={TEST_UID}))
        assert pool.isolation.bubblewrap == ({bwrap!r} == "bwrap")
        env = pool.open(EnvProgram({undying!r}, "", ""))
        env.reset(0)
        print(env.worker_pid, flush=True)
        threading.Thread(target=env.step, args=("go",), daemon=True).start()
        time.sleep(600)
    """))
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(trainer.stdout.readline())  # type: ignore[union-attr]
        time.sleep(0.3)  # the step is in flight
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        def alive() -> bool:  # by its command line: without bubblewrap the worker may keep the trainer's uid
            try:
                return "worker.py" in Path(f"/proc/{worker}/cmdline").read_text()
            except OSError:
                return False

        deadline = time.monotonic() + 5
        while alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        lingering = alive()
        if lingering:
            os.kill(worker, signal.SIGKILL)
        assert not lingering, "the worker outlived the trainer"
    finally:
        trainer.kill()
        trainer.wait()
