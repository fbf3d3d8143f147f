"""Uploading one version of one staged file: a single PUT up to ``part_size``, a parallel
multipart upload above it (aborted on any failure or supersession, so an object appears only
complete). Log uploads go first: a checkpoint part starts only when no log upload runs.

A multipart upload's id is noted in the journal before its first part and the note cleared once
it is completed or aborted; ``abort_orphans`` aborts at start what a crash left open
(journal step 7), so no upload stays open, and billed, in the bucket.

``upload`` returns the object's ``ObjectInfo`` or raises ``Superseded`` (the file changed below
the uploaded size, moved or vanished: nothing was made visible), ``StoreError`` or ``OSError``.
Worker threads read the job's own descriptor and call the store; nothing shared is touched
off the trio thread.
"""

import logging

import trio

from cachefs.errors import StoreError
from cachefs.store import ObjectInfo, ObjectStore
from cachefs.writeback.fence import JournalGuard
from cachefs.writeback.policy import CHECKPOINT, LOG, part_size_for
from cachefs.writeback.staged import StagedFile, Superseded, UploadJob, pread_all

log = logging.getLogger(__name__)

LOG_PRIORITY_WAIT = 1.0


class Uploader:
    def __init__(self, store: ObjectStore, journal: JournalGuard, *, part_size: int, upload_concurrency: int,
                 log_concurrency: int) -> None:
        self.store = store
        self.journal = journal
        self.part_size = part_size
        self.limiters = {LOG: trio.CapacityLimiter(log_concurrency),
                         CHECKPOINT: trio.CapacityLimiter(upload_concurrency)}
        self._log_uploads = 0                       # log-class uploads in flight: checkpoint parts wait
        self._logs_idle = trio.Event()
        self._logs_idle.set()

    async def upload(self, entry: StagedFile, job: UploadJob) -> ObjectInfo:
        if job.cls == LOG:
            self._log_started()
        try:
            if job.size <= self.part_size:
                return await self._put_whole(entry, job)
            return await self._put_multipart(entry, job)
        finally:
            if job.cls == LOG:
                self._log_finished()

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
        ``LOG_PRIORITY_WAIT``, so a slow or failing log upload cannot stall a checkpoint."""
        with trio.move_on_after(LOG_PRIORITY_WAIT):
            await self._logs_idle.wait()

    async def _put_whole(self, entry: StagedFile, job: UploadJob) -> ObjectInfo:
        limiter = self.limiters[job.cls]
        try:
            data = await trio.to_thread.run_sync(pread_all, job.fd, job.size, limiter=limiter)
        except OSError:
            entry.check(job)        # cut short by a truncate: superseded, not a failure
            raise
        entry.check(job)
        return await trio.to_thread.run_sync(self.store.put, job.path, data, limiter=limiter)

    async def _put_multipart(self, entry: StagedFile, job: UploadJob) -> ObjectInfo:
        limiter = self.limiters[job.cls]
        upload_id = await trio.to_thread.run_sync(self.store.start_upload, job.path, limiter=limiter)
        note = await self.journal.note_upload(job.path, upload_id)     # before the first part
        try:
            parts = await self._send_parts(entry, job, upload_id, limiter)
            entry.check(job)
            info = await trio.to_thread.run_sync(self.store.finish_upload, job.path, upload_id, parts, job.size,
                                                 limiter=limiter)
        except BaseException:
            if await self._abort(job.path, upload_id):
                with trio.CancelScope(shield=True):
                    await self.journal.clear_upload(note)
            raise
        await self.journal.clear_upload(note)
        return info

    async def _abort(self, path: str, upload_id: str) -> bool:
        with trio.move_on_after(30, shield=True):
            try:
                await trio.to_thread.run_sync(self.store.abort_upload, path, upload_id)
                return True
            except StoreError as exc:
                log.info("abort of an upload of %s failed (invisible; the next start aborts it again): %s",
                         path, exc)
        return False

    async def abort_orphans(self, uploads: list[tuple[int, str, str]]) -> None:
        """Abort the multipart uploads a crash left open (noted, never cleared); a failed abort
        keeps its note for the next start."""
        for ident, path, upload_id in uploads:
            if await self._abort(path, upload_id):
                log.info("aborted a multipart upload of %s left open by the last run", path)
                await self.journal.clear_upload(ident)

    async def _send_parts(self, entry: StagedFile, job: UploadJob, upload_id: str,
                          limiter: trio.CapacityLimiter) -> list[tuple[int, str]]:
        part_size = part_size_for(job.size, self.part_size)
        count = (job.size + part_size - 1) // part_size
        etags: list[str | None] = [None] * count
        errors: list[BaseException] = []

        def send(number: int) -> str:
            start = (number - 1) * part_size
            data = pread_all(job.fd, min(part_size, job.size - start), start)
            return self.store.upload_part(job.path, upload_id, number, data)

        async def part(index: int) -> None:
            try:
                async with limiter:
                    await self._logs_first()
                    entry.check(job)
                    etags[index] = await trio.to_thread.run_sync(send, index + 1)
            except (Superseded, StoreError, OSError) as exc:
                # a short read of a file truncated under the upload: superseded, not a failure
                errors.append(Superseded(job.path) if isinstance(exc, OSError) and entry.changed(job) else exc)
                job.cancelled = True

        async with trio.open_nursery() as nursery:
            for index in range(count):
                nursery.start_soon(part, index)
        failures = [e for e in errors if not isinstance(e, Superseded)]
        if errors:
            raise (failures or errors)[0]
        return [(i + 1, etag) for i, etag in enumerate(etags)]
