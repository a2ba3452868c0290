"""Messages on pipes: length-prefixed JSON frames (worker <-> zygote, judge -> zygote) and JSON
lines (judge <-> program). Readers never block past a deadline and never buffer past a limit."""

from __future__ import annotations

import json
import os
import select
import struct
import time
from typing import Any, Optional

__all__ = ["write_all", "write_frame", "write_line", "read_frame", "read_exact", "LineReader", "FrameReader", "Closed",
           "Timeout"]

_HEADER = struct.Struct(">I")


class Closed(EOFError):
    """The other end closed the pipe (or sent something that is not a frame)."""


class Timeout(TimeoutError):
    """Nothing (complete) arrived before the deadline."""


def write_all(fd: int, data: bytes, deadline: Optional[float] = None) -> None:
    """Write all of ``data``; with a ``deadline`` (``fd`` non-blocking), raise :class:`Timeout`
    when the reader takes none of it in time (a reader that stopped reading never blocks us)."""
    view = memoryview(data)
    while view:
        if deadline is not None:
            _wait(fd, deadline, write=True)
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            continue


def write_frame(fd: int, message: Any, deadline: Optional[float] = None) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    write_all(fd, _HEADER.pack(len(body)) + body, deadline)


def read_exact(fd: int, size: int) -> bytes:
    """Exactly ``size`` bytes with unbuffered reads, so nothing past them leaves the pipe (a process
    forked next must not inherit bytes meant for a later one)."""
    parts, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise Closed("pipe closed")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def read_frame(fd: int, limit: int = 1 << 30) -> Any:
    """One frame, blocking (for the trusted worker <-> zygote channel)."""
    (size,) = _HEADER.unpack(read_exact(fd, _HEADER.size))
    if size > limit:
        raise Closed(f"frame of {size} bytes exceeds {limit}")
    return json.loads(read_exact(fd, size))


def _wait(fd: int, deadline: Optional[float], write: bool = False) -> None:
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise Timeout()
        try:
            ready = select.select([] if write else [fd], [fd] if write else [], [], left)
        except InterruptedError:
            continue
        if ready[0] or ready[1]:
            return


class FrameReader:
    """Length-prefixed frames from an untrusted-ish writer, with a deadline and a size limit."""

    def __init__(self, fd: int, limit: int):
        self.fd, self.limit, self.buffer = fd, limit, b""

    def read(self, deadline: Optional[float]) -> Any:
        while True:
            if len(self.buffer) >= _HEADER.size:
                (size,) = _HEADER.unpack_from(self.buffer)
                if size > self.limit:
                    raise Closed(f"frame of {size} bytes exceeds {self.limit}")
                if len(self.buffer) >= _HEADER.size + size:
                    body = self.buffer[_HEADER.size:_HEADER.size + size]
                    self.buffer = self.buffer[_HEADER.size + size:]
                    try:
                        return json.loads(body)
                    except (ValueError, RecursionError):
                        raise Closed("malformed frame") from None
            _wait(self.fd, deadline)
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                raise Closed("pipe closed")
            self.buffer += chunk


class LineReader:
    """JSON lines; lines that do not parse are skipped (a killed writer may leave half a line)."""

    def __init__(self, fd: int, limit: int):
        self.fd, self.limit, self.buffer = fd, limit, b""

    def drain(self) -> None:
        """Drop whatever is buffered or waiting in the pipe now."""
        self.buffer = b""
        while True:
            ready, _, _ = select.select([self.fd], [], [], 0)
            if not ready or not os.read(self.fd, 1 << 16):
                return

    def read(self, deadline: Optional[float]) -> Any:
        while True:
            end = self.buffer.find(b"\n")
            if end >= 0:
                line, self.buffer = self.buffer[:end], self.buffer[end + 1:]
                try:
                    return json.loads(line)
                except (ValueError, RecursionError):  # RecursionError: nested too deep, e.g. [[[[...]]]]
                    continue
            if len(self.buffer) > self.limit:
                self.buffer = b""
                raise Closed(f"a message longer than {self.limit} bytes")
            _wait(self.fd, deadline)
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                raise Closed("pipe closed")
            self.buffer += chunk


def write_line(fd: int, message: Any) -> None:
    write_all(fd, json.dumps(message, separators=(",", ":")).encode() + b"\n")
