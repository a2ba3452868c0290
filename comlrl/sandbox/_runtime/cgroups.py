"""A cgroup for the requests of one zygote: memory, processes and CPU counted for a whole run.

RLIMIT_AS bounds each process, not a run: a program that forks N children may use N times
``memory_mb``, and its files on a tmpfs come on top. The zygote makes one cgroup beneath its own
(cgroup v2, or the v1 ``memory``, ``pids`` and, where there, ``cpu`` hierarchies) with
``memory.max`` (swap off), ``pids.max`` and a one-CPU ``cpu.max``; every request's init moves
itself in before it forks anything, so the program, its children and the pages of the files
they write are counted together. A zygote serves one request at a time, so one group serves them
all in turn.

The directories are opened once, before the zygote's mount namespace makes the mounts
read-only: writes go through those descriptors, which belong to the mounts outside. Needs write
access to the zygote's own cgroup (root, or a delegated v2 subtree whose ``subtree_control``
enables ``memory`` and ``pids``); elsewhere :func:`create` raises OSError and the layer is off.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass, field

__all__ = ["RunGroup", "create", "remove_paths"]

_REQUIRED = ("memory", "pids")
_CPU_PERIOD_US = 100_000


@dataclass
class RunGroup:
    version: int
    paths: list[str]                                   # one directory per hierarchy (v2: one)
    fds: list[int] = field(default_factory=list)       # O_PATH descriptors of those directories
    parents: list[int] = field(default_factory=list)   # and of their parents (to remove them)
    controllers: tuple[str, ...] = ()

    def _write(self, index: int, name: str, value: str) -> None:
        fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.fds[index])
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)

    def _read(self, index: int, name: str) -> str:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.fds[index])
        try:
            return os.read(fd, 1 << 16).decode()
        finally:
            os.close(fd)

    def enter(self) -> None:
        """Move the calling process into the group (every hierarchy); raises OSError."""
        for index in range(len(self.fds)):
            self._write(index, "cgroup.procs", "0")  # 0: the writer

    def members(self) -> list[int]:
        if not self.fds:
            return []
        try:
            return [int(p) for p in self._read(0, "cgroup.procs").split()]
        except OSError:
            return []

    def kill(self) -> None:
        """SIGKILL every process in the group (cgroup.kill where the kernel has it)."""
        if not self.fds:
            return
        if self.version == 2:
            try:
                self._write(0, "cgroup.kill", "1")
                return
            except OSError:
                pass
        _kill_members(self.members)

    def oom_kills(self) -> int:
        """How many processes the kernel killed in the group for memory, so far."""
        if not self.fds:
            return 0
        try:
            text = self._read(0, "memory.events" if self.version == 2 else "memory.oom_control")
        except OSError:
            return 0
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        self.kill()
        for fd, parent, path in zip(self.fds, self.parents, self.paths):
            _rmdir(lambda: os.rmdir(os.path.basename(path), dir_fd=parent))
        for fd in (*self.fds, *self.parents):
            os.close(fd)
        self.fds, self.parents = [], []


def _kill_members(members) -> None:
    """SIGKILL the members, again while new ones appear (one may fork as we go; those already
    killed may stay listed until they are reaped). No round limit: a killed process forks no
    more, and pids.max bounds how many can appear while we go round."""
    killed: set[int] = set()
    while True:
        pids = [pid for pid in members() if pid not in killed]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        killed.update(pids)


def _rmdir(remove) -> None:
    for _ in range(50):  # killed processes leave the group once they are reaped
        try:
            remove()
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                return
        time.sleep(0.01)


def remove_paths(paths: list[str]) -> None:
    """Kill whatever is left in these groups and remove them (the worker, after its zygote died)."""
    for path in paths:
        def members(path=path):
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    return [int(p) for p in f.read().split()]
            except OSError:
                return []
        _kill_members(members)
        _rmdir(lambda path=path: os.rmdir(path))


# --- finding the hierarchies -----------------------------------------------------------------------

def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, file-system type, options) of each cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                unescape = (lambda s: s.encode().decode("unicode_escape"))
                out.append((unescape(fields[3]), unescape(fields[4]), tail[0], set(tail[2].split(","))))
    return out


def _own_cgroups() -> dict[str, str]:
    """``{"": v2 path, controller: v1 path}`` of this process (/proc/self/cgroup)."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            number, controllers, path = line.rstrip("\n").split(":", 2)
            if number == "0" and not controllers:
                out[""] = path
            for name in controllers.split(","):
                if name:
                    out[name] = path
    return out


def _directory(mount_root: str, mount_point: str, path: str) -> str | None:
    """Where the cgroup ``path`` of a hierarchy is, under a mount of that hierarchy's ``mount_root``."""
    root = mount_root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return None
    return mount_point + path[len(root):]


def _open_path(path: str) -> int:
    return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def create(name: str, memory_mb: int, tasks: int) -> RunGroup:
    """The group ``name`` beneath this process's cgroup, with its limits set; raises OSError."""
    own, mounts = _own_cgroups(), _mounts()
    errors = []
    v2 = [(r, p) for r, p, kind, _ in mounts if kind == "cgroup2"]
    if "" in own and v2:
        try:
            return _create_v2(_directory(*v2[0], own[""]), name, memory_mb, tasks)
        except OSError as exc:
            errors.append(f"v2: {exc}")
    hierarchies = {}
    for controller in (*_REQUIRED, "cpu"):
        for root, point, kind, options in mounts:
            if kind == "cgroup" and controller in options and controller in own:
                where = _directory(root, point, own[controller])
                if where is not None:
                    hierarchies[controller] = where
                    break
    if all(c in hierarchies for c in _REQUIRED):
        try:
            return _create_v1(hierarchies, name, memory_mb, tasks)
        except OSError as exc:
            errors.append(f"v1: {exc}")
    elif not errors:
        errors.append("no cgroup v2 or v1 memory and pids hierarchy is mounted")
    raise OSError(errno.ENOTSUP, "; ".join(errors))


def _make(parent: str, name: str) -> tuple[str, int, int]:
    path = os.path.join(parent, name)
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass  # left by an earlier zygote of the same pid (killed): reuse it
    return path, _open_path(path), _open_path(parent)


def _create_v2(parent: str | None, name: str, memory_mb: int, tasks: int) -> RunGroup:
    if parent is None:
        raise OSError(errno.ENOENT, "this process's cgroup is not under the cgroup2 mount")
    with open(os.path.join(parent, "cgroup.controllers")) as f:
        available = set(f.read().split())
    if not all(c in available for c in _REQUIRED):
        raise OSError(errno.ENOTSUP, f"{parent} has no {'/'.join(c for c in _REQUIRED if c not in available)} "
                                     "controller (bound to a v1 hierarchy, or not delegated)")
    with open(os.path.join(parent, "cgroup.subtree_control")) as f:
        enabled = set(f.read().split())
    missing = [c for c in _REQUIRED if c not in enabled]
    if missing:  # possible only where this cgroup holds no process (or is the root)
        try:
            with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                f.write(" ".join(f"+{c}" for c in missing))
        except OSError as exc:
            raise OSError(exc.errno, f"{parent} does not give its children the {'/'.join(missing)} controller(s) "
                                     f"({os.strerror(exc.errno or 0)})") from None
        with open(os.path.join(parent, "cgroup.subtree_control")) as f:
            enabled = set(f.read().split())
    path, fd, parent_fd = _make(parent, name)
    group = RunGroup(2, [path], [fd], [parent_fd], tuple(c for c in (*_REQUIRED, "cpu") if c in enabled))
    try:
        group._write(0, "memory.max", str(memory_mb << 20))
        try:
            group._write(0, "memory.swap.max", "0")
        except FileNotFoundError:
            pass
        group._write(0, "pids.max", str(tasks))
        if "cpu" in enabled:
            group._write(0, "cpu.max", f"{_CPU_PERIOD_US} {_CPU_PERIOD_US}")
    except OSError:
        group.remove()
        raise
    return group


def _create_v1(hierarchies: dict[str, str], name: str, memory_mb: int, tasks: int) -> RunGroup:
    group = RunGroup(1, [])
    settings = {"memory": [("memory.limit_in_bytes", str(memory_mb << 20)),
                           ("memory.memsw.limit_in_bytes", str(memory_mb << 20))],  # absent without swap accounting
                "pids": [("pids.max", str(tasks))],
                "cpu": [("cpu.cfs_period_us", str(_CPU_PERIOD_US)), ("cpu.cfs_quota_us", str(_CPU_PERIOD_US))]}
    try:
        for controller, parent in hierarchies.items():  # memory first: index 0 is read for members and OOM kills
            try:
                path, fd, parent_fd = _make(parent, name)
            except OSError:
                if controller in _REQUIRED:
                    raise
                continue  # no CPU limit, then
            group.paths.append(path)
            group.fds.append(fd)
            group.parents.append(parent_fd)
            try:
                for file, value in settings[controller]:
                    try:
                        group._write(len(group.fds) - 1, file, value)
                    except FileNotFoundError:
                        if file != "memory.memsw.limit_in_bytes":
                            raise
            except OSError:
                if controller in _REQUIRED:
                    raise
                _rmdir(lambda: os.rmdir(name, dir_fd=parent_fd))  # no CPU limit, then
                for fds in (group.fds, group.parents):
                    os.close(fds.pop())
                group.paths.pop()
                continue
            group.controllers += (controller,)
    except OSError:
        group.remove()
        raise
    return group
