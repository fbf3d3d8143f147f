"""Client side of the control file (see ``protocol``): used by status, warmup, sync, umount.

Imports only the protocol (stdlib and ``cachefs.errors``), never the daemon stack.
"""

import errno
import json
import os
from collections.abc import Iterator
from typing import Any

from cachefs.control import protocol
from cachefs.errors import NoDaemon, Unsupported


def request(mountpoint: str, command: str, **args: Any) -> Iterator[dict]:
    """Send one command to the daemon serving ``mountpoint``; yield its events (the last one is
    the result). An error in the daemon is raised here as a CachefsError carrying its exit code."""
    fd = _open(mountpoint)
    try:
        _write_all(fd, protocol.encode_request(command, args), mountpoint)
        for reply in _replies(fd, mountpoint):
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


def _open(mountpoint: str) -> int:
    path = os.path.join(mountpoint, protocol.CONTROL_NAME)
    try:
        return os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise NoDaemon(f"{mountpoint} is not a cachefs mount") from None
    except OSError as exc:
        raise NoDaemon(_why(mountpoint, exc)) from None


def _write_all(fd: int, data: bytes, mountpoint: str) -> None:
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:
        raise NoDaemon(_why(mountpoint, exc)) from None


def _replies(fd: int, mountpoint: str) -> Iterator[Any]:
    pending = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
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
