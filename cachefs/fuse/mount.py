"""Mounting a FUSE filesystem with our own ``/dev/fuse`` descriptor, and taking it down.

As root: open ``/dev/fuse`` and call ``mount(2)`` with ``fd=N`` (what libfuse does). As another
user: ``fusermount3`` mounts and hands the descriptor back over a socket (``_FUSE_COMMFD``,
SCM_RIGHTS), as libfuse does. ``abort`` ends a connection through its ``/sys/fs/fuse/connections``
entry, so no reader waits on a server that is gone.
"""

import array
import ctypes
import errno
import logging
import os
import socket
import stat
import subprocess
from dataclasses import dataclass

from cachefs.errors import FuseUnavailable, MountpointError

log = logging.getLogger(__name__)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOATIME = 1, 2, 4, 1024
MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True, slots=True)
class MountOptions:
    fsname: str = "cachefs"
    subtype: str = "cachefs"
    allow_other: bool = False
    read_only: bool = False
    default_permissions: bool = True
    noatime: bool = True


def mount(mountpoint: str, options: MountOptions) -> int:
    """Mount a FUSE filesystem at ``mountpoint``; return the session's ``/dev/fuse`` descriptor."""
    if os.geteuid() == 0:
        return _mount_as_root(mountpoint, options)
    return _mount_with_fusermount(mountpoint, options)


def _mount_as_root(mountpoint: str, options: MountOptions) -> int:
    try:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise FuseUnavailable(f"cannot open /dev/fuse: {exc.strerror}") from None
    try:
        mode = os.stat(mountpoint).st_mode
        data = [f"fd={fd}", f"rootmode={stat.S_IFMT(mode):o}", f"user_id={os.getuid()}", f"group_id={os.getgid()}"]
        if options.allow_other:
            data.append("allow_other")
        if options.default_permissions:
            data.append("default_permissions")
        flags = MS_NOSUID | MS_NODEV | (MS_NOATIME if options.noatime else 0) | (MS_RDONLY if options.read_only else 0)
        fstype = f"fuse.{options.subtype}" if options.subtype else "fuse"
        if _libc.mount(options.fsname.encode(), os.fsencode(mountpoint), fstype.encode(), flags,
                       ",".join(data).encode()) != 0:
            code = ctypes.get_errno()
            raise MountpointError(f"cannot mount at {mountpoint}: {os.strerror(code)}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _mount_with_fusermount(mountpoint: str, options: MountOptions) -> int:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    opts = [f"fsname={options.fsname}", f"subtype={options.subtype}", "nosuid", "nodev"]
    opts += [name for name, on in (("allow_other", options.allow_other), ("ro", options.read_only),
                                   ("default_permissions", options.default_permissions),
                                   ("noatime", options.noatime)) if on]
    try:
        result = subprocess.run(["fusermount3", "-o", ",".join(opts), "--", mountpoint], pass_fds=(theirs.fileno(),),
                                env={**os.environ, "_FUSE_COMMFD": str(theirs.fileno())}, capture_output=True,
                                text=True)
        theirs.close()
        if result.returncode != 0:
            reason = (result.stderr.strip().splitlines() or ["failed"])[-1]
            raise MountpointError(f"cannot mount at {mountpoint}: {reason}")
        fds = array.array("i")
        _, ancillary, _, _ = ours.recvmsg(1, socket.CMSG_LEN(fds.itemsize))
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:fds.itemsize])
        if not fds:
            raise MountpointError(f"cannot mount at {mountpoint}: fusermount3 sent no descriptor")
        os.set_inheritable(fds[0], False)
        return fds[0]
    except FileNotFoundError:
        raise FuseUnavailable("fusermount3 is missing: install the fuse3 package") from None
    finally:
        ours.close()


def unmount(mountpoint: str, *, lazy: bool = False) -> None:
    """Unmount ``mountpoint`` (root: umount2; otherwise fusermount3 -u)."""
    if os.geteuid() == 0:
        if _libc.umount2(os.fsencode(mountpoint), MNT_DETACH if lazy else 0) != 0:
            code = ctypes.get_errno()
            if code not in (errno.EINVAL, errno.ENOENT):     # not mounted (any more)
                raise MountpointError(f"cannot unmount {mountpoint}: {os.strerror(code)}")
        return
    result = subprocess.run(["fusermount3", "-u", *(["-z"] if lazy else []), mountpoint], capture_output=True,
                            text=True)
    if result.returncode != 0 and "not mounted" not in result.stderr and "not found" not in result.stderr:
        raise MountpointError(f"cannot unmount {mountpoint}: {result.stderr.strip()}")


def connection_dir(devno: str) -> str:
    """The ``/sys/fs/fuse/connections`` entry of the mount with device ``major:minor``."""
    return f"/sys/fs/fuse/connections/{devno.split(':')[1]}"


def abort(devno: str) -> bool:
    """Abort the connection: every request waiting on it fails at once (ENOTCONN)."""
    try:
        with open(os.path.join(connection_dir(devno), "abort"), "w") as fh:
            fh.write("1")
        return True
    except OSError as exc:
        log.debug("cannot abort FUSE connection %s: %s", devno, exc)
        return False

