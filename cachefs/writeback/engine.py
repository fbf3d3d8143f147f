"""Write-back: staged files, the two sync classes, and the upload workers (DESIGN invariant 5).

A written file lives in the journal (``journal``) as a *staged file* until the store holds a
complete, verified copy of it. The index (``Writeback.files`` by path, ``Writeback.ops`` for
deletes and directory markers) is owned by the trio thread; worker threads only read
staging files, call the store and fsync, under ``CapacityLimiter``s.

Sync classes (``SyncPolicy``): *checkpoint* names are tried first, then *log* names; a name
matching neither is *log* below ``small_file_size`` and *checkpoint* above. A log file is
uploaded ``log_sync_period`` after its first unsynced write; a checkpoint file once closed and
unchanged for ``checkpoint_quiet_period``, or ``checkpoint_sync_period`` after its first
unsynced write at the latest. ``cachefs sync``, a remote fsync, a replay at start and a
full staging area make files *urgent* (due now). Log and checkpoint uploads have separate
limiters so a log upload never queues behind checkpoint parts.

Frozen snapshots without copies: an upload reads ``[0, size)`` of the staging file as it was
when the upload started. Every write lowers ``StagedFile.low_write`` to the smallest offset it
touched since then; before the object is made visible (the single PUT, or
CompleteMultipartUpload) the upload checks ``low_write >= size`` and that the file was not
renamed or deleted. Appends therefore never invalidate an upload in flight; an overwrite
or truncate supersedes it (the multipart upload is aborted; no object appears) and the
newer version is uploaded instead. One object key is never the target of two store
operations at once (``_busy``), so a delete of an old name cannot overtake an upload to it.

A file whose last upload covered its last write, and that no writer holds open, is
*retired*: its record and staging file are removed and reads go through the block cache
(keys carry the new ETag). Failing uploads stay staged, back off (up to 60 s) and retry
forever; they are counted in the metrics and shown by ``cachefs status``.
"""

import errno
import fnmatch
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio
from prometheus_client import Counter, Gauge, Histogram

from cachefs.errors import CacheDirError, StoreError
from cachefs.metrics import Metrics
from cachefs.singleflight import SingleFlight
from cachefs.store import ObjectInfo, ObjectStore
from cachefs.writeback.journal import DELETE, FILE, MKDIR, RMDIR, Journal, Record

log = logging.getLogger(__name__)

LOG, CHECKPOINT = "log", "checkpoint"
CLASSES = (LOG, CHECKPOINT)
_COPY_CHUNK = 8 << 20
_MAX_BACKOFF = 60.0
_TICK = 0.25
_LOG_PRIORITY_WAIT = 1.0
_UNTOUCHED = sys.maxsize


@dataclass(frozen=True, slots=True)
class SyncPolicy:
    log_patterns: tuple[str, ...]
    checkpoint_patterns: tuple[str, ...]
    small_file_size: int
    log_period: float
    quiet_period: float
    checkpoint_period: float

    @classmethod
    def from_config(cls, cfg) -> "SyncPolicy":
        return cls(cfg.log_patterns, cfg.checkpoint_patterns, cfg.small_file_size, cfg.log_sync_period,
                   cfg.checkpoint_quiet_period, cfg.checkpoint_sync_period)

    def classify(self, path: str, size: int) -> str:
        name = path.rsplit("/", 1)[-1]
        if any(fnmatch.fnmatchcase(name, p) for p in self.checkpoint_patterns):
            return CHECKPOINT
        if any(fnmatch.fnmatchcase(name, p) for p in self.log_patterns):
            return LOG
        return LOG if size < self.small_file_size else CHECKPOINT


class StagedFile:
    """One staged file. ``generation`` counts changes; ``synced`` is the generation the store has."""

    __slots__ = ("record", "fd", "size", "mtime", "generation", "synced", "dirty_since", "unsynced_since",
                 "last_write", "low_write", "writers", "opens", "remote", "ready", "urgent", "deleted",
                 "uploading", "failures", "next_try", "last_error", "waiters")

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
        self.low_write = _UNTOUCHED
        self.writers = 0
        self.opens = 0
        self.remote = remote         # an object may exist at ``path`` (deleting it needs a tombstone)
        self.ready = False           # the record is written: uploads may start
        self.urgent = False
        self.deleted = False
        self.uploading: _Job | None = None
        self.failures = 0
        self.next_try = 0.0
        self.last_error = ""
        self.waiters: list[_Waiter] = []

    @property
    def path(self) -> str:
        return self.record.path

    @property
    def id(self) -> int:
        return self.record.id

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


class _Waiter:
    __slots__ = ("generation", "event", "error")

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.event = trio.Event()
        self.error: str | None = None


class _Job:
    __slots__ = ("path", "size", "generation", "cls", "fd", "dirty_since", "unsynced_since", "cancelled")

    def __init__(self, entry: StagedFile, cls: str) -> None:
        self.path, self.size, self.generation, self.cls = entry.path, entry.size, entry.generation, cls
        self.fd = os.dup(entry.fd)
        self.dirty_since, self.unsynced_since = entry.dirty_since, entry.unsynced_since
        self.cancelled = False


class _PendingOp:
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


class Superseded(Exception):
    """The file changed, moved or vanished under an upload; the newer state is uploaded later."""


MAX_PARTS = 10_000      # S3 (and Ceph RGW) refuse a multipart upload of more parts


def part_size_for(size: int, configured: int) -> int:
    """The configured part size, grown (to whole MiB) only where it would need more than
    MAX_PARTS parts: without this a file over MAX_PARTS x part size could never be uploaded."""
    if -(-size // configured) <= MAX_PARTS:
        return configured
    needed = -(-size // MAX_PARTS)
    return -(-needed // (1 << 20)) << 20


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _pread_all(fd: int, size: int, offset: int = 0) -> bytes:
    parts, end = [], offset + size
    while offset < end:
        chunk = os.pread(fd, min(end - offset, 64 << 20), offset)
        if not chunk:
            raise OSError(errno.EIO, f"staging file shorter than {end} bytes")
        parts.append(chunk)
        offset += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class _Metrics:
    def __init__(self, metrics: Metrics) -> None:
        r = metrics.registry
        self.dirty_bytes = Gauge("cachefs_dirty_bytes", "Bytes of staged files not yet in the store",
                                 ["sync_class"], registry=r)
        self.dirty_files = Gauge("cachefs_dirty_files", "Staged files not yet in the store", ["sync_class"],
                                 registry=r)
        self.oldest_dirty = Gauge("cachefs_oldest_dirty_seconds", "Age of the oldest unsynced write",
                                  ["sync_class"], registry=r)
        self.staged_bytes = Gauge("cachefs_staged_bytes", "Bytes in the staging area", registry=r)
        self.failing = Gauge("cachefs_upload_failing", "Staged files and operations whose last try failed",
                             registry=r)
        self.uploads = Counter("cachefs_uploads", "Uploads by sync class and result", ["sync_class", "result"],
                               registry=r)
        self.uploaded_bytes = Counter("cachefs_uploaded_bytes", "Bytes uploaded", ["sync_class"], registry=r)
        self.sync_lag = Histogram("cachefs_sync_lag_seconds", "First unsynced write to object complete",
                                  ["sync_class"], registry=r,
                                  buckets=(0.1, 0.5, 1, 2, 5, 6, 7.5, 10, 20, 30, 60, 120, 300, 600, 1800))
        self.staging_full = Counter("cachefs_staging_full", "Writes refused with ENOSPC", registry=r)


class Writeback:
    def __init__(self, store: ObjectStore, journal: Journal, policy: SyncPolicy, metrics: Metrics, *,
                 staging_size: int, staging_wait: float, part_size: int, upload_concurrency: int,
                 log_concurrency: int) -> None:
        self.store = store
        self.journal = journal
        self.policy = policy
        self.staging_size = staging_size
        self.staging_wait = staging_wait
        self.part_size = part_size
        self.files: dict[str, StagedFile] = {}
        self.ops: dict[tuple[bool, str], _PendingOp] = {}
        self.staged_bytes = 0
        self.on_retired: Callable[[StagedFile, ObjectInfo], None] = lambda entry, info: None
        self._limiters = {LOG: trio.CapacityLimiter(log_concurrency),
                          CHECKPOINT: trio.CapacityLimiter(upload_concurrency)}
        self._io = trio.CapacityLimiter(8)          # fsync and record writes
        self._busy: set[str] = set()
        self._log_uploads = 0                       # log-class uploads in flight: checkpoint parts wait
        self._logs_idle = trio.Event()
        self._logs_idle.set()
        self._copyups = SingleFlight()
        self._wake = trio.Event()
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._m = _Metrics(metrics)

    # ---- life cycle --------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Replay the journal, then schedule uploads until cancelled."""
        records = await trio.to_thread.run_sync(self.journal.replay)
        self._restore(records)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await self._schedule()

    def _restore(self, records: list[Record]) -> None:
        now = time.time()
        for record in records:
            if record.kind == FILE:
                fd = os.open(self.journal.data_path(record.id), os.O_RDWR | os.O_CLOEXEC)
                entry = StagedFile(record, fd, os.fstat(fd).st_size, now, remote=True)
                entry.ready = entry.urgent = True
                entry.unsynced_since = record.created
                self.files[record.path] = entry
                self.staged_bytes += entry.size
            else:
                op = self.ops[record.slot] = _PendingOp(record)
                op.ready = True
        if records:
            log.info("journal: resuming %d staged file(s) (%d bytes) and %d pending operation(s)",
                     len(self.files), self.staged_bytes, len(self.ops))

    def wake(self) -> None:
        self._wake.set()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
        self._wake.set()

    # ---- the scheduler -------------------------------------------------------------------------
    async def _schedule(self) -> None:
        while True:
            now = time.time()
            next_due = now + _TICK * 4
            for entry in list(self.files.values()):
                due = self._due(entry)
                if due is None:
                    continue
                if due <= now and entry.path not in self._busy:
                    self._start_upload(entry)
                else:
                    next_due = min(next_due, max(due, now + 0.05))
            for op in list(self.ops.values()):
                if op.ready and not op.running and op.next_try <= now and op.key not in self._busy:
                    op.running = True
                    self._busy.add(op.key)
                    self._nursery.start_soon(self._run_op, op)
            self._update_gauges(now)
            self._wake = trio.Event()
            with trio.move_on_after(max(0.0, next_due - time.time())):
                await self._wake.wait()

    def _due(self, entry: StagedFile) -> float | None:
        if not entry.ready or entry.uploading is not None or entry.deleted or entry.dirty_since is None:
            return None
        if entry.urgent:
            return entry.next_try
        p = self.policy
        if p.classify(entry.path, entry.size) == LOG:
            due = entry.dirty_since + p.log_period
        else:
            due = entry.dirty_since + p.checkpoint_period
            if entry.writers == 0:
                due = min(due, entry.last_write + p.quiet_period)
        return max(due, entry.next_try)

    def _start_upload(self, entry: StagedFile) -> None:
        job = _Job(entry, self.policy.classify(entry.path, entry.size))
        entry.uploading = job
        entry.urgent = False
        entry.dirty_since = None
        entry.low_write = _UNTOUCHED
        self._busy.add(job.path)
        self._nursery.start_soon(self._upload, entry, job)

    # ---- uploads ---------------------------------------------------------------------------------
    async def _upload(self, entry: StagedFile, job: _Job) -> None:
        if job.cls == LOG:
            self._log_started()
        try:
            if job.size <= self.part_size:
                info = await self._put_whole(entry, job)
            else:
                info = await self._put_multipart(entry, job)
        except Superseded:
            self._m.uploads.labels(job.cls, "superseded").inc()
            entry.dirty_since = _earliest(job.dirty_since, entry.dirty_since)
        except (StoreError, OSError) as exc:
            self._failed(entry, job, exc)
        else:
            await self._uploaded(entry, job, info)
        finally:
            os.close(job.fd)
            entry.uploading = None
            self._busy.discard(job.path)
            if job.cls == LOG:
                self._log_finished()
            self._notify()

    def _log_started(self) -> None:
        if self._log_uploads == 0:
            self._logs_idle = trio.Event()
        self._log_uploads += 1

    def _log_finished(self) -> None:
        self._log_uploads -= 1
        if self._log_uploads == 0:
            self._logs_idle.set()

    async def _logs_first(self) -> None:
        """Log uploads go before checkpoint parts: a part starts only when no log upload runs
        (a log upload is small; parts already sending finish). A part waits at most
        ``_LOG_PRIORITY_WAIT``, so a slow or failing log upload cannot stall a checkpoint."""
        with trio.move_on_after(_LOG_PRIORITY_WAIT):
            await self._logs_idle.wait()

    def _check(self, entry: StagedFile, job: _Job) -> None:
        if job.cancelled or entry.deleted or entry.path != job.path or entry.low_write < job.size:
            raise Superseded(job.path)

    async def _put_whole(self, entry: StagedFile, job: _Job) -> ObjectInfo:
        limiter = self._limiters[job.cls]
        data = await trio.to_thread.run_sync(_pread_all, job.fd, job.size, limiter=limiter)
        self._check(entry, job)
        return await trio.to_thread.run_sync(self.store.put, job.path, data, limiter=limiter)

    async def _put_multipart(self, entry: StagedFile, job: _Job) -> ObjectInfo:
        limiter = self._limiters[job.cls]
        upload_id = await trio.to_thread.run_sync(self.store.start_upload, job.path, limiter=limiter)
        try:
            parts = await self._send_parts(entry, job, upload_id, limiter)
            self._check(entry, job)
            return await trio.to_thread.run_sync(self.store.finish_upload, job.path, upload_id, parts, job.size,
                                                 limiter=limiter)
        except BaseException:
            with trio.move_on_after(30, shield=True):
                try:
                    await trio.to_thread.run_sync(self.store.abort_upload, job.path, upload_id)
                except StoreError as exc:
                    log.info("abort of an upload of %s failed (invisible; a bucket lifecycle rule "
                             "removes it): %s", job.path, exc)
            raise

    async def _send_parts(self, entry: StagedFile, job: _Job, upload_id: str,
                          limiter: trio.CapacityLimiter) -> list[tuple[int, str]]:
        part_size = part_size_for(job.size, self.part_size)
        count = (job.size + part_size - 1) // part_size
        etags: list[str | None] = [None] * count
        errors: list[BaseException] = []

        def send(number: int) -> str:
            start = (number - 1) * part_size
            data = _pread_all(job.fd, min(part_size, job.size - start), start)
            return self.store.upload_part(job.path, upload_id, number, data)

        async def part(index: int) -> None:
            try:
                async with limiter:
                    await self._logs_first()
                    self._check(entry, job)
                    etags[index] = await trio.to_thread.run_sync(send, index + 1)
            except (Superseded, StoreError, OSError) as exc:
                errors.append(exc)
                job.cancelled = True

        async with trio.open_nursery() as nursery:
            for index in range(count):
                nursery.start_soon(part, index)
        failures = [e for e in errors if not isinstance(e, Superseded)]
        if failures or errors:
            raise (failures or errors)[0]
        return [(i + 1, etag) for i, etag in enumerate(etags)]

    def _failed(self, entry: StagedFile, job: _Job, exc: BaseException) -> None:
        entry.dirty_since = _earliest(job.dirty_since, entry.dirty_since)
        entry.failures += 1
        entry.last_error = str(exc)
        entry.next_try = time.time() + min(_MAX_BACKOFF, 2.0 ** min(entry.failures, 6))
        self._m.uploads.labels(job.cls, "failed").inc()
        level = logging.WARNING if entry.failures in (1, 5) or entry.failures % 50 == 0 else logging.INFO
        log.log(level, "upload of %s failed (try %d; it stays staged and is retried): %s", job.path,
                entry.failures, exc)
        for waiter in entry.waiters:
            waiter.error = str(exc)
            waiter.event.set()
        entry.waiters = []

    async def _uploaded(self, entry: StagedFile, job: _Job, info: ObjectInfo) -> None:
        now = time.time()
        self._m.uploads.labels(job.cls, "ok").inc()
        self._m.uploaded_bytes.labels(job.cls).inc(job.size)
        if job.unsynced_since is not None:
            self._m.sync_lag.labels(job.cls).observe(now - job.unsynced_since)
        entry.synced = max(entry.synced, job.generation)
        entry.failures, entry.last_error, entry.next_try = 0, "", 0.0
        entry.remote = True
        entry.unsynced_since = entry.dirty_since
        waiting = [w for w in entry.waiters if w.generation <= job.generation]
        entry.waiters = [w for w in entry.waiters if w.generation > job.generation]
        for waiter in waiting:
            waiter.event.set()
        if entry.synced == entry.generation and entry.writers == 0 and not entry.deleted:
            await self._retire(entry, info)

    async def _retire(self, entry: StagedFile, info: ObjectInfo) -> None:
        """The store has this exact content: drop the record, then the staging file."""
        if self.files.get(entry.path) is entry:
            del self.files[entry.path]
        self.staged_bytes -= entry.size
        entry.deleted = True
        self.on_retired(entry, info)
        fd, entry.fd = entry.fd, -1
        await trio.to_thread.run_sync(self._forget, entry.id, fd, limiter=self._io)

    def _forget(self, ident: int, fd: int) -> None:
        self.journal.remove_record(ident)
        self.journal.remove_data(ident)
        if fd >= 0:
            os.close(fd)

    # ---- pending operations (tombstones, directory markers) -------------------------------------
    async def _run_op(self, op: _PendingOp) -> None:
        record = op.record
        action = {DELETE: self.store.delete, MKDIR: self.store.make_dir, RMDIR: self.store.remove_dir}[record.kind]
        try:
            await trio.to_thread.run_sync(action, record.path, limiter=self._limiters[LOG])
        except StoreError as exc:
            op.failures += 1
            op.last_error = str(exc)
            op.next_try = time.time() + min(_MAX_BACKOFF, 2.0 ** min(op.failures, 6))
            log.log(logging.WARNING if op.failures == 1 else logging.INFO,
                    "%s of %s failed (retried): %s", record.kind, record.path, exc)
        else:
            if self.ops.get(record.slot) is op:
                del self.ops[record.slot]
            await trio.to_thread.run_sync(self.journal.remove_record, record.id, limiter=self._io)
        finally:
            op.running = False
            self._busy.discard(op.key)
            self._notify()

    async def add_op(self, kind: str, path: str) -> None:
        """Journal a tombstone (DELETE) or a directory marker change (MKDIR, RMDIR) for ``path``;
        it replaces a pending opposite operation of the same slot."""
        seq = self.journal.next_seq()
        record = Record(seq, seq, kind, path, time.time())
        self.cancel_op(record.slot)
        op = self.ops[record.slot] = _PendingOp(record)
        await trio.to_thread.run_sync(self.journal.write_record, record, limiter=self._io)
        op.ready = True
        if op.cancelled:
            await trio.to_thread.run_sync(self.journal.remove_record, record.id, limiter=self._io)
        self.wake()

    def cancel_op(self, slot: tuple[bool, str]) -> None:
        """Forget a pending operation that a newer one supersedes (a running one finishes)."""
        op = self.ops.get(slot)
        if op is None or op.running:
            return
        del self.ops[slot]
        op.cancelled = True
        if op.ready:
            self._nursery.start_soon(self._remove_record, op.record.id)

    async def _remove_record(self, ident: int) -> None:
        await trio.to_thread.run_sync(self.journal.remove_record, ident, limiter=self._io)

    # ---- staged files (called by the vfs) --------------------------------------------------------
    def _new_entry(self, path: str, *, remote: bool) -> StagedFile:
        seq = self.journal.next_seq()
        fd = self.journal.create_data(seq)
        return StagedFile(Record(seq, seq, FILE, path, time.time()), fd, 0, time.time(), remote=remote)

    async def _register(self, entry: StagedFile) -> None:
        """Journal ``entry`` and make it the file at its path (replacing any staged one)."""
        old = self.files.get(entry.path)
        self.files[entry.path] = entry
        self.staged_bytes += entry.size
        self.cancel_op((False, entry.path))
        if old is not None:
            entry.remote = entry.remote or old.remote
            await self._discard(old)
        await trio.to_thread.run_sync(self.journal.write_record, entry.record, limiter=self._io)
        entry.ready = True
        self.wake()

    async def create(self, path: str, *, remote: bool) -> StagedFile:
        """A new empty staged file at ``path``; ``remote``: an object may exist there."""
        entry = self._new_entry(path, remote=remote)
        await self._register(entry)
        return entry

    async def copy_up(self, path: str, etag: str, size: int) -> StagedFile:
        """Stage the object ``path`` (version ``etag``) to modify it; concurrent callers share one copy."""
        staged = self.files.get(path)
        if staged is not None:
            return staged
        return await self._copyups.do(path, lambda: self._copy_up(path, etag, size))

    async def _copy_up(self, path: str, etag: str, size: int) -> StagedFile:
        await self.reserve(None, size)
        entry = self._new_entry(path, remote=True)
        try:
            for start in range(0, size, _COPY_CHUNK):
                end = min(size, start + _COPY_CHUNK)
                data = await self.store.get_async(path, start, end, etag, size, limiter=self._limiters[LOG])
                os.pwrite(entry.fd, data, start)
        except BaseException:
            os.close(entry.fd)
            self.journal.remove_data(entry.id)
            raise
        entry.size = size
        entry.dirty_since = entry.unsynced_since = None    # the store has this content
        entry.generation = entry.synced = 1
        await self._register(entry)
        return entry

    def read(self, entry: StagedFile, offset: int, size: int) -> bytes:
        end = min(offset + size, entry.size)
        return os.pread(entry.fd, end - offset, offset) if end > offset else b""

    async def write(self, entry: StagedFile, offset: int, data: bytes) -> int:
        end = offset + len(data)
        await self.reserve(entry, end)
        try:
            written = os.pwrite(entry.fd, data, offset)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            await self._wait_for_space(lambda: False)    # the staging disk itself is full
            written = os.pwrite(entry.fd, data, offset)
        self._resize(entry, max(entry.size, offset + written))
        entry.touch(offset, time.time())
        return written

    async def truncate(self, entry: StagedFile, size: int) -> None:
        await self.reserve(entry, size)
        os.ftruncate(entry.fd, size)
        self._resize(entry, size)
        entry.touch(size, time.time())

    def _resize(self, entry: StagedFile, size: int) -> None:
        if not entry.deleted:
            self.staged_bytes += size - entry.size
        entry.size = size

    async def reserve(self, entry: StagedFile | None, end: int) -> None:
        """Block (at most ``staging_wait``) until the staging area can grow to ``end``; else ENOSPC."""
        grow = end - (entry.size if entry is not None else 0)
        if grow <= 0 or self.staged_bytes + grow <= self.staging_size:
            return
        if not await self._wait_for_space(lambda: self.staged_bytes + grow <= self.staging_size):
            self._m.staging_full.inc()
            raise OSError(errno.ENOSPC, f"staging area full ({self.staged_bytes} of {self.staging_size} "
                                        f"bytes staged, not yet uploaded)")

    async def _wait_for_space(self, fits: Callable[[], bool]) -> bool:
        self.request_sync()
        with trio.move_on_after(self.staging_wait):
            while not fits():
                await self._changed.wait()
                if not fits():
                    self.request_sync()
            return True
        return fits()

    def opened(self, entry: StagedFile, *, writable: bool) -> None:
        entry.opens += 1
        entry.writers += writable

    async def released(self, entry: StagedFile, *, writable: bool) -> None:
        entry.opens -= 1
        entry.writers -= writable
        if entry.deleted and entry.opens <= 0 and entry.fd >= 0:
            os.close(entry.fd)
            entry.fd = -1
        elif writable and entry.writers == 0:
            entry.last_write = max(entry.last_write, time.time()) if entry.dirty_since else entry.last_write
            if entry.synced == entry.generation and entry.uploading is None and not entry.deleted:
                info = ObjectInfo(entry.path, entry.size, entry.mtime, "")
                await self._retire_clean(entry, info)
            self.wake()

    async def _retire_clean(self, entry: StagedFile, info: ObjectInfo) -> None:
        """A copy-up never written, or a file uploaded while open: HEAD for its ETag, then retire."""
        try:
            info = await trio.to_thread.run_sync(self.store.head, entry.path, limiter=self._limiters[LOG])
        except StoreError:
            return     # stays staged; harmless
        if entry.synced == entry.generation and entry.writers == 0 and entry.uploading is None \
                and not entry.deleted and info.size == entry.size:
            await self._retire(entry, info)

    async def fsync(self, entry: StagedFile, *, remote: bool) -> None:
        fd = os.dup(entry.fd)
        try:
            await trio.to_thread.run_sync(self.journal.sync_data, fd, limiter=self._io)
        finally:
            os.close(fd)
        if remote and entry.synced < entry.generation:
            waiter = _Waiter(entry.generation)
            entry.waiters.append(waiter)
            entry.urgent = True
            entry.next_try = 0.0
            if entry.dirty_since is None and entry.uploading is None:
                entry.dirty_since = time.time()
            self.wake()
            await waiter.event.wait()
            if waiter.error is not None:
                raise OSError(errno.EIO, f"upload failed (the file stays staged): {waiter.error}")

    async def unlink(self, entry: StagedFile) -> None:
        """The staged file's name is gone: journal a tombstone if an object may exist, drop the rest."""
        if entry.remote or entry.uploading is not None:
            await self.add_op(DELETE, entry.path)
        await self._discard(entry)

    async def _discard(self, entry: StagedFile) -> None:
        if self.files.get(entry.path) is entry:
            del self.files[entry.path]
        if not entry.deleted:
            self.staged_bytes -= entry.size
        entry.deleted = True
        if entry.uploading is not None:
            entry.uploading.cancelled = True
        for waiter in entry.waiters:
            waiter.error = "the file was deleted"
            waiter.event.set()
        entry.waiters = []
        fd = -1
        if entry.opens <= 0:
            fd, entry.fd = entry.fd, -1
        await trio.to_thread.run_sync(self._forget, entry.id, fd, limiter=self._io)
        self._notify()

    async def move(self, entry: StagedFile, new_path: str, *, replaces_object: bool) -> None:
        """Rename a staged file; ``replaces_object``: an object exists at ``new_path``."""
        old_path, had_object = entry.path, entry.remote or entry.uploading is not None
        other = self.files.get(new_path)
        if other is not None and other is not entry:
            replaces_object = replaces_object or other.remote
            await self._discard(other)
        self.files.pop(old_path, None)
        self.cancel_op((False, new_path))
        seq = self.journal.next_seq()
        entry.record = Record(entry.id, seq, FILE, new_path, entry.record.created)
        self.files[new_path] = entry
        entry.remote = replaces_object
        entry.synced = 0
        entry.touch(0, time.time())
        await trio.to_thread.run_sync(self.journal.write_record, entry.record, limiter=self._io)
        if had_object:
            await self.add_op(DELETE, old_path)
        self.wake()

    # ---- control: sync, drain, status ----------------------------------------------------------
    def _matches(self, entry: StagedFile, cls: str | None) -> bool:
        return cls is None or self.policy.classify(entry.path, entry.size) == cls

    def request_sync(self, cls: str | None = None) -> None:
        """Make every unsynced file of ``cls`` (all when None) due now."""
        for entry in self.files.values():
            if self._matches(entry, cls) and entry.unsynced_since is not None:
                entry.urgent = True
                entry.next_try = 0.0
                if entry.dirty_since is None and entry.uploading is None:
                    entry.dirty_since = time.time()
        if cls in (None, LOG):
            for op in self.ops.values():
                op.next_try = 0.0
        self.wake()

    def pending(self, cls: str | None = None) -> dict:
        files = [e for e in self.files.values() if e.unsynced_since is not None and self._matches(e, cls)]
        ops = list(self.ops.values()) if cls in (None, LOG) else []
        return {"files": len(files), "bytes": sum(e.size for e in files), "operations": len(ops),
                "uploading": sum(1 for e in files if e.uploading is not None),
                "failing": sum(1 for e in files if e.failures) + sum(1 for o in ops if o.failures),
                "errors": sorted({e.last_error for e in files if e.last_error}
                                 | {o.last_error for o in ops if o.failures})[:5]}

    async def wait_changed(self, timeout: float) -> None:
        """Until an upload or operation finishes, or ``timeout``."""
        with trio.move_on_after(timeout):
            await self._changed.wait()

    async def wait_synced(self, cls: str | None, timeout: float) -> bool:
        """Until nothing of ``cls`` is pending (True) or ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.pending(cls)
            if not left["files"] and not left["operations"]:
                return True
            if time.monotonic() >= deadline:
                return False
            await self.wait_changed(min(1.0, deadline - time.monotonic()))

    def status(self) -> dict:
        now = time.time()
        classes = {cls: {"dirty_files": 0, "dirty_bytes": 0, "oldest_dirty_age_s": None, "uploading": 0,
                         "failing": 0} for cls in CLASSES}
        for entry in self.files.values():
            if entry.unsynced_since is None:
                continue
            c = classes[self.policy.classify(entry.path, entry.size)]
            c["dirty_files"] += 1
            c["dirty_bytes"] += entry.size
            age = round(now - entry.unsynced_since, 1)
            c["oldest_dirty_age_s"] = max(c["oldest_dirty_age_s"] or 0.0, age)
            c["uploading"] += entry.uploading is not None
            c["failing"] += entry.failures > 0
        pending = self.pending()
        return {"classes": classes, "staged_files": len(self.files), "staged_bytes": self.staged_bytes,
                "staging_size": self.staging_size, "pending_operations": pending["operations"],
                "failing": pending["failing"], "errors": pending["errors"]}

    def _update_gauges(self, now: float) -> None:
        status = self.status()
        for cls, c in status["classes"].items():
            self._m.dirty_bytes.labels(cls).set(c["dirty_bytes"])
            self._m.dirty_files.labels(cls).set(c["dirty_files"])
            self._m.oldest_dirty.labels(cls).set(c["oldest_dirty_age_s"] or 0.0)
        self._m.staged_bytes.set(self.staged_bytes)
        self._m.failing.set(status["failing"])

    def close(self) -> None:
        """Close staging descriptors (the daemon is stopping; the journal keeps everything)."""
        for entry in self.files.values():
            if entry.fd >= 0:
                os.close(entry.fd)
                entry.fd = -1


def make_writeback(cfg, store: ObjectStore, metrics: Metrics) -> Writeback:
    """The write-back engine of a mount configuration (its journal under ``cfg.staging_path``)."""
    try:
        journal = Journal(cfg.staging_path)
    except OSError as exc:
        raise CacheDirError(f"staging dir {cfg.staging_path}: {exc.strerror}") from None
    return Writeback(store, journal, SyncPolicy.from_config(cfg), metrics, staging_size=cfg.staging_size,
                     staging_wait=cfg.staging_wait, part_size=cfg.upload_part_size,
                     upload_concurrency=cfg.upload_concurrency, log_concurrency=cfg.log_upload_concurrency)


async def sync_command(writeback: Writeback, args: dict):
    """The control command behind ``cachefs sync``: {"class": log|checkpoint|None, "wait": bool,
    "timeout": s}. Streams {"progress": pending} lines while waiting, then {"done", "pending"}."""
    cls = args.get("class")
    if cls not in (None, *CLASSES):
        yield {"error": f"unknown sync class {cls!r}; use log or checkpoint"}
        return
    writeback.request_sync(cls)
    deadline = time.monotonic() + float(args.get("timeout", 3600))
    while args.get("wait") and time.monotonic() < deadline:
        left = writeback.pending(cls)
        if not left["files"] and not left["operations"]:
            break
        yield {"progress": left}
        await writeback.wait_changed(min(2.0, max(0.0, deadline - time.monotonic())))
    left = writeback.pending(cls)
    yield {"done": not left["files"] and not left["operations"], "pending": left}
