"""This host: FUSE availability, mountpoints and mountinfo, kernel tuning, the cache-dir lock, malloc.

Everything here asks or tunes the machine the daemon runs on; nothing holds cache state.
``find_mount`` is the one mountinfo parser (the CLI, warmup and the CSI driver use it):
``os.path.ismount`` misses bind mounts of one filesystem, and stat-ing a dead FUSE mount
hangs or fails with ENOTCONN, so mounts are found by reading ``/proc/self/mountinfo``.

Memory (docs/design.md, invariant 3): blocks are 4 MiB bytes objects allocated in worker threads and
freed in the trio thread. With glibc's defaults the mmap threshold grows to the largest freed
chunk (so 4 MiB blocks land in heap arenas and fragment them) and every thread may get its own
arena: freed blocks stay in RSS, spread over many arenas. Two arenas cap the spread; a fixed
16 MiB mmap threshold (above any block) stops the threshold from drifting and keeps block-sized
buffers in reused heap memory instead of a fresh mmap (zero-filled page faults) per read.
"""

import contextlib
import ctypes
import ctypes.util
import fcntl
import logging
import os
import re
import shutil
import stat
from dataclasses import dataclass

from cachefs.errors import CacheDirError, FuseUnavailable, MountpointError

log = logging.getLogger(__name__)


def check_fuse() -> None:
    if not os.path.exists("/dev/fuse"):
        raise FuseUnavailable("/dev/fuse is missing: load the fuse module or pass the device to the container")
    if os.getuid() != 0:          # fusermount3 (setuid root) opens the device and mounts for us
        if shutil.which("fusermount3") is None:
            raise FuseUnavailable("fusermount3 is missing: install the fuse3 package")
        return
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        raise FuseUnavailable("/dev/fuse is not readable and writable by this user")


def check_mountpoint(path: str) -> None:
    if not os.path.exists(path):
        raise MountpointError(f"mountpoint {path} does not exist")
    if not os.path.isdir(path):
        raise MountpointError(f"mountpoint {path} is not a directory")
    if os.path.ismount(path) or find_mount(path) is not None:
        raise MountpointError(f"mountpoint {path} is busy: something is already mounted there")


@dataclass(frozen=True, slots=True)
class MountEntry:
    """One line of ``/proc/self/mountinfo``."""

    mount_id: int
    parent_id: int
    devno: str          # major:minor
    root: str           # the mounted subtree of the source filesystem ("/" unless a bind mount)
    mountpoint: str
    fstype: str         # "fuse.cachefs" for our daemons
    source: str


def mounts(pid: int | str = "self") -> list[MountEntry]:
    """Every mount process ``pid`` can see (this one by default), in mount order; [] if its
    mountinfo cannot be read."""
    try:
        with open(f"/proc/{pid}/mountinfo") as fh:
            lines = fh.readlines()
    except OSError:
        return []
    return [entry for line in lines if (entry := _parse_mountinfo(line)) is not None]


def _parse_mountinfo(line: str) -> MountEntry | None:
    fields = line.split()
    try:
        sep = fields.index("-")
        return MountEntry(int(fields[0]), int(fields[1]), fields[2], _unescape(fields[3]), _unescape(fields[4]), fields[sep + 1],
                          _unescape(fields[sep + 2]) if len(fields) > sep + 2 else "")
    except (ValueError, IndexError):
        return None


def find_mount(path: str) -> tuple[str, str] | None:
    """(major:minor, fstype) of the mount at ``path``, read without touching the mount itself."""
    found = top_mount(mounts(), path)
    return None if found is None else (found.devno, found.fstype)


def top_mount(table: list[MountEntry], path: str) -> MountEntry | None:
    """The visible mount at ``path`` in one mount table: with mounts stacked on one path, the one
    no other mount at that path sits on."""
    here = [entry for entry in table if entry.mountpoint == path]
    covered = {entry.parent_id for entry in here}
    visible = [entry for entry in here if entry.mount_id not in covered]
    return visible[-1] if visible else None


def cachefs_mounts() -> list[str]:
    """Mountpoints of cachefs filesystems on this node."""
    return [entry.mountpoint for entry in mounts() if entry.fstype == "fuse.cachefs"]


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field) if "\\" in field else field


MIN_CACHE_FS_FREE = 1 << 20


def check_cache_fs(cache_dir: str, cache_size: int, staging_dir: str, disk_dir: str) -> str | None:
    """Refuse a cache dir whose filesystem is full (under 1 MiB available to a normal user: the
    root reserve is not for caches) unless it holds what cachefs itself can free: staged writes in
    ``staging_dir`` (the daemon uploads them, and must, or acknowledged writes would be stranded)
    or the disk tier's blocks under ``disk_dir`` (it evicts them); then start with a warning. Also warn
    when ``cache_size`` exceeds the whole filesystem (the disk tier then stops at the free-space
    floor instead)."""
    path = cache_dir
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path)
    except OSError as exc:
        raise CacheDirError(f"cache dir {cache_dir}: {exc.strerror}") from None
    available, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if available < MIN_CACHE_FS_FREE:
        held = [what for what, where in (("staged writes to upload", staging_dir),
                                         # the block files (``tiers/disk/index.Layout``: ``blocks/`` under it)
                                         ("cached blocks to evict", os.path.join(disk_dir, "blocks")))
                if _holds_a_file(where)]
        if not held:
            raise CacheDirError(f"cache dir {cache_dir}: its filesystem is full ({available} bytes available of "
                                f"{total}); free some space or choose another --cache-dir")
        return (f"cache dir {cache_dir}: its filesystem is full ({available} bytes available of {total}); "
                f"starting anyway, it holds {' and '.join(held)}: writes may get ENOSPC until that frees room")
    if cache_size > total:
        return (f"--cache-size {_gib(cache_size)} is more than the cache filesystem holds ({_gib(total)} in all, "
                f"{_gib(available)} free): the disk tier stops at the --free-space-ratio floor instead")
    return None


def _holds_a_file(directory: str) -> bool:
    """Whether ``directory`` or one under it holds a non-empty regular file; stops at the first."""
    for parent, _dirs, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(parent, name))
                if st.st_size and stat.S_ISREG(st.st_mode):
                    return True
    return False


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


class CacheDirLock:
    """One daemon per cache dir: an exclusive flock held for the daemon's life."""

    def __init__(self, cache_dir: str) -> None:
        try:
            os.makedirs(cache_dir, exist_ok=True)
            self._fd = os.open(os.path.join(cache_dir, "cachefs.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise CacheDirError(f"cache dir {cache_dir}: {exc.strerror}") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            raise CacheDirError(f"cache dir {cache_dir} is in use by another cachefs daemon (pid {holder})") from None
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:          # ENOSPC on a full cache disk, EIO on a failing one
            os.close(self._fd)
            raise CacheDirError(f"cache dir {cache_dir}: {exc.strerror}") from None

    def close(self) -> None:
        os.close(self._fd)


def tune_kernel(mountpoint: str, read_ahead_kb: int, max_background: int) -> None:
    """Raise the FUSE bdi readahead and the connection's max_background (docs/design.md, measured facts)."""
    entry = find_mount(mountpoint)
    if entry is None:
        log.info("cannot find %s in mountinfo; kernel tuning skipped", mountpoint)
        return
    major, minor = (int(x) for x in entry[0].split(":"))
    conn = os.makedev(major, minor)
    if not os.path.isdir("/sys/fs/fuse/connections") or not os.listdir("/sys/fs/fuse/connections"):
        with contextlib.suppress(OSError):
            os.system("mount -t fusectl none /sys/fs/fuse/connections 2>/dev/null")
    writes = {f"/sys/class/bdi/{major}:{minor}/read_ahead_kb": read_ahead_kb,
              f"/sys/fs/fuse/connections/{conn}/max_background": max_background,
              f"/sys/fs/fuse/connections/{conn}/congestion_threshold": max(1, max_background * 3 // 4)}
    for path, value in writes.items():
        try:
            with open(path, "w") as fh:
                fh.write(str(value))
        except OSError as exc:
            log.info("kernel tuning: cannot write %s (%s)", path, exc.strerror)


def vm_hwm(pid: int | str = "self") -> int | None:
    """Peak resident set (VmHWM) of process ``pid``, in bytes: the high-water mark of its own
    memory since it exec'd; None where ``/proc`` does not say (no such process, not Linux)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def tune_malloc(mmap_threshold: int = 16 << 20, arenas: int = 2, trim_threshold: int = 64 << 20) -> bool:
    """Apply the settings through mallopt(3); False where the C library is not glibc.

    ``trim_threshold``: free memory kept at the top of the heap instead of given back to the
    kernel. Setting the mmap threshold fixes the trim threshold at glibc's 128 KiB, and a
    sequential reader's blocks are freed as fast as new ones arrive: each new 4 MiB block was
    then memory the kernel had to fault in and clear page by page (55-75 faults per MiB read
    in a cold 1 GiB read, against 15 with 64 MiB kept)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
        ok = libc.mallopt(_M_ARENA_MAX, arenas) == 1 and ok
        ok = libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1 and ok
    except (OSError, AttributeError):
        return False
    if not ok:
        log.info("mallopt refused the memory settings; RSS may exceed the memory budget")
    return ok
