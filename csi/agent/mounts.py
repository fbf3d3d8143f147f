"""Mount checks, views of a volume's mount, and the search for stale views on this node.

Mounts are found in ``/proc/self/mountinfo`` (``cachefs.host``), never with ``os.path.ismount``
(same-filesystem bind mounts fool it), and a mount whose daemon is gone answers ENOTCONN: such a
mount is dead. ``stat`` of a live FUSE mount is answered by its daemon, so the liveness probe runs
with a timeout in a helper thread instead of hanging the caller on a wedged daemon.

A *view* is a bind of the daemon's own mount at the staging path or a published target. Views are
placed with the new mount API (``open_tree`` clone, ``mount_setattr``, ``move_mount``): the clone
is made private and, for a read-only target, read-only *before* it is attached, so that

- each view is its own peer group once attached under kubelet's shared tree (a repair of one view
  never spreads to another, and a read-only target never receives a writable copy);
- a view placed on top of a dead one propagates, with its flags, into every container that holds a
  slave copy of that path (``mountPropagation: HostToContainer``).

Kernels without that API (before 5.12, or a seccomp filter that refuses it) fall back to
``mount --bind``, ``--make-private``, ``--make-shared`` then ``remount,bind,ro``: the same peer
groups, but a read-only flag set after the view is attached stays on the host's view, and a
container's copy of a repaired read-only target is writable.
"""

import ctypes
import errno
import os
import struct
import subprocess
import threading

from cachefs.host import MountEntry, mounts, top_mount
from csi.errors import internal

FSTYPE = "fuse.cachefs"

# Syscall numbers of the new mount API: one table for every architecture (asm-generic, >= 424).
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_OPEN_TREE_CLONE, _O_CLOEXEC = 1, 0o2000000
_AT_FDCWD, _AT_EMPTY_PATH = -100, 0x1000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_RDONLY = 0x1
_MS_PRIVATE = 1 << 18
_libc = ctypes.CDLL(None, use_errno=True)
_new_api = True             # cleared at the first ENOSYS/EPERM


def entry(path: str) -> MountEntry | None:
    """The visible mount at ``path`` (the top of a stack of mounts there), or None."""
    return top_mount(mounts(), path)


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


def place_view(source: str, target: str, readonly: bool) -> None:
    """Put a view of the mount at ``source`` on ``target``, on top of whatever is mounted there
    (a dead view is never detached first: the path is never an empty directory, and the new view
    reaches containers' slave copies of the old one)."""
    global _new_api
    try:
        os.makedirs(target, exist_ok=True)
    except FileExistsError:
        pass                # a dead mount is there: every stat of it fails
    if _new_api:
        try:
            _clone_onto(source, target, readonly)
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EPERM):
                raise internal(f"cannot mount a view of {source} on {target}: {exc.strerror}") from None
            _new_api = False
    _run(["mount", "--bind", source, target])
    _run(["mount", "--make-private", target])       # leave the source's peer group...
    _run(["mount", "--make-shared", target])        # ...for one of its own, which containers can follow
    if readonly:
        try:
            _run(["mount", "-o", "remount,bind,ro", target])
        except Exception:
            _run(["umount", "-l", target])
            raise


def _clone_onto(source: str, target: str, readonly: bool) -> None:
    fd = _check(_libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(source), _OPEN_TREE_CLONE | _O_CLOEXEC))
    try:
        # struct mount_attr {u64 attr_set, attr_clr, propagation, userns_fd}
        attr = ctypes.create_string_buffer(struct.pack("QQQQ", _MOUNT_ATTR_RDONLY if readonly else 0, 0,
                                                       _MS_PRIVATE, 0), 32)
        _check(_libc.syscall(_SYS_MOUNT_SETATTR, fd, b"", _AT_EMPTY_PATH, attr, 32))
        _check(_libc.syscall(_SYS_MOVE_MOUNT, fd, b"", _AT_FDCWD, os.fsencode(target), _MOVE_MOUNT_F_EMPTY_PATH))
    finally:
        os.close(fd)


def _check(result: int) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


def unmount(path: str, *, lazy: bool = False) -> None:
    """Unmount whatever is at ``path`` (every layer); a lazy unmount detaches busy and dead mounts."""
    while entry(path) is not None:
        _run(["umount", *(["-l"] if lazy else []), path])


def stale_views(devices: set[str], own_paths: set[str]) -> int:
    """How many mounts of the FUSE connections ``devices`` (dead ones) are still visible in other
    mount namespaces of this node, with nothing mounted on top: containers that mounted the volume
    without HostToContainer propagation and still read the dead mount. Copies at ``own_paths`` (the
    staging path, targets, home: where CSI components, not pods, see the volume) are not counted.
    Needs the host's PID namespace to see the containers (the agent runs with hostPID); 0 when
    nothing can be read."""
    if not devices:
        return 0
    own = _namespace("self")
    seen: set[str] = set()
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        namespace = _namespace(pid)
        if namespace is None or namespace == own or namespace in seen:
            continue
        seen.add(namespace)
        table = mounts(pid)
        count += sum(1 for item in table if item.devno in devices and item.mountpoint not in own_paths
                     and top_mount(table, item.mountpoint) is item)
    return count


def _namespace(pid: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["failed"])[-1]
        raise internal(f"{' '.join(command[:-1])} {command[-1]}: {reason}")
