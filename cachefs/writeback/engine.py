"""Write-back engine: the index of staged files, the scheduler, staging space, remote-fsync
waiters and journal replay (docs/design.md, invariant 5). The modules beside it own the rest:
``policy`` (sync classes, due times, part sizes), ``staged`` (the staged-file model),
``uploader`` (one PUT or multipart upload), ``overlay`` (what the namespace sees), ``status``
and ``commands`` (``cachefs sync``); ``journal`` owns the on-disk format and crash protocol.

The index (``_files`` by path, ``_ops`` for tombstones and directory markers, by record slot) is
the trio thread's; worker threads only read staging files, call the store and fsync, under
limiters. The namespace uses the public methods below (``staged``, ``overlay``, ``space``, ...).

Scheduling: a file is due by its sync class (``SyncPolicy.due``); ``cachefs sync``, a remote
fsync, a replay at start and a full staging area make files *urgent* (due now). One object key is
never the target of two store operations at once (``_busy``): no delete overtakes an upload.

Frozen snapshots without copies: an upload reads ``[0, size)`` of the staging file as it was
when it started; before the object is made visible it checks that no write went below ``size``
and that the file was not renamed or deleted (``StagedFile.check``), else it is *superseded*
(a multipart upload is aborted; no object appears) and the newer version is uploaded instead.
A PUT or completion already sent still lands: until it has, its path counts as holding an object
(``_may_exist``), so a delete there leaves a tombstone, run after it.

A file whose last upload covered its last write and that no writer holds open is *retired*: its
record, then its staging file, are removed and reads go through the block cache (new ETag).
Failing uploads stay staged, back off (up to 60 s), retry forever, and show in metrics and status.
"""

import contextlib
import dataclasses
import errno
import logging
import os
import time
from collections.abc import Callable

import trio

from cachefs.errors import StoreError
from cachefs.metrics import Metrics
from cachefs.ports import Port
from cachefs.singleflight import SingleFlight
from cachefs.store import ObjectInfo, ObjectStore
from cachefs.writeback import status as _status
from cachefs.writeback.fence import JournalGuard
from cachefs.writeback.journal import DELETE, FILE, MKDIR, RMDIR, Journal, Record, pwrite_all
from cachefs.writeback.metrics import WritebackMetrics
from cachefs.writeback.overlay import DirOverlay, overlay
from cachefs.writeback.policy import CHECKPOINT, CLASSES, LOG, MAX_PARTS, SyncPolicy, WritebackOptions, part_size_for
from cachefs.writeback.staged import UNTOUCHED, PendingOp, StagedFile, Superseded, UploadJob, Waiter, earliest
from cachefs.writeback.uploader import Uploader

__all__ = ["CHECKPOINT", "CLASSES", "LOG", "MAX_PARTS", "StagedFile", "SyncPolicy", "Writeback", "part_size_for"]

log = logging.getLogger(__name__)

_COPY_CHUNK = 8 << 20
_MAX_BACKOFF = 60.0
_TICK = 0.25


def _backoff(failures: int) -> float:
    return time.time() + min(_MAX_BACKOFF, 2.0 ** min(failures, 6))


class Writeback:
    def __init__(self, store: ObjectStore, journal: Journal, options: WritebackOptions, metrics: Metrics, *,
                 retired: Port | None = None, barrier: Port | None = None) -> None:
        self.store = store
        self.journal = journal
        self.policy = options.policy
        self.staging_size = options.staging_size
        self.staging_wait = options.staging_wait
        self.staged_bytes = 0
        # a staged file reached the store (the namespace shows it); a record is about to go (the
        # listing snapshot makes its rows durable first): ports the wiring connects (cachefs/ports.py)
        self.retired = retired if retired is not None else Port("retired")
        self.replayed_dirs: set[str] = set()     # parents of records replayed at start (vfs relists them)
        self._files: dict[str, StagedFile] = {}
        self._ops: dict[tuple[bool, str], PendingOp] = {}
        self._io = trio.CapacityLimiter(8)          # fsync and record writes
        self._m = metrics.group(WritebackMetrics)
        self._guard = JournalGuard(journal, self._io, self._m,      # journal I/O; fences a failing cache dir
                                   barrier if barrier is not None else Port("barrier"))
        self._uploader = Uploader(store, self._guard, part_size=options.part_size,
                                  upload_concurrency=options.upload_concurrency, log_concurrency=options.log_concurrency)
        self._busy: set[str] = set()
        self._copyups = SingleFlight()
        self._wake = trio.Event()
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None

    @property
    def part_size(self) -> int:
        return self._uploader.part_size

    # ---- what the namespace may ask ----------------------------------------------------------
    def staged(self, path: str) -> StagedFile | None:
        """The staged file at ``path``, if one is staged there."""
        return self._files.get(path)

    def overlay(self, dir_path: str) -> DirOverlay:
        """What is staged, deleted or made under directory ``dir_path`` and not yet listed."""
        return overlay(dir_path, self._files.values(), self._ops.values())

    def space(self) -> tuple[int, int]:
        """(capacity, used) of the staging area, in bytes."""
        return self.staging_size, self.staged_bytes

    # ---- life cycle --------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Replay the journal, then schedule uploads until cancelled."""
        records = await self._guard.replay()
        orphans = await trio.to_thread.run_sync(self.journal.open_uploads)
        self._restore(records)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._uploader.abort_orphans, orphans)
            task_status.started()
            await self._schedule()

    def _restore(self, records: list[Record]) -> None:
        now = time.time()
        for record in records:
            self.replayed_dirs.add(record.path.rpartition("/")[0])
            if record.kind == FILE:
                fd = os.open(self.journal.data_path(record.id), os.O_RDWR | os.O_CLOEXEC)
                entry = StagedFile(record, fd, os.fstat(fd).st_size, now, remote=True)
                entry.ready = entry.urgent = True
                entry.unsynced_since = record.created
                self._files[record.path] = entry
                self.staged_bytes += entry.size
            else:
                op = self._ops[record.slot] = PendingOp(record)
                op.ready = True
        if records:
            log.info("journal: resuming %d staged file(s) (%d bytes) and %d pending operation(s)",
                     len(self._files), self.staged_bytes, len(self._ops))

    def wake(self) -> None:
        self._wake.set()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
        self._wake.set()

    def close(self) -> None:
        """Seal and close the staging files (a clean stop: the next start trusts all of them)."""
        for entry in (e for e in self._files.values() if e.fd >= 0):
            with contextlib.suppress(OSError):      # a failing cache dir: the seals stay as they were
                entry.record = self.journal.seal(entry.fd, entry.record)
            os.close(entry.fd)
            entry.fd = -1

    # ---- the scheduler -------------------------------------------------------------------------
    async def _schedule(self) -> None:
        while True:
            now = time.time()
            next_due = now + _TICK * 4
            for entry in list(self._files.values()):
                due = self._due(entry)
                if due is None:
                    continue
                if due <= now and entry.path not in self._busy:
                    self._start_upload(entry)
                else:
                    next_due = min(next_due, max(due, now + 0.05))
            for op in list(self._ops.values()):
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
        due = self.policy.due(entry.path, entry.size, dirty_since=entry.dirty_since, last_write=entry.last_write,
                              open_for_write=entry.writers > 0)
        return max(due, entry.next_try)

    def _start_upload(self, entry: StagedFile) -> None:
        job = UploadJob(entry, self.policy.classify(entry.path, entry.size))
        entry.uploading = job
        entry.urgent = False
        entry.dirty_since = None
        entry.low_write = UNTOUCHED
        self._busy.add(job.path)
        self._nursery.start_soon(self._upload, entry, job)

    async def _upload(self, entry: StagedFile, job: UploadJob) -> None:
        try:
            info = await self._uploader.upload(entry, job)
        except Superseded:
            self._m.uploads.labels(job.cls, "superseded").inc()
            entry.dirty_since = earliest(job.dirty_since, entry.dirty_since)
        except (StoreError, OSError) as exc:
            self._failed(entry, job, exc)
        else:
            await self._uploaded(entry, job, info)
        finally:
            os.close(job.fd)
            entry.uploading = None
            self._busy.discard(job.path)
            self._notify()

    def _failed(self, entry: StagedFile, job: UploadJob, exc: BaseException) -> None:
        entry.dirty_since = earliest(job.dirty_since, entry.dirty_since)
        entry.failures += 1
        entry.last_error = str(exc)
        entry.next_try = _backoff(entry.failures)
        self._m.uploads.labels(job.cls, "failed").inc()
        level = logging.WARNING if entry.failures in (1, 5) or entry.failures % 50 == 0 else logging.INFO
        log.log(level, "upload of %s failed (try %d; it stays staged and is retried): %s", job.path,
                entry.failures, exc)
        entry.wake_waiters(str(exc))

    async def _uploaded(self, entry: StagedFile, job: UploadJob, info: ObjectInfo) -> None:
        self._m.uploads.labels(job.cls, "ok").inc()
        self._m.uploaded_bytes.labels(job.cls).inc(job.size)
        if job.unsynced_since is not None:
            self._m.sync_lag.labels(job.cls).observe(time.time() - job.unsynced_since)
        entry.synced = max(entry.synced, job.generation)
        entry.failures, entry.last_error, entry.next_try = 0, "", 0.0
        entry.remote = True
        entry.unsynced_since = entry.dirty_since
        entry.wake_waiters(None, up_to=job.generation)
        if entry.synced == entry.generation and entry.writers == 0 and not entry.deleted:
            await self._retire(entry, info)

    async def _retire(self, entry: StagedFile, info: ObjectInfo) -> None:
        """The store has this exact content: drop the record, then the staging file."""
        if self._files.get(entry.path) is entry:
            del self._files[entry.path]
        self.staged_bytes -= entry.size
        entry.deleted = True
        self.retired(entry, info)
        fd, entry.fd = entry.fd, -1
        async with entry.record_lock:
            await self._guard.forget(entry.id, fd)

    # ---- pending operations (tombstones, directory markers) -------------------------------------
    async def _run_op(self, op: PendingOp) -> None:
        record = op.record
        action = {DELETE: self.store.delete, MKDIR: self.store.make_dir, RMDIR: self.store.remove_dir}[record.kind]
        try:
            await trio.to_thread.run_sync(action, record.path, limiter=self._uploader.limiters[LOG])
        except StoreError as exc:
            op.failures += 1
            op.last_error = str(exc)
            op.next_try = _backoff(op.failures)
            log.log(logging.WARNING if op.failures == 1 else logging.INFO,
                    "%s of %s failed (retried): %s", record.kind, record.path, exc)
        else:
            if self._ops.get(record.slot) is op:
                del self._ops[record.slot]
            await self._guard.remove_record(record.id)
        finally:
            op.running = False
            self._busy.discard(op.key)
            self._notify()

    async def _add_op(self, kind: str, path: str) -> None:
        """Journal a tombstone or a directory marker change for ``path`` (replaces the slot's pending one)."""
        self._guard.check()
        seq = self.journal.next_seq()
        record = Record(seq, seq, kind, path, time.time())
        self._cancel_op(record.slot)
        op = self._ops[record.slot] = PendingOp(record)
        try:
            await self._guard.write_record(record)
        except OSError:
            if self._ops.get(record.slot) is op:
                del self._ops[record.slot]
            raise
        op.ready = True
        if op.cancelled:
            await self._guard.remove_record(record.id)
        self.wake()

    async def delete(self, path: str) -> None:
        """The object ``path`` must go (a journaled tombstone)."""
        await self._add_op(DELETE, path)

    async def make_dir(self, path: str) -> None:
        """The directory marker ``path/`` must exist."""
        await self._add_op(MKDIR, path)

    async def remove_dir(self, path: str) -> None:
        """The directory marker ``path/`` must not exist."""
        await self._add_op(RMDIR, path)

    def _may_exist(self, path: str) -> bool:
        """An object may come to be at ``path`` whatever the listing says: an upload of it is on
        its way (a superseded one still lands), or its tombstone has not run."""
        return path in self._busy or (False, path) in self._ops

    def cancel_delete(self, path: str) -> None:
        """A pending tombstone of ``path`` is moot (something new lives there)."""
        self._cancel_op((False, path))

    def _cancel_op(self, slot: tuple[bool, str]) -> None:
        """Forget a pending operation that a newer one supersedes (a running one finishes)."""
        op = self._ops.get(slot)
        if op is None or op.running:
            return
        del self._ops[slot]
        op.cancelled = True
        if op.ready:
            self._nursery.start_soon(self._guard.remove_record, op.record.id)

    # ---- staged files (called by the namespace) --------------------------------------------------
    def _new_entry(self, path: str, *, remote: bool) -> StagedFile:
        self._guard.check()
        seq = self.journal.next_seq()
        fd = self.journal.create_data(seq)
        return StagedFile(Record(seq, seq, FILE, path, time.time(), sealed=0), fd, 0, time.time(), remote=remote)

    async def _register(self, entry: StagedFile) -> None:
        """Journal ``entry`` and make it the file at its path (replacing any staged one)."""
        old = self._files.get(entry.path)
        entry.remote = entry.remote or self._may_exist(entry.path) or (old is not None and old.remote)
        self._files[entry.path] = entry
        self.staged_bytes += entry.size
        self.cancel_delete(entry.path)
        try:     # the new record first (its larger seq wins at replay): a crash keeps the old file
            await self._guard.write_record(entry.record)
        except OSError:
            if old is not None and self._files.get(entry.path) is entry:
                self._files[entry.path] = old
            await self._discard(entry)      # never acknowledged: its staging file goes (if it can)
            raise
        if old is not None:
            await self._discard(old)
        entry.ready = True
        self.wake()

    async def create(self, path: str, *, remote: bool) -> StagedFile:
        """A new empty staged file at ``path``; ``remote``: an object may exist there."""
        entry = self._new_entry(path, remote=remote)
        await self._register(entry)
        return entry

    async def copy_up(self, path: str, etag: str, size: int) -> StagedFile:
        """Stage the object ``path`` (version ``etag``) to modify it; concurrent callers share one copy."""
        staged = self._files.get(path)
        if staged is not None:
            return staged
        return await self._copyups.do(path, lambda: self._copy_up(path, etag, size))

    async def _copy_up(self, path: str, etag: str, size: int) -> StagedFile:
        await self.reserve(None, size)
        entry = self._new_entry(path, remote=True)
        try:
            for start in range(0, size, _COPY_CHUNK):
                end = min(size, start + _COPY_CHUNK)
                data = await self.store.get_async(path, start, end, etag, size,
                                                  limiter=self._uploader.limiters[LOG])
                pwrite_all(entry.fd, data, start)     # a full disk writes short before ENOSPC
            # durable before its record: a power cut (or a cache dir failing) must not leave a
            # record naming a copy whose pages were lost, which replay would upload over the object
            await trio.to_thread.run_sync(self.journal.sync_data, entry.fd, limiter=self._io)
        except BaseException:
            os.close(entry.fd)
            self.journal.remove_data(entry.id)
            raise
        entry.size = size
        entry.record = dataclasses.replace(entry.record, sealed=size)
        entry.dirty_since = entry.unsynced_since = None    # the store has this content
        entry.generation = entry.synced = 1
        await self._register(entry)
        return entry

    def read(self, entry: StagedFile, offset: int, size: int) -> bytes:
        end = min(offset + size, entry.size)
        return os.pread(entry.fd, end - offset, offset) if end > offset else b""

    async def write(self, entry: StagedFile, offset: int, data: bytes) -> int:
        self._guard.check()
        if not data:
            return 0        # changes nothing (a size past EOF would exceed the staging file's)
        await self.reserve(entry, offset + len(data))
        try:
            self.journal.write_data(entry.id, entry.fd, data, offset, entry.size)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            await self._wait_for_space(lambda: False)    # the staging disk itself is full
            self.journal.write_data(entry.id, entry.fd, data, offset, entry.size)
        self._resize(entry, max(entry.size, offset + len(data)))
        entry.touch(offset, time.time())
        return len(data)

    async def truncate(self, entry: StagedFile, size: int) -> None:
        self._guard.check()
        entry.truncations += 1
        await self.reserve(entry, size)
        if entry.record.sealed is not None and size < entry.record.sealed:
            await self._seal(entry, size)     # before the cut: a lost regrowth must not pass for sealed
        if entry.deleted:
            raise Superseded(f"{entry.path} was retired while its truncate waited")
        os.ftruncate(entry.fd, size)
        self._resize(entry, size)
        entry.touch(size, time.time())

    def set_mtime(self, entry: StagedFile, mtime: float) -> None:
        """``utimes`` on a staged file (the store's LastModified wins after the upload)."""
        entry.mtime = mtime

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
        self.request_sync(retry_failed=False)       # a failing upload keeps its backoff (no busy loop)
        with trio.move_on_after(self.staging_wait):
            while not fits():
                await self._changed.wait()
                if not fits():
                    self.request_sync(retry_failed=False)
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
                await self._retire_clean(entry)
            self.wake()

    async def _retire_clean(self, entry: StagedFile) -> None:
        """A copy-up never written, or a file uploaded while open: HEAD for its ETag, then retire."""
        try:
            info = await trio.to_thread.run_sync(self.store.head, entry.path,
                                                 limiter=self._uploader.limiters[LOG])
        except StoreError:
            return     # stays staged; harmless
        if entry.synced == entry.generation and entry.writers == 0 and entry.uploading is None \
                and not entry.deleted and info.size == entry.size:
            await self._retire(entry, info)

    async def fsync(self, entry: StagedFile, *, remote: bool) -> None:
        size, truncations = entry.size, entry.truncations
        fd = os.dup(entry.fd)
        try:
            await trio.to_thread.run_sync(self.journal.sync_data, fd, limiter=self._io)
        finally:
            os.close(fd)
        if entry.truncations == truncations and entry.record.sealed != size:
            await self._seal(entry, size)
        if remote and entry.synced < entry.generation:
            waiter = Waiter(entry.generation)
            entry.waiters.append(waiter)
            entry.make_urgent(time.time())
            self.wake()
            await waiter.event.wait()
            if waiter.error is not None:
                raise OSError(errno.EIO, f"upload failed (the file stays staged): {waiter.error}")

    async def _seal(self, entry: StagedFile, size: int) -> None:
        """Journal that ``[0, size)`` of ``entry``'s staging file is durable (journal step 2)."""
        async with entry.record_lock:
            if entry.deleted:
                return
            before, entry.record = entry.record.sealed, dataclasses.replace(entry.record, sealed=size)
            try:
                await self._guard.write_record(entry.record, fence=False)   # a full disk: ENOSPC, not fenced
            except OSError:
                entry.record = dataclasses.replace(entry.record, sealed=before)   # (a rename may have replaced it)
                raise

    async def unlink(self, entry: StagedFile) -> None:
        """The staged file's name is gone: journal a tombstone if an object may exist, else remove
        its record, which is what makes this unlink durable (if that fails: EROFS, nothing changed;
        bug 8 in docs/reliability.md; the path is busy meanwhile, so no upload of it starts). Then
        drop the rest."""
        self._guard.check()
        if entry.remote or entry.uploading is not None:
            await self.delete(entry.path)
        else:
            hold = entry.path not in self._busy
            self._busy.add(entry.path)
            try:
                async with entry.record_lock:
                    await self._guard.remove_record(entry.id, required=True)
            finally:
                if hold:
                    self._busy.discard(entry.path)
        await self._discard(entry)

    async def _discard(self, entry: StagedFile) -> None:
        if self._files.get(entry.path) is entry:
            del self._files[entry.path]
        if not entry.deleted:
            self.staged_bytes -= entry.size
        entry.deleted = True
        if entry.uploading is not None:
            entry.uploading.cancelled = True
        entry.wake_waiters("the file was deleted")
        fd = -1
        if entry.opens <= 0:
            fd, entry.fd = entry.fd, -1
        async with entry.record_lock:     # no seal write resurrects the record
            await self._guard.forget(entry.id, fd)
        self._notify()

    async def move(self, entry: StagedFile, new_path: str, *, replaces_object: bool) -> None:
        """Rename a staged file; ``replaces_object``: an object exists at ``new_path``."""
        self._guard.check()
        old_path, had_object = entry.path, entry.remote or entry.uploading is not None
        other = self._files.get(new_path)
        other = other if other is not entry else None
        replaces_object = replaces_object or self._may_exist(new_path)
        if other is not None:
            replaces_object = replaces_object or other.remote
            if other.uploading is not None:
                other.uploading.cancelled = True
        self._files.pop(old_path, None)
        self.cancel_delete(new_path)
        seq = self.journal.next_seq()
        entry.record = Record(entry.id, seq, FILE, new_path, entry.record.created, entry.record.sealed)
        self._files[new_path] = entry
        entry.remote = replaces_object
        entry.synced = 0
        entry.touch(0, time.time())
        async with entry.record_lock:     # before the replaced file goes: a crash keeps one of them
            await self._guard.write_record(entry.record)
        if other is not None:
            await self._discard(other)
        if had_object:
            await self.delete(old_path)
        self.wake()

    # ---- control: sync, drain, status ----------------------------------------------------------
    def request_sync(self, cls: str | None = None, *, retry_failed: bool = True) -> None:
        """Make every unsynced file of ``cls`` (all when None) due now; failing ones too if ``retry_failed``."""
        now = time.time()
        for entry in self._files.values():
            if entry.dirty and (cls is None or self.policy.classify(entry.path, entry.size) == cls):
                entry.make_urgent(now, retry_failed)
        if cls in (None, LOG):
            for op in self._ops.values():
                op.next_try = 0.0 if retry_failed or not op.failures else op.next_try
        self.wake()

    def pending(self, cls: str | None = None) -> dict:
        return _status.pending(self._files.values(), self._ops.values(), self.policy, cls)

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
        pending = self.pending()
        return {"classes": _status.by_class(self._files.values(), self.policy), "staged_files": len(self._files),
                "staged_bytes": self.staged_bytes, "staging_size": self.staging_size,
                "pending_operations": pending["operations"], "failing": pending["failing"],
                "errors": pending["errors"], "fenced": self._guard.reason or None}

    def _update_gauges(self, now: float) -> None:
        _status.update_gauges(self._m, self.status())
