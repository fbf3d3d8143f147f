"""A cache dir that fails under the journal (bug 2 in docs/reliability.md), kernel-free: a record
removal that fails (EROFS) leaves the record for the next start, is counted, and fences the staging
area (writes get EROFS); the engine keeps running, reads and uploads go on."""

import errno
import os
import threading

import pytest
import trio
from kernel_free import Driver, counted, make_stack, oserror, running, stored, until
from memory_stores import MemoryBucket

from cachefs.metrics import Metrics
from cachefs.writeback.journal import Journal

pytestmark = pytest.mark.allow_warnings      # the fence is logged as an error, once


@pytest.fixture
def bucket():
    bucket = MemoryBucket()
    bucket.put("old.txt", b"old content")
    yield bucket
    bucket.remove()


def read_only(journal: Journal) -> None:
    """The journal's filesystem turned read-only: every change to it fails with EROFS."""
    def refuse(*args):
        raise OSError(errno.EROFS, "Read-only file system")
    journal.remove_record = journal.remove_data = journal.write_record = refuse


def test_failed_record_removal_fences_the_staging_area_and_keeps_the_record(bucket, tmp_path):
    store = counted(bucket)
    metrics = Metrics()
    vfs, wb = make_stack(store, str(tmp_path), metrics=metrics)

    async def main():
        async with running(vfs, wb):
            fs = Driver(vfs)
            assert await fs.call("write_at", "a.log", os.O_CREAT, 0, b"staged then uploaded") == 20
            await fs.call("unlink", "old.txt")                       # a tombstone, run below
            read_only(wb.journal)
            wb.request_sync()
            assert await wb.wait_synced(None, 5)                      # uploads and deletes go on
            assert stored(store, "a.log") == b"staged then uploaded"
            assert not bucket.fs.exists(f"{bucket.url}/old.txt")
            assert await fs.call("read_all", "a.log") == b"staged then uploaded"   # reads go on
            assert wb.status()["fenced"] and "Read-only" in wb.status()["fenced"]
            for call in (fs.call("write_at", "b.log", os.O_CREAT, 0, b"x"),
                         fs.call("write_at", "a.log", 0, 0, b"y"), fs.call("mkdir", "d"),
                         fs.call("unlink", "a.log")):
                assert await oserror(call) == errno.EROFS
            assert await fs.call("read_all", "a.log") == b"staged then uploaded"
            await trio.sleep(0.3)                                     # the scheduler is still alive
            assert await fs.call("listdir", "") == ["a.log"]
    trio.run(main)
    assert metrics.counter_value("cachefs_journal_errors_total") >= 1     # once fenced, no removal is tried
    # the records stay: the next start uploads a.log again and deletes old.txt again (idempotent)
    assert sorted((r.kind, r.path) for r in Journal(str(tmp_path)).replay()) == [
        ("delete", "old.txt"), ("file", "a.log")]


def test_an_unlink_that_cannot_remove_its_record_fails_and_changes_nothing(bucket, tmp_path):
    """A file never uploaded is unlinked by removing its record. If the cache dir turned
    read-only just then, the unlink must fail (EROFS) and leave the file: acknowledging it would
    lose it at the next start, whose replay of the record brings the file back (found by the crash
    campaign's read-only variant: 'ckpt/c1.pt: holds ..., acknowledged None')."""
    store = counted(bucket)
    vfs, wb = make_stack(store, str(tmp_path))

    async def main():
        async with running(vfs, wb):
            fs = Driver(vfs)
            assert await fs.call("write_at", "c.pt", os.O_CREAT, 0, b"staged, never uploaded") == 22
            read_only(wb.journal)
            assert await oserror(fs.call("unlink", "c.pt")) == errno.EROFS
            assert await fs.call("listdir", "") == ["c.pt", "old.txt"]
            assert await fs.call("read_all", "c.pt") == b"staged, never uploaded"
            assert wb.status()["fenced"]
    trio.run(main)
    assert not bucket.fs.exists(f"{bucket.url}/c.pt")
    # what this run still shows is what the next start shows: the record is there
    assert [(r.kind, r.path) for r in Journal(str(tmp_path)).replay()] == [("file", "c.pt")]


def test_an_unlink_of_a_file_never_uploaded_removes_its_record_before_it_returns(bucket, tmp_path):
    store = counted(bucket)
    vfs, wb = make_stack(store, str(tmp_path))

    async def main():
        async with running(vfs, wb):
            fs = Driver(vfs)
            await fs.call("write_at", "c.pt", os.O_CREAT, 0, b"staged, never uploaded")
            await fs.call("unlink", "c.pt")
            assert Journal(str(tmp_path)).replay() == []          # a crash now loses nothing acknowledged
            assert await fs.call("listdir", "") == ["old.txt"]
            wb.request_sync()
            assert await wb.wait_synced(None, 5)
            assert not wb.status()["fenced"]
    trio.run(main)
    assert not bucket.fs.exists(f"{bucket.url}/c.pt")


def test_once_fenced_no_record_goes_so_an_old_tombstone_never_outlives_a_newer_file(bucket, tmp_path):
    """A transient journal error: the removal of a cancelled tombstone fails once, and later
    removals would work. The newer file's record must not go after its upload while the
    tombstone's stays, or the next start would replay the delete over the acknowledged file."""
    store = counted(bucket)
    vfs, wb = make_stack(store, str(tmp_path))

    async def main():
        async with running(vfs, wb):
            fs = Driver(vfs)
            await fs.call("unlink", "old.txt")
            assert wb.pending()["operations"] == 1                # the tombstone waits for its period
            real, failed, written = wb.journal.remove_record, [], threading.Event()

            def fails_once(ident):             # in a worker thread: fails after the write below
                if not failed:
                    assert written.wait(5)
                    failed.append(ident)
                    raise OSError(errno.EIO, "Input/output error")
                real(ident)
            wb.journal.remove_record = fails_once
            assert await fs.call("write_at", "old.txt", os.O_CREAT, 0, b"new content") == 11   # cancels it
            written.set()
            await until(lambda: failed and wb.status()["fenced"])
            wb.request_sync()
            assert await wb.wait_synced(None, 5)
            assert stored(store, "old.txt") == b"new content"
    trio.run(main)
    assert [(r.kind, r.path) for r in Journal(str(tmp_path)).replay()] == [("file", "old.txt")]
