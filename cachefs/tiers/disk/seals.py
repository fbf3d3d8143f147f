"""Seals: which exact cache files were checked in this boot, and are the same files since.

A file handed to the kernel (FUSE passthrough) is read by the kernel, not by us, so it is
verified against its header before its first hand-over (tiers/handover.py). Without more, every
first open of a file in a daemon's life (the first epoch after a warmup, every epoch after a
restart, an upgrade or a remount) would read and check the file first: on a dataset of small
files that read is most of what a disk-tier epoch costs.

A *seal* records, for an exact file read back and checked as the disk tier wrote it, or verified
before a hand-over, its inode number, its ctime in nanoseconds and its size. A daemon hands a
file over without reading it when its seal matches what ``fstat`` says now, and only in the boot
the seal was made in:

- anything that writes to the file through the kernel (a write, a truncate, an mmap store, a
  copy or restore into place, a chmod or an xattr change) gives it a new ctime, which userspace
  cannot set back; a replaced file has another inode;
- a machine crash or reboot (the one case where a file's data could be lost under an unchanged
  inode: pages not yet written back) starts a new boot, and every seal of the old one is void;
- seals are hints, kept in one small file beside the blocks; a torn or garbled record (a
  checksum each) ends the reading, and a missing record only means a read we would do anyway.

What a seal cannot see (a write to the raw block device, media corruption under the
filesystem) is what the scrub is for: a file an earlier daemon sealed is queued for the
rate-limited scrub at its first hand-over, so a restarted daemon re-verifies its files in the
background.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib

log = logging.getLogger(__name__)

MAGIC = b"cachefs-seals 1 "
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_RECORD = struct.Struct("<20sQqQI")     # digest (raw), st_ino, st_ctime_ns, st_size, crc32 of the rest
_BODY = _RECORD.size - 4


def boot_id() -> bytes:
    """This boot's id (36 ASCII bytes); empty where the kernel does not say (then nothing is sealed)."""
    try:
        with open(_BOOT_ID, "rb") as fh:
            return fh.read().strip()[:36]
    except OSError:
        return b""


_STAMP = struct.Struct("<QqQ")          # st_ino, st_ctime_ns, st_size: one bytes object per seal in memory


def _stamp(st: os.stat_result) -> bytes:
    return _STAMP.pack(st.st_ino, st.st_ctime_ns, st.st_size)


class Seals:
    """The seals of one disk tier, in ``path``: a header naming the boot, then fixed records."""

    def __init__(self, path: str, live=None, boot: bytes | None = None) -> None:
        self.path = path
        self.boot = boot_id() if boot is None else boot
        self._live = live           # digest -> whether the tier still holds it (kept on a rewrite)
        # digest -> stamp, and the earlier daemons' (read from the file) with one byte more
        self._seals: dict[str, bytes] = {}
        self._fd = -1
        self._written = 0           # records in the file
        self._rewrite_at = 4096     # ... when a rewrite keeps only the live seals
        if self.boot:
            self._open()

    def __len__(self) -> int:
        return len(self._seals)

    def matches(self, digest: str, st: os.stat_result) -> bool:
        """Whether ``digest``'s file, as ``st`` describes it, is the one sealed in this boot."""
        sealed = self._seals.get(digest)
        return sealed is not None and sealed[:_STAMP.size] == _stamp(st)

    def inherited(self, digest: str) -> bool:
        """Whether ``digest``'s seal was made by an earlier daemon (not checked in this one)."""
        sealed = self._seals.get(digest)
        return sealed is not None and len(sealed) > _STAMP.size

    def seal(self, digest: str, st: os.stat_result) -> None:
        """``digest``'s file, as ``st`` describes it, was just verified (or read back as written)."""
        if self._fd < 0:
            return
        stamp = _stamp(st)
        if self._seals.get(digest, b"")[:_STAMP.size] == stamp:
            self._seals[digest] = stamp             # this daemon's own check now
            return
        self._seals[digest] = stamp
        try:
            os.write(self._fd, self._record(digest, stamp))
            self._written += 1
            if self._written >= self._rewrite_at:
                self._rewrite(prune=True)
        except OSError as exc:          # a hint lost: the file is read again by the next daemon
            log.warning("cannot record a verified cache file in %s: %s", self.path, exc)

    def forget(self, digest: str) -> None:
        """``digest``'s file failed a check or was dropped (its record stays until a rewrite: a new
        file of that name has another inode or ctime)."""
        self._seals.pop(digest, None)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # -- the file --

    @staticmethod
    def _record(digest: str, stamp: bytes) -> bytes:
        body = bytes.fromhex(digest) + stamp[:_STAMP.size]
        return body + struct.pack("<I", zlib.crc32(body))

    def _open(self) -> None:
        header = MAGIC + self.boot + b"\n"
        try:
            with open(self.path, "rb") as fh:
                data = fh.read()
        except (FileNotFoundError, NotADirectoryError):
            data = b""
        except OSError as exc:
            log.warning("cannot read %s (%s): every cache file is verified again", self.path, exc)
            data = b""
        if data.startswith(header):
            self._load(memoryview(data)[len(header):])
        elif data:
            log.info("cache file seals of an earlier boot dropped: files are verified again before their hand-over")
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._rewrite()
        except OSError as exc:
            log.warning("cannot write %s (%s): verified cache files are not sealed", self.path, exc)
            self.close()

    def _load(self, view: memoryview) -> None:
        for at in range(0, len(view) - _RECORD.size + 1, _RECORD.size):
            raw, ino, ctime_ns, size, crc = _RECORD.unpack_from(view, at)
            if zlib.crc32(view[at:at + _BODY]) != crc:
                log.warning("%s: a damaged record at byte %d; the seals after it are dropped", self.path, at)
                break
            self._seals[raw.hex()] = _STAMP.pack(ino, ctime_ns, size) + b"i"

    def _rewrite(self, prune: bool = False) -> None:
        """The seals into a new file, renamed over the old one (``prune``: only those of files the
        tier still holds); appends go to the new one."""
        if prune and self._live is not None:
            self._seals = {d: s for d, s in self._seals.items() if self._live(d)}
        tmp = self.path + ".tmp"
        records = b"".join(self._record(d, s) for d, s in self._seals.items())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, MAGIC + self.boot + b"\n" + records)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        os.rename(tmp, self.path)
        self.close()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._written = len(self._seals)
        self._rewrite_at = max(4096, 2 * self._written)
