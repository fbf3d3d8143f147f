"""O_DIRECT writes of block files: page-aligned buffers, reused (``DirectWrites``)."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from pathlib import Path

from cachefs.tiers.disk.format import HEADER_ALIGN, NoXattrs, finish, pwrite_padded, round_up

log = logging.getLogger("cachefs.tiers.disk.format")


class DirectWrites:
    """Block files written with O_DIRECT from page-aligned buffers that are reused, not through the
    page cache (``--cache-direct-io``, on by default).

    A buffered write copies every byte into page-cache pages: on the VMs we measure on, where a
    page the guest has not touched lately faults to the host, 2.4-2.6 CPU-seconds per GiB, half
    the daemon's CPU in a packed cold epoch; O_DIRECT from a reused buffer takes 0.2 s. It also
    keeps a dataset larger than RAM from pushing everything else out of the page cache as it is
    cached. Reads stay buffered.

    The data goes through one copy into a page-aligned buffer; the tail is padded to
    ``HEADER_ALIGN`` and the file truncated to its exact size. A file system that refuses O_DIRECT
    (EINVAL: tmpfs before Linux 6.6, some FUSE or network file systems) gets buffered writes from
    then on, logged once: ``refused`` holds its device numbers.

    Between writes the pool keeps at most ``keep`` buffers and ``keep_bytes`` bytes (but always
    one buffer): a buffer per writer with the default 4 MiB blocks, fewer with large blocks, so
    ``--block-size 64M`` does not hold 12 x 65 MiB for good."""

    def __init__(self, keep: int = 8, keep_bytes: int = 96 << 20) -> None:
        self.keep = keep
        self.keep_bytes = keep_bytes
        self.refused: set[int] = set()
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def write(self, tmp: Path, header: bytes, data: bytes, fsync: bool, xattr: bytes | None = None) -> bool:
        """Write ``header + data`` as the new file ``tmp``; False (and no file) when its file
        system refuses O_DIRECT: the caller then writes it buffered."""
        fd = self.open(tmp)
        if fd is None:
            return False
        total = len(header) + len(data)
        buf = self.take(round_up(total, HEADER_ALIGN))
        try:
            pwrite_padded(fd, buf, (header, data), 0)
            if total % HEADER_ALIGN:
                os.ftruncate(fd, total)
            finish(fd, fsync, xattr)
        except OSError as exc:
            if exc.errno != errno.EINVAL or isinstance(exc, NoXattrs):    # the caller removes tmp
                raise
            os.unlink(tmp)                         # an alignment this device refuses: buffered it is
            self.refuse(tmp.parent)
            return False
        finally:
            self.give(buf)
            os.close(fd)
        return True

    def open(self, tmp: Path) -> int | None:
        """The new file ``tmp`` opened O_DIRECT for writing, or None (and no file) where its file
        system refuses O_DIRECT."""
        if self.refused and _device(tmp.parent) in self.refused:
            return None
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.refuse(tmp.parent)
            return None

    def mode(self) -> str:
        """How block files are written now: ``O_DIRECT``, or buffered after a refusal."""
        return "buffered (O_DIRECT refused)" if self.refused else "O_DIRECT"

    def refuse(self, directory: Path) -> None:
        """Write buffered from now on on the file system of ``directory`` (it refused O_DIRECT)."""
        device = _device(directory)
        if device not in self.refused:
            self.refused.add(device)
            log.info("disk tier: the file system of %s refuses O_DIRECT; block files are written "
                     "through the page cache", directory)

    def take(self, size: int) -> mmap.mmap:
        """A page-aligned buffer of at least ``size`` bytes, from the pool when one fits."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= size:
                    return self._free.pop(i)
        return mmap.mmap(-1, round_up(size, 1 << 20))     # anonymous mappings are page-aligned

    def give(self, buf: mmap.mmap) -> None:
        """Back to the pool; past ``keep`` buffers or ``keep_bytes`` the smallest go. Dropping the
        one handed back instead let a few small buffers (a shard's tail block, an index file) hold
        the pool for good while every large write mapped, faulted in and unmapped one of its own."""
        dropped = []
        with self._lock:
            self._free.append(buf)
            while len(self._free) > 1 and (len(self._free) > self.keep
                                           or sum(map(len, self._free)) > self.keep_bytes):
                smallest = min(reversed(self._free), key=len)     # of equals, the one handed back
                self._free.remove(smallest)
                dropped.append(smallest)
        for b in dropped:
            b.close()


def _device(directory: Path) -> int:
    return os.stat(directory).st_dev
