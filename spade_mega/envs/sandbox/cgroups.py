"""Per-worker memory and pids cgroups, where the machine lets this process create them.

Each controller is found in whichever hierarchy has it: a cgroup v1 mount of its own, or the v2 unified tree when the
controller is (or can be) enabled for our children. A pool gets one directory per hierarchy under the trainer's own
cgroup, and each worker one directory below it with its limits. A worker joins its cgroups after its hello and
before any program code runs, so everything the program starts inherits them. When any step is refused (not root,
no delegation, a v2 parent that holds processes) the pool runs without cgroups and says why: rlimits still apply.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import dataclass

CONTROLLERS = ("memory", "pids")
_LIMIT_FILES = {(False, "memory"): "memory.limit_in_bytes", (True, "memory"): "memory.max",
                (False, "pids"): "pids.max", (True, "pids"): "pids.max"}


@dataclass(frozen=True)
class _Hierarchy:
    directory: str  # this process's cgroup directory in the hierarchy
    v2: bool
    controllers: tuple[str, ...]


def _own_hierarchies() -> list[_Hierarchy]:
    """Where each of CONTROLLERS lives for this process (v1 first: hybrid hosts keep controllers there)."""
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f.read().splitlines():
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(",") if controllers else ["<v2>"]:
                own[name] = path
    found: dict[str, _Hierarchy] = {}
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f.read().splitlines()]
    for fields in mounts:
        sep = fields.index("-")
        fstype, root, mountpoint, options = fields[sep + 1], fields[3], fields[4], fields[-1].split(",")
        if fstype == "cgroup":
            names = tuple(c for c in CONTROLLERS if c in options and c not in found)
            key = next((c for c in names if c in own), None)
            if key is None:
                continue
            directory = _join(mountpoint, root, own[key])
            for c in names:
                found[c] = _Hierarchy(directory, False, names)
    for fields in mounts:
        sep = fields.index("-")
        if fields[sep + 1] == "cgroup2" and "<v2>" in own:
            directory = _join(fields[4], fields[3], own["<v2>"])
            try:
                with open(os.path.join(directory, "cgroup.controllers")) as f:
                    available = f.read().split()
            except OSError:
                continue
            names = tuple(c for c in CONTROLLERS if c in available and c not in found)
            if names:
                for c in names:
                    found[c] = _Hierarchy(directory, True, names)
    return list({h.directory: h for h in found.values()}.values())


def _join(mountpoint: str, root: str, path: str) -> str:
    relative = path[len(root):] if root != "/" and path.startswith(root) else path
    return os.path.normpath(mountpoint + "/" + relative.lstrip("/"))


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


class WorkerCgroup:
    """The cgroup directories of one worker (one per hierarchy)."""

    def __init__(self, directories: list[str]) -> None:
        self.directories = directories

    def attach(self, pid: int) -> None:
        for directory in self.directories:
            _write(os.path.join(directory, "cgroup.procs"), str(pid))

    def pids(self) -> list[int]:
        found: set[int] = set()
        for directory in self.directories:
            try:
                with open(os.path.join(directory, "cgroup.procs")) as f:
                    found.update(int(p) for p in f.read().split())
            except FileNotFoundError:
                pass
        return sorted(found)

    def remove(self, timeout: float = 2.0) -> None:
        """Kill anything still inside, then delete the directories (they must be empty to go)."""
        deadline = time.monotonic() + timeout
        for directory in self.directories:
            while os.path.isdir(directory):
                for pid in self.pids():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    os.rmdir(directory)
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.005)


TAG_PREFIX = "spade-sandbox-"
_POOL_NUMBERS = itertools.count(1)


def pool_tag() -> str:
    """Directory name of a pool's cgroups: names its process, so a later pool can remove those of a dead one."""
    return f"{TAG_PREFIX}{os.getpid()}-{next(_POOL_NUMBERS)}"


def _remove_stale(directory: str) -> None:
    """Remove the pool directories left by trainer processes that no longer exist."""
    for name in os.listdir(directory):
        if not name.startswith(TAG_PREFIX):
            continue
        pid = name[len(TAG_PREFIX):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            CgroupTree.remove_directory(os.path.join(directory, name))


class CgroupTree:
    """The pool's cgroup directories; ``worker()`` makes one worker's limited cgroup below them."""

    def __init__(self, hierarchies: list[_Hierarchy], tag: str) -> None:
        self.hierarchies = hierarchies
        self.roots = [os.path.join(h.directory, tag) for h in hierarchies]
        self._numbers = itertools.count(1)  # next() is atomic: several spawner threads share the tree

    @classmethod
    def create(cls, tag: str) -> tuple["CgroupTree | None", str]:
        """The tree, or None and the reason it cannot be had here."""
        try:
            hierarchies = _own_hierarchies()
            if not hierarchies:
                return None, "no cgroup hierarchy offers the memory or pids controller"
            for hierarchy in hierarchies:
                _remove_stale(hierarchy.directory)
            tree = cls(hierarchies, tag)
            for hierarchy, root in zip(hierarchies, tree.roots):
                if hierarchy.v2:
                    enable = " ".join(f"+{c}" for c in hierarchy.controllers)
                    _write(os.path.join(hierarchy.directory, "cgroup.subtree_control"), enable)
                    os.mkdir(root)
                    _write(os.path.join(root, "cgroup.subtree_control"), enable)
                else:
                    os.mkdir(root)
            return tree, ""
        except OSError as exc:
            return None, f"{exc.strerror or exc} ({exc.filename or 'cgroup'})"

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(sorted(c for h in self.hierarchies for c in h.controllers))

    def worker(self, memory_bytes: int, pids_max: int) -> WorkerCgroup:
        number = next(self._numbers)
        directories = []
        for hierarchy, root in zip(self.hierarchies, self.roots):
            directory = os.path.join(root, f"w{number}")
            os.mkdir(directory)
            directories.append(directory)
            limits = {"memory": str(memory_bytes), "pids": str(pids_max)}
            for controller in hierarchy.controllers:
                _write(os.path.join(directory, _LIMIT_FILES[(hierarchy.v2, controller)]), limits[controller])
        return WorkerCgroup(directories)

    def remove(self) -> None:
        for root in self.roots:
            self.remove_directory(root)

    @staticmethod
    def remove_directory(root: str) -> None:
        """Remove a pool directory and its worker directories, killing whatever is still inside."""
        if not os.path.isdir(root):
            return
        for name in os.listdir(root):
            if os.path.isdir(os.path.join(root, name)):
                WorkerCgroup([os.path.join(root, name)]).remove()
        os.rmdir(root)
