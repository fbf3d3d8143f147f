"""The staged-file model: a written file in the journal, an upload of one version of it, and
a pending tombstone or directory marker. Plain state owned by the trio thread (no I/O here
but ``os.dup`` of a staging descriptor and ``pread_all``, which worker threads call).

``generation`` counts changes; ``synced`` is the generation the store has. Every change lowers
``low_write`` to the smallest offset it touched since the upload in flight started: an upload
of ``[0, size)`` stays valid while ``low_write >= size`` (appends never supersede it).
"""

import errno
import os
import sys

import trio

from cachefs.writeback.journal import MKDIR, RMDIR, Record

UNTOUCHED = sys.maxsize


class Superseded(Exception):
    """The file changed, moved or vanished under an upload; the newer state is uploaded later."""


class StagedFile:
    """One staged file. ``generation`` counts changes; ``synced`` is the generation the store has."""

    __slots__ = ("record", "fd", "size", "mtime", "generation", "synced", "dirty_since", "unsynced_since",
                 "last_write", "low_write", "writers", "opens", "remote", "ready", "urgent", "deleted",
                 "uploading", "failures", "next_try", "last_error", "waiters", "truncations", "record_lock")

    def __init__(self, record: Record, fd: int, size: int, now: float, *, remote: bool) -> None:
        self.record = record
        self.fd = fd
        self.size = size
        self.mtime = now
        self.generation = 1
        self.synced = 0
        self.dirty_since: float | None = now     # first write no started upload covers
        self.unsynced_since: float | None = now  # first write no finished upload covers
        self.last_write = now
        self.low_write = UNTOUCHED
        self.writers = 0
        self.opens = 0
        self.remote = remote         # an object may exist at ``path`` (deleting it needs a tombstone)
        self.ready = False           # the record is written: uploads may start
        self.urgent = False
        self.deleted = False
        self.uploading: UploadJob | None = None
        self.failures = 0
        self.next_try = 0.0
        self.last_error = ""
        self.waiters: list[Waiter] = []
        self.truncations = 0
        self.record_lock = trio.Lock()      # record rewrites (seal, rename) and removal, one at a time

    @property
    def path(self) -> str:
        return self.record.path

    @property
    def id(self) -> int:
        return self.record.id

    @property
    def readable(self) -> bool:
        """Its staging file is still open (not retired, or deleted and released)."""
        return self.fd >= 0

    @property
    def dirty(self) -> bool:
        """Some write is not yet in the store (no finished upload covers it)."""
        return self.unsynced_since is not None

    def touch(self, offset: int, now: float) -> None:
        """Record a change at ``offset`` or beyond (a write, or a truncate to ``offset``)."""
        self.generation += 1
        self.mtime = self.last_write = now
        self.low_write = min(self.low_write, offset)
        if self.dirty_since is None:
            self.dirty_since = now
        if self.unsynced_since is None:
            self.unsynced_since = now
        job = self.uploading
        if job is not None and offset < job.size:
            job.cancelled = True      # a newer version supersedes the upload in flight

    def make_urgent(self, now: float, retry_failed: bool = True) -> None:
        """Due now (a sync, a remote fsync, a full staging area); a failing one keeps its backoff
        unless ``retry_failed``."""
        self.urgent = True
        self.next_try = 0.0 if retry_failed or not self.failures else self.next_try
        if self.dirty_since is None and self.uploading is None:
            self.dirty_since = now

    def check(self, job: "UploadJob") -> None:
        """Raise Superseded unless ``job`` still describes this file's content."""
        if job.cancelled or self.changed(job):
            raise Superseded(job.path)

    def changed(self, job: "UploadJob") -> bool:
        """Changed below ``job.size`` (a write, a truncate: the staging file may now be shorter than
        the job read), moved or deleted since ``job`` started."""
        return self.deleted or self.path != job.path or self.low_write < job.size

    def wake_waiters(self, error: str | None, up_to: int | None = None) -> None:
        """Release remote-fsync waiters (all, or those of generations up to ``up_to``)."""
        keep = []
        for waiter in self.waiters:
            if up_to is not None and waiter.generation > up_to:
                keep.append(waiter)
                continue
            waiter.error = error
            waiter.event.set()
        self.waiters = keep


class Waiter:
    """A remote fsync waiting for generation ``generation`` to reach the store."""

    __slots__ = ("generation", "event", "error")

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.event = trio.Event()
        self.error: str | None = None


class UploadJob:
    """One upload of ``[0, size)`` of a staged file as it was at ``generation``."""

    __slots__ = ("path", "size", "generation", "cls", "fd", "dirty_since", "unsynced_since", "cancelled")

    def __init__(self, entry: StagedFile, cls: str) -> None:
        self.path, self.size, self.generation, self.cls = entry.path, entry.size, entry.generation, cls
        self.fd = os.dup(entry.fd)
        self.dirty_since, self.unsynced_since = entry.dirty_since, entry.unsynced_since
        self.cancelled = False


class PendingOp:
    """A tombstone or a directory marker to create or remove."""

    __slots__ = ("record", "ready", "running", "cancelled", "failures", "next_try", "last_error")

    def __init__(self, record: Record) -> None:
        self.record = record
        self.ready = self.running = self.cancelled = False
        self.failures = 0
        self.next_try = 0.0
        self.last_error = ""

    @property
    def key(self) -> str:
        return self.record.path + ("/" if self.record.kind in (MKDIR, RMDIR) else "")


def earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def pread_all(fd: int, size: int, offset: int = 0) -> bytes:
    parts, end = [], offset + size
    while offset < end:
        chunk = os.pread(fd, min(end - offset, 64 << 20), offset)
        if not chunk:
            raise OSError(errno.EIO, f"staging file shorter than {end} bytes")
        parts.append(chunk)
        offset += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)
