"""Shared by the sandbox tests: a strict pool under a uid of this test process alone, and a census of its processes.

Workers run as ``TEST_UID`` (unique to this pytest process), so a process with that uid that is not a live worker of
the pool is one left behind, whatever other sandboxes run on the machine at the same time.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spade_mega.config.schema import SandboxConfig
from spade_mega.envs.program import EnvProgram
from spade_mega.envs.sandbox import SandboxPool
from spade_mega.envs.sandbox.isolation import find_libseccomp

TEST_UID = 40000 + os.getpid() % 20000
ROOT = Path(__file__).resolve().parents[1]
GUESS_NUMBER = (ROOT / "docs" / "environments.md").read_text().split("```python")[1].split("```")[0]


@functools.lru_cache(maxsize=1)
def strict_missing() -> str | None:
    """Why strict isolation truly cannot be had on this machine (the tools are missing, or the platform refuses the
    namespaces even to bubblewrap alone), or None when it can. Then a strict pool that fails is a bug: no skip."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    if find_libseccomp() is None:
        return "libseccomp is not installed (apt-get install libseccomp2)"
    probe = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup",
             "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    if os.geteuid() != 0:
        probe.append("--unshare-user")
    done = subprocess.run([*probe, "true"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return f"this platform refuses bubblewrap's namespaces: {done.stderr.strip()}"
    if os.geteuid() == 0:  # workers drop to a non-root uid, then enter a user namespace of their own
        userns = subprocess.run([sys.executable, "-c", "import ctypes, os; os.setgid(65534); os.setuid(65534); "
                                 "raise SystemExit(ctypes.CDLL(None).unshare(0x10000000))"], timeout=30)
        if userns.returncode != 0:
            return "unprivileged user namespaces are disabled here (sysctl user.max_user_namespaces, AppArmor)"
    return None


def strict_config(**overrides: object) -> SandboxConfig:
    values = dict(isolation="strict", warm_workers=2, call_timeout_s=1.0, load_timeout_s=5.0, memory_mb=1024,
                  uid=TEST_UID, gid=TEST_UID)
    values.update(overrides)
    return SandboxConfig(**values)  # type: ignore[arg-type]


def strict_pool(**overrides: object) -> SandboxPool:
    """A strict pool; skips only when strict isolation truly cannot be had here (any other failure fails the test)."""
    missing = strict_missing()
    if missing:
        pytest.skip(f"strict sandbox isolation unavailable: {missing}")
    return SandboxPool(strict_config(**overrides))


def program(source: str) -> EnvProgram:
    return EnvProgram(source=source, hint="", skill="test")


def _status(pid: str) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def sandbox_census() -> set[int]:
    """Live processes that belong to this test's sandboxes: uid TEST_UID, or a bubblewrap child of this process
    (the launcher) or of such a child (bubblewrap's init in the sandbox)."""
    me = str(os.getpid())
    found, bwraps = set(), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        status = _status(pid)
        if not status or status.get("State", "").startswith("Z"):
            continue
        if int(status["Uid"].split()[0]) == TEST_UID:
            found.add(int(pid))
        elif status.get("Name") == "bwrap":
            bwraps[pid] = status.get("PPid", "").strip()
    launchers = {pid for pid, parent in bwraps.items() if parent == me}
    return found | {int(pid) for pid, parent in bwraps.items() if pid in launchers or parent in launchers}


def assert_nothing_left_behind(pool: SandboxPool, timeout: float = 5.0, also: tuple[SandboxPool, ...] = ()) -> None:
    """Wait for the warm pool to refill, then every sandbox process must be a live worker of ``pool`` or of the
    pools in ``also`` (or their bubblewrap), and no zombie of ours may remain unreaped."""
    deadline = time.monotonic() + timeout
    while True:
        census = sandbox_census()
        expected = pool.processes().union(*(other.processes() for other in also))
        zombies = [pid for pid in os.listdir("/proc") if pid.isdigit() and _status(pid).get("State", "").startswith("Z")
                   and _status(pid).get("PPid", "").strip() == str(os.getpid())]
        if census == expected and not zombies and pool.warm_workers >= pool.cfg.warm_workers:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"processes left behind: {sorted(census - expected)}, unreaped zombies {zombies}, "
                                 f"missing workers {sorted(expected - census)}, warm {pool.warm_workers}")
        time.sleep(0.02)


def wait_warm(pool: SandboxPool, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while pool.warm_workers < pool.cfg.warm_workers:
        assert time.monotonic() < deadline, "the warm pool did not refill"
        time.sleep(0.01)


def pid_gone(pid: int) -> bool:
    """Dead (a zombie left to PID 1 to reap counts: assert_nothing_left_behind checks that none is left to us)."""
    status = _status(str(pid))
    return (not status or status.get("State", "").startswith("Z")
            or int(status["Uid"].split()[0]) != TEST_UID and status.get("Name") != "bwrap")
