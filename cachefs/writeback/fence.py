"""The journal's I/O as the write-back engine calls it, with a failing cache dir handled in one
place (bug 2 in docs/reliability.md): a record write or removal that fails (the filesystem
turned read-only, an I/O error) is counted and logged, and *fences* the staging area: new
writes get EROFS from then on, while reads and uploads of what is staged go on. A record
whose removal failed stays on disk, and from then on no record is removed; the next start
replays them (an upload or delete again: idempotent). Nothing here raises into the engine's
nursery but the EROFS of ``write_record`` and of a required ``remove_record``, which reaches
the FUSE call that asked for the change.
"""

import errno
import logging
import os
from collections.abc import Callable

import trio

from cachefs.writeback.journal import Journal, Record
from cachefs.writeback.metrics import WritebackMetrics

log = logging.getLogger(__name__)


class JournalGuard:
    def __init__(self, journal: Journal, limiter: trio.CapacityLimiter, metrics: WritebackMetrics,
                 barrier: Callable[[], None]) -> None:
        self.journal = journal
        self.reason = ""        # why the staging area takes no more writes ("": it does)
        self._limiter = limiter
        self.barrier = barrier  # blocking; made durable before a record goes (a Port: cachefs/ports.py)
        self._errors = metrics.journal_errors
        self.kept_aside = metrics.kept_aside

    async def replay(self) -> list[Record]:
        """The journal's replay at start (it notes this run's identity); counts what it kept aside."""
        records = await trio.to_thread.run_sync(self.journal.replay)
        self.kept_aside.inc(self.journal.lost_found)
        return records

    def check(self) -> None:
        """Raise EROFS once the staging area is fenced."""
        if self.reason:
            raise OSError(errno.EROFS, f"staging area fenced off ({self.reason})")

    async def write_record(self, record: Record, *, fence: bool = True) -> None:
        """Journal ``record``; on failure fence the staging area and raise EROFS. ``fence=False``
        (a seal): a full disk raises ENOSPC instead (the old record stays) and fences nothing."""
        self.check()
        try:
            await trio.to_thread.run_sync(self.journal.write_record, record, limiter=self._limiter)
        except OSError as exc:
            if not fence and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            self.failed(f"writing the record of {record.path}", exc)
            self.check()

    async def remove_record(self, ident: int, *, required: bool = False) -> None:
        """Remove a record. ``required``: the removal is itself the change asked for (the unlink
        of a file never uploaded), so it is refused once fenced, and a failure fences the staging
        area and raises EROFS, as ``write_record``'s does."""
        if required:
            self.check()
        elif self.reason:
            return          # fenced: nothing is removed any more (see ``forget``)

        def remove() -> None:
            self.barrier()
            self.journal.remove_record(ident)
        try:
            await trio.to_thread.run_sync(remove, limiter=self._limiter)
        except OSError as exc:
            self.failed(f"removing record {ident:016x}", exc)
            if required:
                self.check()

    async def forget(self, ident: int, fd: int) -> None:
        """Remove a record, then its staging file, and close ``fd`` (unless -1); a failed
        removal leaves both (the record first: a record never outlives its data).

        Once the staging area is fenced, nothing is removed: a replay keeps only the newest
        record of a path, so a removal that works after one that failed (a transient error)
        could leave an old record (a tombstone) to outlive a newer one and undo it."""
        if self.reason:
            if fd >= 0:
                os.close(fd)
            return

        def remove() -> OSError | None:
            try:
                self.barrier()
                self.journal.remove_record(ident)
                self.journal.remove_data(ident)
            except OSError as exc:
                return exc
            finally:
                if fd >= 0:
                    os.close(fd)
            return None
        exc = await trio.to_thread.run_sync(remove, limiter=self._limiter)
        if exc is not None:
            self.failed(f"removing record {ident:016x}", exc)

    async def note_upload(self, path: str, upload_id: str) -> int | None:
        """Note an open multipart upload (journal step 7); None if the note could not be written
        (the upload goes on: only a crash before it completes would leave it open)."""
        ident = self.journal.next_seq()
        try:
            await trio.to_thread.run_sync(self.journal.note_upload, ident, path, upload_id, limiter=self._limiter)
        except OSError as exc:
            self.failed(f"noting the multipart upload of {path}", exc)
            return None
        return ident

    async def clear_upload(self, ident: int | None) -> None:
        if ident is None:
            return
        try:
            await trio.to_thread.run_sync(self.journal.clear_upload, ident, limiter=self._limiter)
        except OSError as exc:
            self.failed(f"clearing upload note {ident:016x}", exc)     # the next start aborts it: a no-op

    def failed(self, what: str, exc: OSError) -> None:
        self._errors.inc()
        if self.reason:
            log.info("journal: %s failed too: %s", what, exc)
            return
        self.reason = f"{what} failed: {exc.strerror or exc}"
        log.error("journal: %s; the staging area %s is fenced off: writes fail with EROFS, reads go on, "
                  "what is staged stays in the journal for the next mount", self.reason, self.journal.root)
