"""The sandbox worker: the process that hosts one environment program and answers framed requests.

This file runs *inside* the sandbox, where only the interpreter, its standard library, the msgpack package and this
file are visible, so it imports nothing from spade_mega. The trainer imports it only for the protocol constants.

Life of a worker: the trainer starts it (under bubblewrap when available) with its settings as one JSON argument;
it hardens itself (drops root to the sandbox uid and enters its own user namespace, sets rlimits, closes stray file
descriptors, captures stdout/stderr in a memory file, loads the seccomp filter), sends a hello frame saying what it
applied, and then serves requests until its request pipe closes. Everything up to the hello is trusted code; only
after it does the worker execute program text.

Protocol: every message is a 4-byte big-endian length and a msgpack body, over two pipes. Requests are
``[seq, op, arg]``; replies are ``[seq, status, value, output, output_overflow]``, where ``output`` is what the program
printed during the call (capped) and ``value`` is the result (status OK) or ``[kind, message]`` (status ERR).

Why libseccomp through ctypes for the seccomp filter: libseccomp (the ``libseccomp2`` system package, present
wherever systemd is) resolves syscall numbers per architecture and emits the architecture check and the x32-ABI
guard itself, the two places where a hand-assembled BPF program goes quietly wrong. Its Python bindings are not on
PyPI for our interpreter (Debian's python3-seccomp serves only the system Python), and ctypes needs no compiler. The
filter is loaded by the worker itself, after its setup and just before the hello, so it can also forbid execve and
user namespaces, which the interpreter start-up and the setup still need.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import struct
import sys
import traceback

FRAME = struct.Struct(">I")
OP_LOAD, OP_RESET, OP_STEP = "load", "reset", "step"
ST_OK, ST_ERR = 0, 1

# Error kinds a worker reports (the trainer maps each to a SandboxError subclass).
LOAD_KINDS = ("syntax", "load_error", "no_env_class", "multiple_env_classes", "bad_max_turns")
K_PROGRAM, K_UNSERIALIZABLE, K_REPLY_TOO_LARGE, K_PROTOCOL = (
    "program_error", "unserializable", "reply_too_large", "protocol")

# Syscalls the filter answers with EPERM: sockets, process creation other than threads, running other programs,
# tracing, signals by other routes than kill/tgkill to ourselves, mounts and namespaces, bpf, io_uring, and the
# kernel-administration calls no environment needs. Names unknown to the installed libseccomp are skipped.
DENIED_SYSCALLS = (
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4",
    "fork", "vfork", "execve", "execveat",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "tkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_send_signal",
    "mount", "umount2", "unshare", "setns", "pivot_root", "chroot", "mount_setattr", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick",
    "bpf", "io_uring_setup", "io_uring_enter", "io_uring_register", "perf_event_open", "userfaultfd",
    "keyctl", "add_key", "request_key", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "reboot", "swapon", "swapoff", "open_by_handle_at", "name_to_handle_at", "mknod", "mknodat",
    "acct", "quotactl", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
)

CLONE_THREAD = 0x00010000
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 1, 4, 24, 47, 4

_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_ACT_KILL_PROCESS = 0x80000000
_SCMP_CMP_NE, _SCMP_CMP_EQ, _SCMP_CMP_MASKED_EQ = 1, 4, 7
_SCMP_FLTATR_ACT_BADARCH = 2


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result < 0:
        code = ctypes.get_errno() or -result
        raise OSError(code, f"{what}: {os.strerror(code)}")


def load_seccomp(library: str) -> None:
    """Install the filter: default allow, EPERM for ``DENIED_SYSCALLS``, and argument rules for the rest.

    ``clone`` is allowed only with CLONE_THREAD (threads, not processes); ``clone3`` answers ENOSYS so the C library
    falls back to ``clone``, whose flags a filter can inspect; ``kill`` and ``tgkill`` may only target this process;
    ``prctl(PR_SET_PDEATHSIG)`` is refused, so the program cannot undo dying with its parent.
    A syscall from a foreign architecture (the 32-bit or x32 ABI) kills the process.
    """
    lib = ctypes.CDLL(library, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError(errno.ENOMEM, "seccomp_init failed")
    try:
        _check(lib.seccomp_attr_set(ctx, _SCMP_FLTATR_ACT_BADARCH, _SCMP_ACT_KILL_PROCESS), "seccomp_attr_set")

        def rule(name: str, action: int, *conditions: tuple[int, int, int, int]) -> None:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number == -1:  # __NR_SCMP_ERROR: this libseccomp does not know the name
                return
            array = (_ArgCmp * max(1, len(conditions)))(*[_ArgCmp(*c) for c in conditions])
            _check(lib.seccomp_rule_add_array(ctx, action, number, len(conditions), array), f"seccomp rule {name}")

        eperm = _errno_action(errno.EPERM)
        for name in DENIED_SYSCALLS:
            rule(name, eperm)
        rule("clone", eperm, (0, _SCMP_CMP_MASKED_EQ, CLONE_THREAD, 0))
        rule("clone3", _errno_action(errno.ENOSYS))
        rule("prctl", eperm, (0, _SCMP_CMP_EQ, PR_SET_PDEATHSIG, 0))  # a worker must not outlive the trainer
        me = os.getpid()
        rule("kill", eperm, (0, _SCMP_CMP_NE, me, 0))
        rule("tgkill", eperm, (0, _SCMP_CMP_NE, me, 0))
        _check(lib.seccomp_load(ctx), "seccomp_load")
    finally:
        lib.seccomp_release(ctx)


def _drop_bounding_set(libc: ctypes.CDLL) -> None:
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last capability: ignored


def _drop_capabilities(libc: ctypes.CDLL) -> None:
    """Empty the bounding, ambient, effective, permitted and inheritable capability sets."""
    _drop_bounding_set(libc)
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    _check(libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()), "capset")


def drop_privileges(uid: int | None, gid: int | None, new_user_namespace: bool, extra_namespaces: int) -> None:
    """Become ``uid``/``gid`` (when started as root) and, optionally, enter fresh namespaces.

    The uid change happens in the initial user namespace, so the kernel sees a real non-root user: RLIMIT_NPROC and
    file permissions apply. The user namespace (mapping only that uid) then gives this worker its own process
    accounting; ``extra_namespaces`` (CLONE_NEW* flags, used when bubblewrap is absent) are unshared with the
    capabilities the new user namespace grants, and then every capability is dropped.
    """
    libc = _libc()
    if uid is not None and os.getuid() == 0:
        _drop_bounding_set(libc)  # while we still hold CAP_SETPCAP; setresuid below empties the other sets
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # setuid made /proc/self root-owned; we write our own id maps
    if new_user_namespace:
        outer_uid, outer_gid = os.getuid(), os.getgid()
        _check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{outer_uid} {outer_uid} 1"),
                           ("gid_map", f"{outer_gid} {outer_gid} 1")):
            fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)
    if extra_namespaces:
        _check(libc.unshare(extra_namespaces), "unshare(net, ipc, uts)")
    _drop_capabilities(libc)


def set_rlimits(limits: dict[str, int]) -> None:
    """Soft = hard for each limit, so the program cannot raise any of them."""
    import resource

    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))


def _status_fields() -> dict[str, str]:
    with open("/proc/self/status") as f:
        return dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)


class Capture:
    """stdout and stderr of the program (fd 1 and 2, so also raw writes) go to one memory file, drained per call."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        fd = os.memfd_create("program-output", 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)

    def drain(self) -> tuple[str, bool]:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # the program may have closed or replaced it
                pass
        size = os.fstat(1).st_size
        if not size:
            return "", False
        data = os.pread(1, min(size, self.limit), 0)
        os.ftruncate(1, 0)
        os.lseek(1, 0, os.SEEK_SET)
        text = data.decode("utf-8", "replace")
        if len(text) > self.limit // 3:  # each invalid byte became a 3-byte U+FFFD: keep the reply within its frame
            text = text.encode("utf-8")[: self.limit].decode("utf-8", "ignore")
        return text, size > self.limit


class Host:
    """Holds the loaded program and answers load / reset / step."""

    def __init__(self, module_name: str, max_reply: int) -> None:
        self.module_name = module_name
        self.max_reply = max_reply
        self.env_class: type | None = None
        self.env: object | None = None

    def load(self, source: str) -> list:
        import types

        try:
            code = compile(source, "<environment>", "exec")
        except (SyntaxError, ValueError) as exc:  # ValueError: null bytes in the source
            where = f"line {exc.lineno}: " if isinstance(exc, SyntaxError) and exc.lineno else ""
            raise Failure("syntax", f"{where}{exc.msg if isinstance(exc, SyntaxError) else exc}") from None
        module = types.ModuleType(self.module_name)
        sys.modules[self.module_name] = module  # dataclasses, enum and typing look the module up here
        try:
            exec(code, module.__dict__)
        except BaseException as exc:  # noqa: BLE001 - anything the module does while loading is its failure
            raise Failure("load_error", _describe(exc)) from None
        classes = [value for value in vars(module).values()
                   if isinstance(value, type) and value.__module__ == self.module_name
                   and callable(getattr(value, "reset", None)) and callable(getattr(value, "step", None))]
        if not classes:
            raise Failure("no_env_class", "the module defines no class with reset() and step() methods")
        if len(classes) > 1:
            names = ", ".join(sorted(c.__name__ for c in classes))
            raise Failure("multiple_env_classes", f"the module defines {len(classes)} environment classes ({names}); "
                                                  "it must define exactly one")
        cls = classes[0]
        max_turns = getattr(cls, "max_turns", None)
        if type(max_turns) is not int or max_turns < 1:
            raise Failure("bad_max_turns", f"{cls.__name__}.max_turns must be an int >= 1, got {max_turns!r}")
        self.env_class = cls
        return [cls.__name__, max_turns]

    def reset(self, seed: int) -> object:
        if self.env_class is None:
            raise Failure(K_PROTOCOL, "reset before load")
        self.env = None
        try:
            env = self.env_class()
            observation = env.reset(seed)
        except BaseException as exc:  # noqa: BLE001
            raise Failure(K_PROGRAM, _describe(exc)) from None
        self.env = env
        return observation

    def step(self, action: str) -> object:
        if self.env is None:
            raise Failure(K_PROTOCOL, "step before reset")
        try:
            return self.env.step(action)  # type: ignore[attr-defined]
        except BaseException as exc:  # noqa: BLE001
            raise Failure(K_PROGRAM, _describe(exc)) from None


class Failure(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def _describe(exc: BaseException, limit: int = 2000) -> str:
    """``Type: message`` plus the innermost program frames, bounded."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == "<environment>"]
    where = "".join(f" (line {f.lineno}, in {f.name})" for f in frames[-3:])
    text = f"{type(exc).__name__}: {exc}"
    return (text[: limit - len(where)] + where) if len(text) + len(where) > limit else text + where


def _read_some(fd: int) -> bytes:
    chunk = os.read(fd, 1 << 16)
    if not chunk:
        raise EOFError
    return chunk


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def harden(settings: dict) -> dict:
    """Apply every isolation step the settings ask for; returns what was applied (the hello report).

    With ``settings["required"]`` a step that fails is fatal (strict isolation); otherwise it is reported and skipped.
    """
    report: dict = {"errors": []}
    required = settings["required"]

    def attempt(name: str, fn, *args) -> None:
        try:
            fn(*args)
            report[name] = True
        except Exception as exc:  # noqa: BLE001 - reported to the trainer, fatal when required
            if required:
                raise RuntimeError(f"{name}: {exc}") from exc
            report[name] = False
            report["errors"].append(f"{name}: {exc}")

    if settings["drop_uid"] is not None or settings["user_namespace"]:
        attempt("privileges", drop_privileges, settings["drop_uid"], settings["drop_gid"], settings["user_namespace"],
                settings["extra_namespaces"])
    # Die with the parent (bubblewrap, or the trainer's spawner thread without it). Set after the uid change, which
    # clears the setting bubblewrap made, and before any program code can start a thread that would outlive us.
    _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    attempt("rlimits", set_rlimits, settings["rlimits"])
    keep = sorted({settings["req_fd"], settings["rep_fd"]})
    low = 3
    for fd in keep:
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 16)
    if settings["seccomp"]:
        attempt("seccomp", load_seccomp, settings["seccomp_library"])
    status = _status_fields()
    report.update(uid=int(status["Uid"].split()[0]), seccomp_mode=int(status.get("Seccomp", "0")),
                  cap_eff=status.get("CapEff", "").strip(), no_new_privs=status.get("NoNewPrivs", "0").strip() == "1")
    return report


def serve(settings: dict, capture: Capture) -> None:
    import msgpack

    req, rep = settings["req_fd"], settings["rep_fd"]
    host = Host(settings["module_name"], settings["max_reply"])
    handlers = {OP_LOAD: host.load, OP_RESET: host.reset, OP_STEP: host.step}
    packb, unpackb, frame = msgpack.packb, msgpack.unpackb, FRAME
    pending = b""  # one read usually brings a whole request: length prefix and body together
    while True:
        try:
            while len(pending) < 4:
                pending += _read_some(req)
            (size,) = frame.unpack_from(pending)
            while len(pending) < 4 + size:
                pending += _read_some(req)
        except EOFError:  # the trainer closed the pipe: leave at once, whatever threads the program started
            os._exit(0)
        seq, op, arg = unpackb(pending[4:4 + size])
        pending = pending[4 + size:]
        try:
            value, status = handlers[op](arg), ST_OK
        except Failure as failure:
            value, status = [failure.kind, failure.message], ST_ERR
        output, overflow = capture.drain()
        try:
            body = packb([seq, status, value, output, overflow])
        except MemoryError:
            body = packb([seq, ST_ERR, [K_REPLY_TOO_LARGE, f"the {op} reply does not fit in the worker's memory"],
                          output, overflow])
        except Exception as exc:  # noqa: BLE001 - the program returned something that is not plain data
            body = packb([seq, ST_ERR, [K_UNSERIALIZABLE, f"{op} returned a value that is not plain data "
                                        f"(str, int, float, bool, None, list, dict): {_describe(exc, 300)}"],
                          output, overflow])
        if len(body) > host.max_reply:
            body = packb([seq, ST_ERR, [K_REPLY_TOO_LARGE, f"the {op} reply is {len(body)} bytes, over the "
                                        f"sandbox limit of {host.max_reply}"], output, overflow])
        _write_all(rep, frame.pack(len(body)) + body)


def main() -> None:
    settings = json.loads(sys.argv[1])
    for key in [k for k in os.environ if k != "PYTHONHASHSEED"]:  # PWD from bubblewrap, LC_CTYPE from the locale
        del os.environ[key]
    sys.path.insert(0, settings["lib_dir"])
    import msgpack

    try:
        report = harden(settings)
        capture = Capture(settings["output_limit"])
        hello = [0, ST_OK, report, "", False]
    except Exception as exc:  # noqa: BLE001 - strict isolation could not be had: tell the trainer, then exit
        hello = [0, ST_ERR, ["isolation", str(exc)], "", False]
    body = msgpack.packb(hello)
    _write_all(settings["rep_fd"], FRAME.pack(len(body)) + body)
    if hello[1] == ST_OK:
        serve(settings, capture)


if __name__ == "__main__":
    main()
