"""What a FUSE handler takes and returns, whatever speaks the wire (our session or pyfuse3).

``fuse_ops.Operations`` returns these; ``session`` encodes them into the kernel's structs and
``pyfuse3_backend`` turns them into pyfuse3's objects.
"""

from dataclasses import dataclass


class FuseError(Exception):
    """A handler's answer that is an errno (never logged as a failure of the layer)."""

    def __init__(self, errno_: int) -> None:
        super().__init__(errno_)
        self.errno = errno_


@dataclass(slots=True)
class Attr:
    """An inode's attributes and how long the kernel may keep them (and the entry naming it).
    ``ino`` 0 in a LOOKUP answer is a negative entry the kernel caches for ``entry_timeout``."""

    ino: int = 0
    mode: int = 0
    nlink: int = 1
    size: int = 0
    blocks: int = 0
    blksize: int = 128 * 1024
    uid: int = 0
    gid: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    entry_timeout: float = 0.0
    attr_timeout: float = 0.0
    generation: int = 0


@dataclass(slots=True)
class FileInfo:
    """An OPEN or CREATE answer. ``backing_id`` > 0: the kernel reads the file from that backing
    file itself (FUSE passthrough), with no READ request."""

    fh: int
    keep_cache: bool = False
    direct_io: bool = False
    nonseekable: bool = False
    noflush: bool = False
    backing_id: int = 0


@dataclass(slots=True)
class StatFs:
    blocks: int = 0
    bfree: int = 0
    bavail: int = 0
    files: int = 0
    ffree: int = 0
    bsize: int = 4096
    frsize: int = 4096
    namelen: int = 255


@dataclass(slots=True, frozen=True)
class Context:
    """Who sent a request."""

    uid: int
    gid: int
    pid: int
    umask: int = 0o022
    resent: bool = False      # the kernel sent it again to a new daemon: it may have been applied


@dataclass(slots=True, frozen=True)
class SetattrFields:
    """Which attributes a SETATTR changes."""

    update_size: bool = False
    update_mtime: bool = False
    update_mode: bool = False
    update_uid: bool = False
    update_gid: bool = False
    update_atime: bool = False


class DirReply:
    """Collects a READDIR(PLUS) answer: ``add`` returns False once the kernel's buffer is full
    (the entry was not added; the kernel asks again from its offset). ``plus``: the kernel keeps
    each entry added, with its attributes (READDIRPLUS), which counts as a lookup of it; a plain
    READDIR gives names only, and the kernel takes no reference."""

    plus = True

    def add(self, name: bytes, attr: Attr, next_offset: int) -> bool:   # pragma: no cover - an interface
        raise NotImplementedError
