"""Thin wrappers over libc functions and system calls that Python 3.10/3.11 lacks (``unshare``,
``setns``, ``mount``, ``umount2``, ``prctl``, ``capset``, Landlock's three calls, loading a seccomp
filter). Each judges failure by its return value (-1), never by a leftover errno, and raises
OSError with the C errno."""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_NOATIME = 0x400
MS_NODIRATIME = 0x800
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MS_RELATIME = 0x200000
MNT_DETACH = 0x2

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
SECCOMP_MODE_FILTER = 2

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> int:
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _call(function, *args) -> int:
    """``function(*args)`` with errno cleared first (so the OSError names this call's error)."""
    ctypes.set_errno(0)
    return function(*args)


def unshare(flags: int) -> None:
    _check(_call(_libc.unshare, ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_call(_libc.setns, ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: s.encode() if s is not None else None)
    _check(_call(_libc.mount, enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def umount2(target: str, flags: int) -> None:
    _check(_call(_libc.umount2, target.encode(), ctypes.c_int(flags)), f"umount {target}")


def prctl(option: int, arg: int = 0) -> None:
    _check(_call(_libc.prctl, ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                 ctypes.c_ulong(0)), "prctl")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_capabilities() -> None:
    """Clear every capability of this process (capset(2), version 3: two 32-bit words). A process
    that created a user namespace holds every capability in it until it execs; its children must not."""
    header = _CapHeader(0x20080522, 0)
    data = (_CapData * 2)()
    _check(_call(_libc.capset, ctypes.byref(header), data), "capset")


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def seccomp_load(program: bytes) -> None:
    """Install a seccomp filter given as BPF (``struct sock_filter`` records of 8 bytes, as
    libseccomp exports them) on this thread; needs no_new_privs (or CAP_SYS_ADMIN)."""
    buffer = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.addressof(buffer))
    _check(_call(_libc.prctl, ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog),
                 ctypes.c_ulong(0), ctypes.c_ulong(0)), "prctl(PR_SET_SECCOMP)")


def statvfs_mount_flags(path: str) -> int:
    """The MS_* flags a read-only bind remount of ``path`` must keep (a user namespace may not
    clear nosuid/nodev/noexec/atime flags of mounts it inherited)."""
    flags = os.statvfs(path).f_flag
    out = 0
    for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                   (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME)):
        if flags & st:
            out |= ms
    return out


# --- Landlock (linux/landlock.h); the same syscall numbers on every architecture ---------------------

_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1


class LandlockRulesetAttr(ctypes.Structure):
    """struct landlock_ruleset_attr: file-system rights, TCP rights (ABI 4), scopes (ABI 6)."""

    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _syscall(number: int, *args) -> int:
    return _call(_libc.syscall, ctypes.c_long(number), *args)


def landlock_abi_version() -> int:
    """The kernel's Landlock ABI version; OSError where Landlock is missing or disabled."""
    return _check(_syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                           ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION)), "landlock_create_ruleset")


def landlock_create_ruleset(attr: LandlockRulesetAttr) -> int:
    """A new ruleset's file descriptor."""
    return _check(_syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
                           ctypes.c_uint32(0)), "landlock_create_ruleset")


def landlock_add_path_rule(ruleset: int, path_fd: int, allowed: int) -> None:
    rule = _PathBeneathAttr(allowed, path_fd)
    _check(_syscall(_SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH),
                    ctypes.byref(rule), ctypes.c_uint32(0)), "landlock_add_rule")


def landlock_restrict_self(ruleset: int) -> None:
    _check(_syscall(_SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)), "landlock_restrict_self")
