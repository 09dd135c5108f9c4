"""Which isolation a worker gets on this machine, the command that starts it, and what it verifiably got.

Two ways to start a worker, chosen by who the trainer is:

- trainer is root: bubblewrap runs privileged (no user namespace of its own, so the kernel still sees uid 0 when it
  bind-mounts the interpreter, which may live under a 0700 home) keeping only CAP_SETUID/SETGID/SETPCAP; the worker
  then drops to ``sandbox.uid`` in the initial user namespace, so the kernel sees a real non-root user (RLIMIT_NPROC
  and file permissions apply, which a root user namespace mapping would defeat), enters a user namespace of its own
  and empties its capability sets.
- trainer is not root: bubblewrap creates every namespace itself (user included) and drops all capabilities.

Without bubblewrap (``best-effort`` only) the worker is a plain child that still enters user, net, ipc and uts
namespaces when the kernel allows unprivileged user namespaces, and still gets seccomp and rlimits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import json
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass, field

from spade_mega.config.schema import SandboxConfig
from spade_mega.envs.sandbox import worker as worker_module
from spade_mega.envs.sandbox.errors import SandboxUnavailable

ALL_NAMESPACES = ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup")
INSTALL_HINT = ("install them with `apt-get install bubblewrap libseccomp2` (Debian, Ubuntu) or "
                "`dnf install bubblewrap libseccomp` (Fedora, RHEL), or set sandbox.isolation=best-effort")
CLONE_NEWNET, CLONE_NEWIPC, CLONE_NEWUTS = 0x40000000, 0x08000000, 0x04000000
SANDBOX_LIB, SANDBOX_WORKER = "/spade/lib", "/spade/worker.py"


def find_libseccomp() -> str | None:
    """The libseccomp shared library name when it loads in this process, else None."""
    name = ctypes.util.find_library("seccomp")
    if name is None:
        return None
    try:
        ctypes.CDLL(name)
    except OSError:
        return None
    return name


@dataclass(frozen=True)
class IsolationPlan:
    """What every worker of a pool is asked to apply (what it actually got is an :class:`IsolationReport`)."""

    bwrap: str | None  # absolute path of bubblewrap, None to start workers as plain children
    seccomp_library: str | None
    drop_uid: int | None  # the worker becomes this uid (trainer is root); None: it keeps the trainer's
    drop_gid: int | None
    user_namespace: bool  # the worker enters a user namespace itself (bubblewrap has not made one)
    extra_namespaces: int  # further CLONE_NEW* flags the worker unshares itself (only without bubblewrap)
    required: bool  # strict: any step that fails is fatal

    def without_bwrap(self) -> "IsolationPlan":
        """The plan for a plain child: it unshares what it can itself, and drops to the sandbox uid only if that uid
        can still read the interpreter (without bubblewrap's bind mounts a 0700 home would lock it out)."""
        drop = _runtime_world_readable()
        return IsolationPlan(None, self.seccomp_library, self.drop_uid if drop else None,
                             self.drop_gid if drop else None, True, CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS,
                             self.required)


def plan_isolation(cfg: SandboxConfig) -> IsolationPlan:
    """The plan for this machine; in strict mode a missing piece raises SandboxUnavailable saying what to install."""
    bwrap = shutil.which(cfg.bwrap)
    seccomp = find_libseccomp()
    if cfg.isolation == "strict":
        missing = [name for name, found in (("bubblewrap", bwrap), ("libseccomp", seccomp)) if found is None]
        if missing:
            raise SandboxUnavailable(f"sandbox.isolation is 'strict' but {' and '.join(missing)} "
                                     f"{'is' if len(missing) == 1 else 'are'} not available here: {INSTALL_HINT}")
    root = os.geteuid() == 0
    plan = IsolationPlan(bwrap, seccomp, cfg.uid if root else None, cfg.gid if root else None,
                         user_namespace=root, extra_namespaces=0, required=cfg.isolation == "strict")
    return plan if bwrap else plan.without_bwrap()


@dataclass(frozen=True)
class Runtime:
    """Host files a worker needs: the interpreter, its libraries, msgpack and the worker script."""

    python: str
    read_only: tuple[str, ...]  # host paths bound read-only at the same place
    masked: tuple[str, ...]  # package folders inside read_only hidden under an empty read-only tmpfs
    symlinks: tuple[tuple[str, str], ...]  # (target, path) for merged-/usr links such as /lib -> usr/lib
    msgpack_dir: str
    worker_file: str


def runtime() -> Runtime:
    import msgpack

    python = os.path.realpath(sys.executable)
    # The base installation's standard library, never a virtual environment's site-packages.
    wanted = [python, os.path.dirname(os.__file__), sysconfig.get_config_var("DESTSHARED"), "/etc/ld.so.cache"]
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and sysconfig.get_config_var("LIBDIR"):
        wanted.append(os.path.join(sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME") or ""))
    symlinks = []
    for system_dir in ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/lib32", "/usr/lib32"):
        if os.path.islink(system_dir):
            symlinks.append((os.readlink(system_dir), system_dir))
        elif os.path.isdir(system_dir):
            wanted.append(system_dir)
    read_only: list[str] = []
    for path in sorted({os.path.realpath(p) for p in wanted if p and os.path.exists(p)}, key=len):
        if not any(path == kept or path.startswith(kept + "/") for kept in read_only):
            read_only.append(path)
    # The stdlib folder holds the base interpreter's site-packages and /usr/lib holds the system Python's
    # dist-packages: a program that edits sys.path could import them. Only the standard library is the contract.
    stdlib = os.path.dirname(os.__file__)
    package_dirs = [os.path.join(stdlib, "site-packages"), *glob.glob("/usr/lib/python3*/dist-packages"),
                    *glob.glob("/usr/lib/python3*/site-packages")]
    masked = sorted({os.path.realpath(d) for d in package_dirs if os.path.isdir(d)})
    masked = [d for d in masked if any(d.startswith(kept + "/") for kept in read_only)]
    return Runtime(python, tuple(read_only), tuple(masked), tuple(symlinks),
                   os.path.dirname(os.path.realpath(msgpack.__file__)), os.path.realpath(worker_module.__file__))


def _runtime_world_readable() -> bool:
    """Whether a non-root uid can reach the interpreter and its libraries without bubblewrap's bind mounts."""
    rt = runtime()
    for path in (*rt.read_only, rt.msgpack_dir, rt.worker_file):
        parts = path.split("/")
        for i in range(2, len(parts) + 1):
            mode = os.stat("/".join(parts[:i]) or "/").st_mode
            if not mode & 0o001 and os.path.isdir("/".join(parts[:i])) or not mode & 0o004:
                return False
    return True


@dataclass
class Launch:
    """Builds the command and settings of one worker from the pool's plan and config."""

    plan: IsolationPlan
    cfg: SandboxConfig
    rt: Runtime = field(default_factory=runtime)

    def settings(self, req_fd: int, rep_fd: int) -> dict:
        cfg = self.cfg
        return {
            "req_fd": req_fd, "rep_fd": rep_fd, "required": self.plan.required,
            "lib_dir": SANDBOX_LIB if self.plan.bwrap else os.path.dirname(self.rt.msgpack_dir),
            "drop_uid": self.plan.drop_uid, "drop_gid": self.plan.drop_gid,
            "user_namespace": self.plan.user_namespace, "extra_namespaces": self.plan.extra_namespaces,
            "seccomp": self.plan.seccomp_library is not None, "seccomp_library": self.plan.seccomp_library,
            "rlimits": {"RLIMIT_AS": cfg.memory_mb << 20, "RLIMIT_CPU": cfg.cpu_s,
                        "RLIMIT_FSIZE": cfg.file_size_mb << 20, "RLIMIT_NOFILE": cfg.open_files,
                        "RLIMIT_CORE": 0, "RLIMIT_NPROC": cfg.threads},
            "output_limit": cfg.output_limit_kb << 10, "max_reply": cfg.reply_limit_kb << 10,
            "module_name": "environment",
        }

    def command(self, req_fd: int, rep_fd: int, info_fd: int | None) -> tuple[list[str], dict[str, str]]:
        """argv and environment of the worker (or of bubblewrap around it)."""
        settings = json.dumps(self.settings(req_fd, rep_fd), separators=(",", ":"))
        python = [self.rt.python, "-S", "-B", "-X", "utf8"]
        env = {"PYTHONHASHSEED": str(self.cfg.hash_seed)}
        if not self.plan.bwrap:
            return [*python, self.rt.worker_file, settings], env
        # No --as-pid-1: once the worker runs as the sandbox uid, the kernel refuses it the parent-death signal of a
        # root bubblewrap (a signal across uids), so a worker busy in a call would outlive a killed trainer.
        # bubblewrap's own init, pid 1 of the namespace, keeps bubblewrap's uid and gets that signal; its death
        # takes the whole namespace down.
        argv = [self.plan.bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup", "--hostname", "sandbox", "--die-with-parent", "--new-session",
                "--clearenv", "--setenv", "PYTHONHASHSEED", env["PYTHONHASHSEED"], "--cap-drop", "ALL"]
        if self.plan.drop_uid is not None:  # root trainer: the worker needs these three to drop to drop_uid
            argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
        else:
            argv += ["--unshare-user", "--disable-userns"]
        made = {"/"}

        def parents(path: str) -> list[str]:
            out, parent = [], os.path.dirname(path)
            while parent not in made:
                out.append(parent)
                made.add(parent)
                parent = os.path.dirname(parent)
            return [arg for p in reversed(out) for arg in ("--perms", "0755", "--dir", p)]

        for path in self.rt.read_only:
            argv += [*parents(path), "--ro-bind", path, path]
            made.add(path)
        for path in self.rt.masked:
            argv += ["--tmpfs", path, "--remount-ro", path]
        for target, path in self.rt.symlinks:
            argv += ["--symlink", target, path]
        argv += ["--ro-bind", self.rt.msgpack_dir, SANDBOX_LIB + "/msgpack", "--ro-bind", self.rt.worker_file,
                 SANDBOX_WORKER, "--proc", "/proc", "--dev", "/dev",
                 "--perms", "1777", "--size", str(self.cfg.scratch_mb << 20), "--tmpfs", "/tmp", "--chdir", "/tmp"]
        if info_fd is not None:
            argv += ["--info-fd", str(info_fd)]
        return [*argv, "--", *python, SANDBOX_WORKER, settings], {}


@dataclass(frozen=True)
class IsolationReport:
    """What one worker verifiably got, read from outside (its /proc entries) plus its own hello."""

    bubblewrap: bool
    namespaces: tuple[str, ...]
    seccomp: bool
    uid: int
    capabilities: bool  # any effective capability left
    rlimits: bool
    cgroups: tuple[str, ...]
    problems: tuple[str, ...] = ()

    def missing_for_strict(self) -> list[str]:
        missing = [] if self.bubblewrap else ["bubblewrap (read-only root)"]
        absent = [ns for ns in ALL_NAMESPACES if ns not in self.namespaces]
        missing += [f"namespaces {','.join(absent)}"] if absent else []
        missing += [] if self.seccomp else ["seccomp filter"]
        missing += ["non-root uid"] if self.uid == 0 else []
        missing += ["dropped capabilities"] if self.capabilities else []
        missing += [] if self.rlimits else ["rlimits"]
        return missing

    def describe(self) -> str:
        parts = ["bubblewrap read-only root" if self.bubblewrap else "NO bubblewrap (host filesystem visible)",
                 f"namespaces {','.join(self.namespaces) or 'NONE'}",
                 "seccomp filter" if self.seccomp else "NO seccomp filter",
                 f"uid {self.uid}" + (" (ROOT)" if self.uid == 0 else ""),
                 "capabilities LEFT" if self.capabilities else "no capabilities",
                 "rlimits" if self.rlimits else "NO rlimits",
                 f"cgroups {','.join(self.cgroups)}" if self.cgroups else "no cgroups"]
        return "; ".join(parts)


def inspect_worker(pid: int, hello: dict, bubblewrap: bool, cgroups: tuple[str, ...],
                   problems: list[str]) -> IsolationReport:
    """Compare the worker's namespaces with ours and read its uid, seccomp mode and capabilities from /proc."""
    namespaces = []
    for ns in ALL_NAMESPACES:
        try:
            if os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"):
                namespaces.append(ns)
        except OSError:
            pass
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
    return IsolationReport(
        bubblewrap=bubblewrap, namespaces=tuple(namespaces), seccomp=status.get("Seccomp", "0").strip() == "2",
        uid=int(status["Uid"].split()[1]), capabilities=int(status.get("CapEff", "0"), 16) != 0,
        rlimits=bool(hello.get("rlimits")), cgroups=cgroups, problems=(*hello.get("errors", ()), *problems))
