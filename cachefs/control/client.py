"""Client side of the control file (see ``control``): used by status, warmup, sync."""

import errno
import json
import os
from collections.abc import Iterator

from cachefs.control.protocol import CONTROL_NAME
from cachefs.errors import NoDaemon


def request(mountpoint: str, command: str, **args) -> Iterator[dict]:
    """Send one command to the daemon serving ``mountpoint``; yield its replies."""
    path = os.path.join(mountpoint, CONTROL_NAME)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise NoDaemon(f"{mountpoint} is not a cachefs mount") from None
    except OSError as exc:
        raise NoDaemon(_why(mountpoint, exc)) from None
    try:
        os.write(fd, json.dumps({"command": command, **args}).encode())
        pending = b""
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError as exc:
                raise NoDaemon(_why(mountpoint, exc)) from None
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield json.loads(line)
    finally:
        os.close(fd)


def _why(mountpoint: str, exc: OSError) -> str:
    if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED):
        return f"the cachefs daemon of {mountpoint} is gone (stale mount: run `cachefs umount {mountpoint}`)"
    return f"cannot reach the cachefs daemon of {mountpoint}: {exc.strerror}"
