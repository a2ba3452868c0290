"""Isolation layers: set up once in the zygote (namespaces, mounts, the seccomp filter), applied to
every judge and program process after it forks (rlimits, user, Landlock, seccomp).

Each layer is tried on its own and reported; one that the machine does not allow is left off.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import stat
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from . import osapi

__all__ = ["Zygote", "setup", "restrict", "MECHANISMS"]

# What `disable=` may name: the mechanisms behind the layers.
MECHANISMS = ("user_namespace", "pid_namespace", "network_namespace", "mount_namespace", "uid_drop", "seccomp",
              "landlock")

# Namespace-creating clone flags a program may not use (it could regain capabilities in a new
# user namespace); clone3 hides its flags from seccomp, so it is refused and glibc falls back to clone.
_NS_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
# Syscalls no test program needs and that reach other processes or the kernel's attack surface.
_DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "io_uring_setup", "io_uring_enter",
           "io_uring_register", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
           "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_by_handle_at", "name_to_handle_at",
           "kexec_load", "init_module", "finit_module", "delete_module", "swapon", "swapoff", "reboot", "acct",
           "quotactl", "fanotify_init", "move_mount", "fsopen", "fsmount", "open_tree", "mount_setattr")


@dataclass
class Zygote:
    """What the zygote set up, shared by every request it serves."""

    base_dir: str
    limits: dict[str, Any]
    active: dict[str, bool] = field(default_factory=dict)   # mechanism -> on
    reasons: dict[str, str] = field(default_factory=dict)   # mechanism -> why off
    uids: Optional[tuple[int, int]] = None                  # (program, judge) when dropping from root
    in_userns: bool = False
    pid_ns_fd: Optional[int] = None   # root: our own PID namespace, to return to after each fork
    pid_helper: bool = False          # user namespace: fork through a helper that unshares
    seccomp_filter: Any = None
    read_paths: tuple[str, ...] = ()
    nproc_floor: int = 0   # processes the program's user already has (RLIMIT_NPROC counts them too)


def _try(z: Zygote, name: str, disabled: set[str], action) -> bool:
    if name in disabled:
        z.reasons[name] = "disabled"
        z.active[name] = False
        return False
    try:
        note = action()
    except Exception as exc:  # any failure leaves the layer off, with the reason reported
        z.reasons[name] = f"{type(exc).__name__}: {exc}"
        z.active[name] = False
        return False
    z.active[name] = True
    if isinstance(note, str):
        z.reasons[name] = note
    return True


def setup(config: dict[str, Any]) -> Zygote:
    """Set the zygote up (once, before any fork): child subreaper, namespaces, mounts, filters."""
    z = Zygote(base_dir=config["base_dir"], limits=config["limits"])
    # The trainer's import path (a PYTHONPATH, a venv): pyseccomp and landlock are found as there.
    sys.path.extend(p for p in config.get("sys_path", ()) if p and p not in sys.path)
    disabled = set(config.get("disable", ()))
    osapi.prctl(osapi.PR_SET_CHILD_SUBREAPER, 1)  # orphans of a run come back here to be killed
    root = os.geteuid() == 0
    if root:
        z.active["user_namespace"], z.reasons["user_namespace"] = False, "not needed as root"
    else:
        z.in_userns = _try(z, "user_namespace", disabled, _enter_user_namespace)
    privileged = root or z.in_userns
    read_paths = _read_paths()
    hidden = _unreachable(read_paths) if root else {}
    if privileged:
        _try(z, "network_namespace", disabled, lambda: osapi.unshare(osapi.CLONE_NEWNET))
        _try(z, "mount_namespace", disabled, lambda: _read_only_root(z.base_dir, hidden))
    else:
        for name in ("network_namespace", "mount_namespace"):
            z.active[name], z.reasons[name] = False, "needs root or a user namespace"
    if not root:
        z.active["uid_drop"], z.reasons["uid_drop"] = False, "not running as root"
    elif hidden and not z.active["mount_namespace"]:
        z.active["uid_drop"] = False
        z.reasons["uid_drop"] = (f"Python's files under {', '.join(hidden)} are closed to other users, and without "
                                 "the mount namespace they cannot be shown to the program's user")
    else:
        # Ids no account uses, unique to this zygote while it lives (its pid is): the program's
        # RLIMIT_NPROC then counts only its own processes, and it cannot signal the judge.
        uid = 1_000_000_000 + 2 * os.getpid()
        if _try(z, "uid_drop", disabled, lambda: None):
            z.uids = (uid, uid + 1)
    if privileged:
        z.pid_helper = not root
        if not _try(z, "pid_namespace", disabled, lambda: _probe_pid_namespace(z, root)):
            z.pid_ns_fd, z.pid_helper = None, False
    else:
        z.active["pid_namespace"], z.reasons["pid_namespace"] = False, "needs root or a user namespace"
    if z.uids is not None:
        z.active["process_limit"] = True
    elif root:
        z.active["process_limit"] = False
        z.reasons["process_limit"] = "RLIMIT_NPROC does not apply to root, and the program keeps uid 0"
    else:
        # The user's own processes count against the limit too: allow the program as many more.
        z.nproc_floor = _tasks_of(os.getuid())
        z.active["process_limit"] = True
        z.reasons["process_limit"] = f"{z.nproc_floor} processes of this user already running"
    _try(z, "seccomp", disabled, lambda: setattr(z, "seccomp_filter", _build_seccomp()))
    if _try(z, "landlock", disabled, _probe_landlock):
        z.active["landlock_signals"] = "signals" in z.reasons.get("landlock", "")
    z.read_paths = read_paths
    return z


# --- namespaces and mounts (zygote, once) ---------------------------------------------------------

def _enter_user_namespace() -> None:
    uid, gid = os.geteuid(), os.getegid()
    osapi.unshare(osapi.CLONE_NEWUSER)
    # The same ids inside: files the program writes belong to the user, and no id 0 exists in here.
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            raw = line.split()[4]
            points.append(raw.encode().decode("unicode_escape"))  # \040 etc.
    return sorted(set(points), key=len)


def _read_only_root(base_dir: str, hidden: dict[str, list[str]]) -> str:
    """A private mount namespace where every mount is read-only except a fresh tmpfs on
    ``base_dir`` (the runs' working directories; also bounds their disk use). Directories other
    users cannot enter (``hidden``: e.g. /root holding Python) are covered with an empty tmpfs that
    holds only the Python folders, so a program under another user id can import, and sees
    nothing else there."""
    osapi.unshare(osapi.CLONE_NEWNS)
    osapi.mount(None, "/", None, osapi.MS_REC | osapi.MS_PRIVATE)
    osapi.mount("tmpfs", base_dir, "tmpfs", osapi.MS_NOSUID | osapi.MS_NODEV, "size=512m,mode=0711")
    _expose(base_dir, hidden)
    failed = []
    for point in _mount_points():
        if point == base_dir or point.startswith(base_dir + "/"):
            continue
        try:
            flags = osapi.statvfs_mount_flags(point)
            osapi.mount(None, point, None, osapi.MS_BIND | osapi.MS_REMOUNT | osapi.MS_RDONLY | flags)
        except OSError as exc:
            if point == "/":
                raise
            failed.append(f"{point} ({errno.errorcode.get(exc.errno, exc.errno)})")
    note = f"; {', '.join(hidden)} hidden but for Python's folders" if hidden else ""
    return (f"left writable: {', '.join(failed)}" if failed else "every mount read-only") + note


def _unreachable(paths: tuple[str, ...]) -> dict[str, list[str]]:
    """``{closed directory: [paths beneath it]}``: directories without o+x on the way to ``paths``."""
    out: dict[str, list[str]] = {}
    for path in paths:
        current = ""
        for part in os.path.realpath(path).strip("/").split("/"):
            current += "/" + part
            try:
                mode = os.stat(current).st_mode
            except OSError:
                break
            if stat.S_ISDIR(mode) and not mode & 0o001:
                if current != path:
                    out.setdefault(current, []).append(os.path.realpath(path))
                break
    return {top: [p for p in inner if not any(p.startswith(q + "/") for q in inner)]
            for top, inner in out.items()}


def _expose(base_dir: str, hidden: dict[str, list[str]]) -> None:
    stage, plan = os.path.join(base_dir, ".python"), []
    for top, inner in hidden.items():
        for path in dict.fromkeys(inner):
            staged = os.path.join(stage, str(len(plan)))
            os.makedirs(staged, 0o711)
            osapi.mount(path, staged, None, osapi.MS_BIND | osapi.MS_REC)
            plan.append((path, staged))
        osapi.mount("tmpfs", top, "tmpfs", osapi.MS_NOSUID | osapi.MS_NODEV, "size=1m,mode=0755")
    for path, staged in plan:
        os.makedirs(path, 0o755, exist_ok=True)
        osapi.mount(staged, path, None, osapi.MS_BIND | osapi.MS_REC)


def _probe_pid_namespace(z: Zygote, root: bool) -> str:
    """Root switches its children's PID namespace with unshare + setns around each fork. In a user
    namespace setns back is not allowed (the original namespace belongs to the parent user
    namespace), so a short-lived helper unshares and forks instead (:func:`fork_in_new_pid_namespace`)."""
    if root:
        z.pid_ns_fd = os.open("/proc/self/ns/pid", os.O_RDONLY)
    pid = fork_in_new_pid_namespace(z, lambda: os._exit(0 if os.getpid() == 1 else 1))
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise OSError("the first process of a new PID namespace did not get PID 1")
    return "unshare + setns" if root else "through a helper process"


def fork_in_new_pid_namespace(z: Zygote, target) -> int:
    """Fork ``target()`` as the first process (PID 1) of a new PID namespace; its PID here. Without
    the PID-namespace layer, a plain fork."""
    if z.pid_ns_fd is not None:
        osapi.unshare(osapi.CLONE_NEWPID)
        try:
            return _fork(target)
        finally:
            osapi.setns(z.pid_ns_fd, osapi.CLONE_NEWPID)
    if not z.pid_helper:
        return _fork(target)
    read, write = os.pipe()
    helper = os.fork()
    if helper == 0:
        try:
            os.close(read)
            osapi.unshare(osapi.CLONE_NEWPID)
            os.write(write, str(_fork(target)).encode())
        finally:
            os._exit(0)
    os.close(write)
    text = b""
    while chunk := os.read(read, 64):
        text += chunk
    os.close(read)
    os.waitpid(helper, 0)  # the helper is gone: its child is ours now (this process is a subreaper)
    if not text:
        raise OSError("the PID-namespace helper could not fork")
    return int(text)


def _fork(target) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            target()
        finally:
            os._exit(71)
    return pid


# --- filters (built once, loaded per process) ------------------------------------------------------

def _build_seccomp():
    import pyseccomp as sc

    f = sc.SyscallFilter(defaction=sc.ALLOW)
    f.add_rule(sc.ERRNO(errno.EACCES), "socket")  # no new sockets of any family; socketpair stays
    for name in _DENIED:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except (ValueError, RuntimeError, OSError):  # not a syscall on this architecture
            pass
    for flag in _NS_FLAGS:
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    # kill(-1, sig) signals every process the caller may signal: never a test program's business.
    f.add_rule(sc.ERRNO(errno.EPERM), "kill", sc.Arg(0, sc.MASKED_EQ, 0xFFFFFFFF, 0xFFFFFFFF))
    return f


def _tasks_of(uid: int) -> int:
    """Threads and processes of ``uid`` now (what RLIMIT_NPROC counts)."""
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return count


def _probe_landlock() -> str:
    import landlock

    abi = landlock.landlock_abi_version()
    if abi < 1:
        raise OSError("Landlock is not enabled in this kernel")
    features = landlock_features(abi)
    return f"ABI {abi}" + "".join(f", {name}" for name, on in features.items() if on)


def _read_paths() -> tuple[str, ...]:
    """Where a program may read: the system's and Python's own files (the interpreter's prefixes and
    package folders on its path), nothing of the user's: not the working directory or a project
    folder on the path, which may hold checkpoints or keys."""
    prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    paths = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", *prefixes]
    paths += [p for p in sys.path if p and os.path.isdir(p) and (
        os.path.basename(p.rstrip("/")) in ("site-packages", "dist-packages")
        or any(os.path.realpath(p).startswith(os.path.realpath(q) + "/") for q in prefixes))]
    real = []
    for p in paths:
        if os.path.exists(p):
            for q in (p, os.path.realpath(p)):
                if q not in real:
                    real.append(q)
    return tuple(real)


# --- per process (after fork) -----------------------------------------------------------------------

def restrict(z: Zygote, role: str, workdir: Optional[str], cpu_s: float, memory_mb: int) -> None:
    """Confine this freshly forked process: ``role`` is "program" (untrusted) or "judge"."""
    os.setsid()
    osapi.prctl(osapi.PR_SET_DUMPABLE, 0)  # no ptrace or /proc/<pid>/mem access by same-user processes
    _rlimits(z, cpu_s, memory_mb, role)
    os.chdir(workdir or "/")
    home = workdir or "/nonexistent"
    os.environ.clear()
    os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"})
    if z.uids is not None:
        uid = z.uids[0] if role == "program" else z.uids[1]
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # leaving uid 0 clears every capability
    elif z.in_userns:
        osapi.drop_capabilities()
    osapi.prctl(osapi.PR_SET_NO_NEW_PRIVS, 1)
    if z.active.get("landlock"):
        _landlock(z, workdir)
    if z.seccomp_filter is not None:
        z.seccomp_filter.load()


def _rlimits(z: Zygote, cpu_s: float, memory_mb: int, role: str) -> None:
    limits = z.limits
    cpu = max(1, int(cpu_s + 0.999))
    pairs = [(resource.RLIMIT_CPU, (cpu, cpu + 1)),
             (resource.RLIMIT_AS, (memory_mb << 20,) * 2),
             (resource.RLIMIT_FSIZE, (int(limits["fsize_mb"]) << 20,) * 2),
             (resource.RLIMIT_NOFILE, (int(limits["nofile"]),) * 2),
             (resource.RLIMIT_CORE, (0, 0))]
    if role == "program":
        pairs.append((resource.RLIMIT_NPROC, (z.nproc_floor + int(limits["nproc"]),) * 2))
    for which, value in pairs:
        soft, hard = resource.getrlimit(which)
        cap = hard if hard != resource.RLIM_INFINITY else value[1]
        resource.setrlimit(which, (min(value[0], cap), min(value[1], cap)))


class _RulesetAttr(ctypes.Structure):
    """struct landlock_ruleset_attr (linux/landlock.h): file-system rights, TCP rights (ABI 4),
    scopes (ABI 6). The ``landlock`` package's own struct has only the first field."""

    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


_NET_TCP_BIND_CONNECT = 0x1 | 0x2          # LANDLOCK_ACCESS_NET_BIND_TCP | CONNECT_TCP
_SCOPE_ABSTRACT_UNIX_AND_SIGNAL = 0x1 | 0x2  # LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | SIGNAL


def landlock_features(abi: int) -> dict[str, bool]:
    return {"tcp": abi >= 4, "signals": abi >= 6}


def _landlock(z: Zygote, workdir: Optional[str]) -> None:
    """Reads only beneath ``z.read_paths``, writes only beneath ``workdir``; with ABI 4 no TCP
    bind/connect, with ABI 6 no signals to (and no abstract sockets of) processes outside."""
    from landlock import FSAccess, landlock_abi_version
    from landlock.plumbing import PathBeneathAttr, RulesetAttr, get_add_rule, get_create_ruleset, get_restrict_self

    features = landlock_features(landlock_abi_version())
    attr = _RulesetAttr(int(FSAccess.all()), _NET_TCP_BIND_CONNECT if features["tcp"] else 0,
                        _SCOPE_ABSTRACT_UNIX_AND_SIGNAL if features["signals"] else 0)
    # the package's function is typed for its one-field struct; the kernel reads sizeof(attr) bytes
    fd = get_create_ruleset()(ctypes.cast(ctypes.pointer(attr), ctypes.POINTER(RulesetAttr)), ctypes.sizeof(attr), 0)
    read = int(FSAccess.READ_FILE | FSAccess.READ_DIR | FSAccess.EXECUTE)
    rules = [(path, read) for path in z.read_paths]
    rules += [(dev, int(FSAccess.all_file())) for dev in ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")]
    if workdir is not None:
        rules.append((workdir, int(FSAccess.all())))
    try:
        for path, rights in rules:
            try:
                target = os.open(path, os.O_PATH)
            except OSError:
                continue
            try:
                get_add_rule()(fd, 1, ctypes.byref(PathBeneathAttr(rights, target)), 0)  # 1: path beneath
            finally:
                os.close(target)
        get_restrict_self()(fd, 0)
    finally:
        os.close(fd)
