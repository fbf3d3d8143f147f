"""Mount checks and bind mounts on this node.

Mounts are found in ``/proc/self/mountinfo`` (``cachefs.host``), never with ``os.path.ismount``
(same-filesystem bind mounts fool it), and a mount whose daemon is gone answers ENOTCONN: such a
mount is dead. ``stat`` of a live FUSE mount is answered by its daemon, so the liveness probe runs
with a timeout in a helper thread instead of hanging the caller on a wedged daemon.
"""

import errno
import os
import subprocess
import threading

from cachefs.host import mounts
from csi.errors import internal

FSTYPE = "fuse.cachefs"


def entry(path: str):
    """The last mountinfo entry at ``path`` (the visible one), or None."""
    found = None
    for item in mounts():
        if item.mountpoint == path:
            found = item
    return found


def state(path: str, timeout: float = 5.0) -> str:
    """'live' (a cachefs mount that answers), 'dead' (ENOTCONN, or no answer in time),
    'other' (something else is mounted there) or 'none'."""
    item = entry(path)
    if item is None:
        return "none"
    if item.fstype != FSTYPE:
        return "other"
    result: list[str] = []

    def probe() -> None:
        # opendir always reaches the daemon; a stat may be answered from the kernel's attribute
        # cache even when the daemon is gone
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_DIRECTORY))
            result.append("live")
        except OSError as exc:
            result.append("dead" if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO) else "live")

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else "dead"


def same_mount(target: str, staging: str) -> bool:
    """``target`` shows the FUSE connection mounted at ``staging`` (same device)."""
    a, b = entry(target), entry(staging)
    return a is not None and b is not None and a.fstype == FSTYPE and a.devno == b.devno


def bind(staging: str, target: str, readonly: bool) -> None:
    os.makedirs(target, exist_ok=True)
    _run(["mount", "--bind", staging, target])
    if readonly:
        try:
            _run(["mount", "-o", "remount,bind,ro", target])
        except Exception:
            unmount(target, lazy=True)
            raise


def unmount(path: str, *, lazy: bool = False) -> None:
    """Unmount whatever is at ``path`` (every layer); a lazy unmount detaches busy and dead mounts."""
    while entry(path) is not None:
        _run(["umount", *(["-l"] if lazy else []), path])


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["failed"])[-1]
        raise internal(f"{' '.join(command[:-1])} {command[-1]}: {reason}")
