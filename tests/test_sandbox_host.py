"""What a program can touch on the host that it must not: unix sockets of host services, the
metadata of the user's files, the Python installation the trainer runs, the kernel log, memory
pinned in kernel buffers. Each test failed on the code before issue 27's fixes."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import pytest

from sandbox_support import MODES, as_root, box, boxes, code, make_sandbox, need, planted  # noqa: F401


# --- host unix sockets ------------------------------------------------------------------------------

@pytest.fixture
def host_socket():
    """A datagram service on a path anyone may write to (as /dev/log or journald's socket are);
    yields its path and what it received."""
    folder = tempfile.mkdtemp(prefix="host-sock-", dir="/tmp")
    os.chmod(folder, 0o777)
    path = os.path.join(folder, "log")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    os.chmod(path, 0o777)
    server.setblocking(False)
    received: list[bytes] = []

    def drain() -> list[bytes]:
        while True:
            try:
                received.append(server.recv(1 << 16))
            except BlockingIOError:
                return received
    yield path, drain
    server.close()
    shutil.rmtree(folder, ignore_errors=True)


def test_no_datagrams_to_a_host_unix_socket(box, host_socket):
    """Item 2: socket() was refused, but socketpair(AF_UNIX, SOCK_DGRAM) then sendto, connect or
    sendmsg to a world-writable socket path delivered datagrams (with SCM_RIGHTS) to the host
    service, in every mode. Stream pairs, which cannot be pointed anywhere, still work."""
    need(box, "network")
    path, drain = host_socket
    result = box.run(code(f"""
        import array, socket
        path = {path!r}
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0]))]
        attempts = {{
            "sendto": lambda s: s.sendto(b"sendto", path),
            "connect": lambda s: (s.connect(path), s.send(b"connect")),
            "sendmsg": lambda s: s.sendmsg([b"sendmsg"], rights, 0, path),
            "bind": lambda s: s.bind("\\0comlrl-sandbox-test"),
            "socket": lambda s: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b"socket", path),
        }}
        for kind in ("SOCK_DGRAM", "SOCK_SEQPACKET", "SOCK_STREAM"):
            for name, attempt in attempts.items():
                try:
                    a, b = socket.socketpair(socket.AF_UNIX, getattr(socket, kind))
                    attempt(a)
                    print(kind, name, "delivered?")
                except OSError as exc:
                    pass
        a, b = socket.socketpair()
        a.sendall(b"to my own end")
        print("pair:", b.recv(100).decode())
    """))
    assert drain() == [], (drain(), result.stdout)
    assert "pair: to my own end" in result.stdout, result
    for line in result.stdout.splitlines():
        assert not line.startswith(("SOCK_DGRAM", "SOCK_SEQPACKET")) or "sendto" not in line, result.stdout


def test_socket_and_pipe_buffers_stay_at_the_kernel_defaults(request):
    """Should-fix of issue 27: kernel buffers are not in RLIMIT_AS: without the cgroup, sockets
    with SO_SNDBUF raised held 941 MB in one process at memory_mb=128. Their buffers now stay at
    the kernel's defaults, so one process pins at most about its descriptors x net.core.wmem_default
    (16 pairs here: 256 MiB before, 7 MiB now with the usual 208 KiB default)."""
    box = make_sandbox(request, workers=1, timeout_s=20, memory_mb=128, disable=("cgroup",))
    need(box, "syscall_filter")
    default = int(Path("/proc/sys/net/core/wmem_default").read_text())
    result = box.run(code("""
        import fcntl, os, socket
        refused, held = [], []
        a, b = socket.socketpair()
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF, 32, 33):  # 32, 33: SO_SNDBUFFORCE, SO_RCVBUFFORCE
            try:
                a.setsockopt(socket.SOL_SOCKET, option, 1 << 30)
            except OSError:
                refused.append(option)
        r, w = os.pipe()
        try:
            fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
        except OSError:
            refused.append("F_SETPIPE_SZ")
        pinned, pairs, chunk = 0, 0, b"x" * 65536
        for _ in range(16):
            pair = socket.socketpair()
            pairs += 1
            for end in pair:
                try:
                    end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
                except OSError:
                    pass
                end.setblocking(False)
                try:
                    while True:
                        pinned += end.send(chunk)
                except OSError:
                    pass
            held.append(pair)
        print(len(refused), pairs, pinned)
    """))
    refused, pairs, pinned = (int(x) for x in result.stdout.split())
    assert refused == 5, result
    # each end's buffer holds up to its limit plus the one message that crossed it (1.1x here)
    assert pinned <= 2 * pairs * 2 * default, (pinned >> 20, "MiB pinned", result)


# --- metadata of the user's files ----------------------------------------------------------------

def _metadata_attacks(target: str, folder: str) -> str:
    """A program trying every way to change a file's (and its folder's) mode, owner, times and
    extended attributes: by path, *at with a directory descriptor, on a descriptor (f*), the
    newer syscalls by number (fchmodat2, setxattrat, file_setattr), and chattr's ioctl."""
    return code(f"""
        import ctypes, os, struct
        libc = ctypes.CDLL(None, use_errno=True)
        t, d = {target!r}, {folder!r}
        def raw(number, *args):
            if libc.syscall(number, *args) != 0:
                raise OSError(ctypes.get_errno(), "refused")
        def on_fd(action):
            fd = os.open(t, os.O_RDONLY)
            try:
                action(fd)
            finally:
                os.close(fd)
        def setflags(fd):
            flags = ctypes.c_long(0)
            libc.ioctl(fd, 0x80086601, ctypes.byref(flags))  # FS_IOC_GETFLAGS
            flags.value |= 0x40  # FS_NODUMP_FL
            if libc.ioctl(fd, 0x40086602, ctypes.byref(flags)) != 0:  # FS_IOC_SETFLAGS
                raise OSError(ctypes.get_errno(), "refused")
        value = ctypes.create_string_buffer(b"x")
        dir_fd = os.open(d, os.O_PATH | os.O_DIRECTORY)
        attacks = {{
            "chmod": lambda: os.chmod(t, 0o777),
            "chmod_folder": lambda: os.chmod(d, 0o700),
            "chmodat": lambda: os.chmod(os.path.basename(t), 0o777, dir_fd=dir_fd),
            "lchmod": lambda: os.chmod(t, 0o777, follow_symlinks=False),
            "fchmodat2": lambda: raw(452, -100, t.encode(), 0o777, 0),
            "chown": lambda: os.chown(t, 65534, 65534),
            "lchown": lambda: os.lchown(t, 65534, 65534),
            "utime": lambda: os.utime(t, (0, 0)),
            "utimeat": lambda: os.utime(os.path.basename(t), (0, 0), dir_fd=dir_fd),
            "setxattr": lambda: os.setxattr(t, "user.comlrl", b"x"),
            "lsetxattr": lambda: os.setxattr(t, "user.comlrl2", b"x", follow_symlinks=False),
            "removexattr": lambda: os.removexattr(t, "user.keep"),
            "setxattrat": lambda: raw(463, -100, t.encode(), 0, b"user.comlrl3",
                                      struct.pack("QII", ctypes.addressof(value), 1, 0), 16),
            "file_setattr": lambda: raw(469, -100, t.encode(), struct.pack("QIIII", 0x80, 0, 0, 0, 0), 24, 0),
            "fchmod": lambda: on_fd(lambda fd: os.chmod(fd, 0o777)),
            "fchown": lambda: on_fd(lambda fd: os.chown(fd, 65534, 65534)),
            "futimens": lambda: on_fd(lambda fd: os.utime(fd, (0, 0))),
            "fsetxattr": lambda: on_fd(lambda fd: os.setxattr(fd, "user.comlrl4", b"x")),
            "chattr": lambda: on_fd(setflags),
        }}
        for name, attack in attacks.items():
            try:
                attack()
                print("changed", name)
            except OSError as exc:
                print("refused", name, exc.errno)
    """)


def _snapshot(path: Path) -> tuple:
    info = os.stat(path)
    flags = None
    try:
        import fcntl
        import struct
        fd = os.open(path, os.O_RDONLY)
        try:
            flags = struct.unpack("l", fcntl.ioctl(fd, 0x80086601, b"\0" * 8))[0]  # FS_IOC_GETFLAGS
        finally:
            os.close(fd)
    except OSError:
        pass
    return (oct(info.st_mode), info.st_uid, info.st_gid, info.st_mtime_ns, sorted(os.listxattr(path)), flags)


@pytest.fixture
def victim(tmp_path):
    """A file of the user's the program could reach by permissions (its folder in sys.path as a
    package folder, so that Landlock lets the program read it: the f* variants need a descriptor)."""
    folder = tmp_path / "site-packages"
    folder.mkdir()
    target = planted(folder, "victim.py", "X = 1\n", 0o644)
    os.chmod(tmp_path, 0o755)
    try:
        os.setxattr(target, "user.keep", b"1")
    except OSError:
        pass
    return folder, target


@pytest.mark.parametrize("mode", list(MODES))
def test_no_metadata_changes_outside_the_working_directory(request, victim, monkeypatch, mode):
    """Item 3: without user namespaces `filesystem` came from Landlock alone, which does not cover
    chmod/chown/utime/xattrs: a program set the user's checkpoint folder to mode 000 and
    ~/.ssh/id_rsa to 0777, reset an mtime and added an xattr. The seccomp filter now refuses those
    families (f*, *at and the newer calls too), and chattr's ioctl."""
    folder, target = victim
    monkeypatch.setattr(sys, "path", [*sys.path, str(folder)])  # before the worker starts: a read path
    box = make_sandbox(request, workers=1, timeout_s=10, disable=MODES[mode])
    need(box, "filesystem")
    before = (_snapshot(target), _snapshot(folder))
    result = box.run(_metadata_attacks(str(target), str(folder)))
    assert "changed" not in result.stdout, result.stdout
    assert result.stdout.count("refused") == 19, result
    assert (_snapshot(target), _snapshot(folder)) == before


def test_metadata_calls_are_refused_in_the_working_directory_too(box):
    """The same program scores the same on every machine: the calls are refused in every mode,
    not only where a read-only mount would refuse them."""
    need(box, "syscall_filter")
    result = box.run(code("""
        import os
        open("mine", "w").close()
        for name, call in (("chmod", lambda: os.chmod("mine", 0o600)), ("utime", lambda: os.utime("mine", (0, 0)))):
            try:
                call()
                print(name, "done")
            except PermissionError:
                print(name, "refused")
    """))
    assert result.stdout == "chmod refused\nutime refused\n", result


# --- the Python installation --------------------------------------------------------------------------

@pytest.fixture
def closed_python(tmp_path, monkeypatch):
    """A package folder beneath a folder other users cannot enter, on the path before the worker
    starts: as root the sandbox stages it (bind mounts under its base folder) to show it to the
    program's user, as it does with a Python installed under /root."""
    closed = Path(tempfile.mkdtemp(prefix="closed-", dir="/tmp"))
    folder = closed / "site-packages"
    folder.mkdir()
    target = planted(folder, f"installed_{os.getpid()}_{closed.name[7:]}.py", "X = 1\n", 0o644)
    os.chmod(closed, 0o700)
    monkeypatch.setattr(sys, "path", [*sys.path, str(folder)])
    yield folder, target
    shutil.rmtree(closed, ignore_errors=True)


@pytest.mark.skipif(not as_root(), reason="staging exists only as root")
@pytest.mark.parametrize("off", [("uid_drop",), ("uid_drop", "landlock")], ids=["landlock", "no_landlock"])
def test_staged_python_installation_is_read_only(request, closed_python, off):
    """Item 4: as root with disable=("uid_drop",), the staging bind mounts of the Python
    installation under the sandbox's base folder stayed writable: a program changed mode, times
    and xattrs of the real installation's files and, with Landlock off too, appended to them and
    created new ones (code injection into the trainer's Python), while require=("filesystem",)
    passed."""
    folder, target = closed_python
    box = make_sandbox(request, workers=1, timeout_s=10, disable=off, require=("filesystem",))
    if not box.isolation_details()["mount_namespace"].startswith("on"):
        pytest.skip(f"no mount namespace here: {box.isolation_details()}")
    before = (_snapshot(target), sorted(os.listdir(folder)), target.read_text())
    result = box.run(code(f"""
        import os
        base = os.getcwd()
        while base != "/" and not os.path.basename(base).startswith("comlrl-sandbox-"):
            base = os.path.dirname(base)
        seen = []
        for root in (base, {str(folder)!r}):
            for where, dirs, files in os.walk(root):
                if {target.name!r} in files:
                    seen.append(where)
        for where in seen:
            path = os.path.join(where, {target.name!r})
            for name, attack in (("chmod", lambda: os.chmod(path, 0o777)), ("utime", lambda: os.utime(path, (0, 0))),
                                 ("xattr", lambda: os.setxattr(path, "user.comlrl", b"x")),
                                 ("append", lambda: open(path, "a").write("# injected\\n")),
                                 ("create", lambda: open(os.path.join(where, "new.py"), "w").write("x"))):
                try:
                    attack()
                    print("changed", name, where)
                except OSError:
                    pass
        print("found", len(seen))
    """))
    assert "changed" not in result.stdout, result.stdout
    assert "found" in result.stdout, result
    assert (_snapshot(target), sorted(os.listdir(folder)), target.read_text()) == before


# --- the kernel -------------------------------------------------------------------------------------

def test_the_kernel_log_is_refused(box):
    """Should-fix of issue 27: syslog(2) was refused only because of kernel.dmesg_restrict (root
    keeping uid 0 read the kernel log)."""
    need(box, "syscall_filter")
    result = box.run(code("""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        buffer = ctypes.create_string_buffer(4096)
        print(libc.klogctl(10, None, 0), libc.klogctl(3, buffer, 4096), ctypes.get_errno())
    """))
    assert result.stdout.split() == ["-1", "-1", str(errno.EPERM)], result
