"""Client side of the control file (see ``protocol``): used by status, warmup, sync, umount.

Imports only the protocol (stdlib and ``cachefs.errors``), never the daemon stack.
"""

import errno
import fcntl
import json
import os
import struct
from collections.abc import Iterator
from typing import Any

from cachefs.control import protocol
from cachefs.errors import NoDaemon, Unsupported


def request(mountpoint: str, command: str, **args: Any) -> Iterator[dict]:
    """Send one command to the daemon serving ``mountpoint``; yield its events (the last one is
    the result). An error in the daemon is raised here as a CachefsError carrying its exit code."""
    fd, channel = _open(mountpoint)
    try:
        channel.send(fd, protocol.encode_request(command, args), mountpoint)
        for reply in _replies(fd, mountpoint, channel):
            kind = reply.get("kind") if isinstance(reply, dict) else None
            if kind == "event":
                yield reply.get("data", {})
            elif kind == "end":
                return
            elif kind == "error":
                raise protocol.error_of(reply)
            else:
                raise Unsupported(f"the cachefs daemon of {mountpoint} speaks an older control protocol "
                                  f"(remount it with this cachefs version)")
        raise NoDaemon(f"the cachefs daemon of {mountpoint} stopped answering in the middle of {command!r}")
    finally:
        os.close(fd)


def hello(mountpoint: str) -> dict:
    """The handshake: the daemon's protocol, version, commands, which of them are restricted to
    the mount's owner, and whether this caller may run them."""
    return next(request(mountpoint, protocol.HELLO))


class _Files:
    """The request written to, the replies read from, the control file (a read-write mount)."""

    @staticmethod
    def send(fd: int, data: bytes, mountpoint: str) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view):]
        except OSError as exc:
            raise NoDaemon(_why(mountpoint, exc)) from None

    @staticmethod
    def receive(fd: int) -> bytes:
        return os.read(fd, 1 << 16)


class _Ioctls:
    """The same bytes by ioctl on a read-only descriptor (a read-only mount)."""

    @staticmethod
    def send(fd: int, data: bytes, mountpoint: str) -> None:
        step = protocol.IOCTL_PIECE - 4
        try:
            for start in range(0, max(len(data), 1), step):
                piece = data[start:start + step]
                fcntl.ioctl(fd, protocol.IOCTL_SEND, bytearray(struct.pack("<I", len(piece)) + piece.ljust(step, b"\0")))
        except OSError as exc:
            raise NoDaemon(_why(mountpoint, exc)) from None

    @staticmethod
    def receive(fd: int) -> bytes:
        buf = bytearray(protocol.IOCTL_PIECE)
        fcntl.ioctl(fd, protocol.IOCTL_RECEIVE, buf)
        (length,) = struct.unpack_from("<I", buf)
        return bytes(buf[4:4 + min(length, protocol.IOCTL_PIECE - 4)])


def _open(mountpoint: str):
    """The control file, open for writing where the mount allows it, else read-only with the
    ioctl channel."""
    path = os.path.join(mountpoint, protocol.CONTROL_NAME)
    try:
        return os.open(path, os.O_RDWR), _Files
    except FileNotFoundError:
        raise NoDaemon(f"{mountpoint} is not a cachefs mount") from None
    except OSError as exc:
        if exc.errno != errno.EROFS:
            raise NoDaemon(_why(mountpoint, exc)) from None
    try:
        return os.open(path, os.O_RDONLY), _Ioctls
    except OSError as exc:
        raise NoDaemon(_why(mountpoint, exc)) from None


def _replies(fd: int, mountpoint: str, channel) -> Iterator[Any]:
    pending = b""
    while True:
        try:
            chunk = channel.receive(fd)
        except OSError as exc:
            raise NoDaemon(_why(mountpoint, exc)) from None
        if not chunk:
            return
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            try:
                yield json.loads(line)
            except ValueError:
                raise Unsupported(f"the cachefs daemon of {mountpoint} sent a malformed reply: "
                                  f"{line[:80]!r}") from None


def _why(mountpoint: str, exc: OSError) -> str:
    if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED):
        return f"the cachefs daemon of {mountpoint} is gone (stale mount: run `cachefs umount {mountpoint}`)"
    return f"cannot reach the cachefs daemon of {mountpoint}: {exc.strerror}"
