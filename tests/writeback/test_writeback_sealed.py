"""What replay may upload after a stop that lost the staging filesystem's unsynced pages (crash
campaign, cache dir turning read-only), and two ways a staged file's size outran its staging file:

- a file record carries ``sealed`` (the size its last fsync made durable); after a stop on another
  boot or another mount of the staging filesystem, only ``[0, sealed)`` is trusted: the rest is kept
  in ``staging/lost+found`` and counted, never uploaded; after a plain SIGKILL (same boot, same
  mount: the page cache survived) the whole file is uploaded, as before;
- a copy-up on a nearly full disk wrote short (``pwrite`` returns less before it raises ENOSPC), and
  the record named a truncated copy that replay uploaded over the object;
- a truncate during an upload is a superseded upload (no failure, no warning), and a zero-length
  write past the end does not grow the file (the kernel-free fuzz's "staging file shorter" loop).
"""

import errno
import json
import os

import pytest
import trio
from kernel_free import Driver, counted, make_policy, make_stack, running, stored
from memory_stores import MemoryBucket

from cachefs.metrics import Metrics
from cachefs.writeback import uploader

FSYNCED = b"fsynced record\n" * 300
LATER = b"written, never fsynced\n" * 300


def _crash_after_unsynced_write(tmp_path, bucket) -> str:
    """A daemon writes ``FSYNCED``, fsyncs, writes ``LATER`` and stops before uploading (the
    policy's periods are long); returns the staging dir."""
    staging = str(tmp_path / "staging")
    vfs, wb = make_stack(counted(bucket), staging)

    async def main():
        async with running(vfs, wb):
            fs = Driver(vfs)
            fh = await fs.call("open", "run.log", os.O_WRONLY | os.O_CREAT)
            await fs.call("pwrite", fh, FSYNCED, 0)
            await fs.call("fsync", fh)
            await fs.call("pwrite", fh, LATER, len(FSYNCED))
            await fs.call("close", fh)
    trio.run(main)
    return staging


def _restart_and_sync(bucket, staging: str) -> tuple[bytes, Metrics]:
    metrics = Metrics()
    store = counted(bucket)
    vfs, wb = make_stack(store, staging, metrics=metrics)

    async def main():
        async with running(vfs, wb):
            wb.request_sync()
            assert await wb.wait_synced(None, 10), wb.pending()
    trio.run(main)
    return stored(store, "run.log"), metrics


def _data_file(staging: str) -> str:
    names = os.listdir(os.path.join(staging, "data"))
    assert len(names) == 1
    return os.path.join(staging, "data", names[0])


@pytest.mark.allow_warnings      # the replay's one warning line about what it kept aside
def test_after_lost_pages_replay_uploads_only_what_was_fsynced(tmp_path):
    bucket = MemoryBucket()
    try:
        staging = _crash_after_unsynced_write(tmp_path, bucket)
        # the staging filesystem failed and was mounted again: the unsynced pages read as zeros
        with open(_data_file(staging), "r+b") as fh:
            fh.seek(len(FSYNCED))
            fh.write(bytes(len(LATER)))
        run = os.path.join(staging, "run.json")
        identity = json.loads(open(run).read())
        with open(run, "w") as fh:
            json.dump({**identity, "mount": identity["mount"] + 1}, fh)
        data, metrics = _restart_and_sync(bucket, staging)
        assert data == FSYNCED                       # never the zeros nobody wrote
        kept = os.listdir(os.path.join(staging, "lost+found"))
        assert len(kept) == 1 and kept[0].endswith("run.log")
        assert open(os.path.join(staging, "lost+found", kept[0]), "rb").read() == FSYNCED + bytes(len(LATER))
        assert metrics.registry.get_sample_value("cachefs_staged_kept_aside_total") == 1
    finally:
        bucket.remove()


def test_after_a_plain_sigkill_unsynced_writes_still_reach_the_bucket(tmp_path):
    bucket = MemoryBucket()
    try:
        staging = _crash_after_unsynced_write(tmp_path, bucket)    # same boot, same mount
        data, metrics = _restart_and_sync(bucket, staging)
        assert data == FSYNCED + LATER
        assert not os.path.exists(os.path.join(staging, "lost+found"))
    finally:
        bucket.remove()


@pytest.mark.allow_warnings
def test_truncate_below_the_seal_is_journaled_before_the_cut(tmp_path):
    """O_TRUNC then a rewrite of the same size, never fsynced, then lost pages: the size matches
    the old seal, but the seal was lowered to 0 before the cut, so nothing unsealed is uploaded."""
    bucket = MemoryBucket()
    staging = str(tmp_path / "staging")
    try:
        vfs, wb = make_stack(counted(bucket), staging)

        async def main():
            async with running(vfs, wb):
                fs = Driver(vfs)
                fh = await fs.call("open", "run.log", os.O_WRONLY | os.O_CREAT)
                await fs.call("pwrite", fh, FSYNCED, 0)
                await fs.call("fsync", fh)
                await fs.call("close", fh)
                await fs.call("write_at", "run.log", os.O_TRUNC, 0, b"y" * len(FSYNCED))
        trio.run(main)
        with open(_data_file(staging), "r+b") as fh:
            fh.write(bytes(len(FSYNCED)))                 # the rewrite's pages were lost
        run = os.path.join(staging, "run.json")
        identity = json.loads(open(run).read())
        with open(run, "w") as fh:
            json.dump({**identity, "boot": "another boot"}, fh)
        data, _ = _restart_and_sync(bucket, staging)
        assert data == b""
    finally:
        bucket.remove()


def test_copy_up_on_a_nearly_full_disk_never_records_a_short_copy(tmp_path, monkeypatch):
    bucket = MemoryBucket()
    content = bytes(range(256)) * 400
    bucket.put("ckpt.pt", content)
    real_pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: real_pwrite(fd, bytes(data[:4096]), offset))
    try:
        store = counted(bucket)
        vfs, wb = make_stack(store, str(tmp_path / "staging"))

        async def main():
            async with running(vfs, wb):
                fs = Driver(vfs)
                await fs.call("write_at", "ckpt.pt", 0, 0, b"HEAD")        # a copy-up, then an in-place write
                assert os.path.getsize(_data_file(str(tmp_path / "staging"))) == len(content)
                wb.request_sync()
                assert await wb.wait_synced(None, 10), wb.pending()
        trio.run(main)
        assert stored(store, "ckpt.pt") == b"HEAD" + content[4:]
    finally:
        bucket.remove()


def test_truncate_during_an_upload_supersedes_it(tmp_path, monkeypatch):
    """The upload took ``job.size``, then the file was cut: its short read is a superseded upload
    (no failure, no warning: the autouse fixture fails the test on one, no backoff), and the new
    content is uploaded when due."""
    bucket = MemoryBucket()
    reached, release = trio.Event(), trio.Event()
    token = {}
    real_pread_all = uploader.pread_all

    def pread_all(fd, size, offset=0):
        trio.from_thread.run_sync(reached.set, trio_token=token["t"])
        trio.from_thread.run(release.wait, trio_token=token["t"])
        return real_pread_all(fd, size, offset)
    monkeypatch.setattr(uploader, "pread_all", pread_all)
    metrics = Metrics()
    try:
        store = counted(bucket)
        vfs, wb = make_stack(store, str(tmp_path / "staging"), metrics=metrics,
                             policy=make_policy(log_period=0.1, quiet=0.1, checkpoint=0.1))

        async def main():
            token["t"] = trio.lowlevel.current_trio_token()
            async with running(vfs, wb):
                fs = Driver(vfs)
                await fs.call("write_at", "a.log", os.O_CREAT, 0, b"0123456789")
                wb.request_sync()
                await reached.wait()                      # the upload took size 10
                monkeypatch.setattr(uploader, "pread_all", real_pread_all)
                await fs.call("truncate", "a.log", 2)
                release.set()
                assert await wb.wait_synced(None, 10), wb.pending()
        trio.run(main)
        assert stored(store, "a.log") == b"01"
        assert metrics.registry.get_sample_value("cachefs_uploads_total", {"sync_class": "log",
                                                                           "result": "superseded"}) == 1
        assert metrics.registry.get_sample_value("cachefs_uploads_total", {"sync_class": "log",
                                                                           "result": "failed"}) is None
    finally:
        bucket.remove()


def test_zero_length_write_past_the_end_does_not_grow_the_file(tmp_path):
    bucket = MemoryBucket()
    try:
        store = counted(bucket)
        vfs, wb = make_stack(store, str(tmp_path / "staging"))

        async def main():
            async with running(vfs, wb):
                fs = Driver(vfs)
                assert await fs.call("write_at", "a.log", os.O_CREAT, 2, b"") == 0
                assert await fs.call("kind_and_size", "a.log") == ("file", 0)
                wb.request_sync()
                assert await wb.wait_synced(None, 10), wb.pending()
        trio.run(main)
        assert stored(store, "a.log") == b""
    finally:
        bucket.remove()


def test_a_seal_on_a_full_disk_fails_the_fsync_and_fences_nothing(tmp_path):
    bucket = MemoryBucket()
    bucket.put("other.bin", b"x")         # (an empty bucket cannot be removed)
    staging = str(tmp_path / "staging")
    try:
        vfs, wb = make_stack(counted(bucket), staging)
        real_write_record = wb.journal.write_record

        def full_disk(record):
            raise OSError(errno.ENOSPC, "No space left on device")

        async def main():
            async with running(vfs, wb):
                fs = Driver(vfs)
                fh = await fs.call("open", "run.log", os.O_WRONLY | os.O_CREAT)
                await fs.call("pwrite", fh, FSYNCED, 0)
                wb.journal.write_record = full_disk
                with pytest.raises(OSError) as info:
                    await fs.call("fsync", fh)
                assert info.value.errno == errno.ENOSPC      # not acknowledged
                wb.journal.write_record = real_write_record
                assert wb.status()["fenced"] is None          # writes go on
                await fs.call("pwrite", fh, LATER, len(FSYNCED))
                await fs.call("fsync", fh)
                await fs.call("close", fh)
        trio.run(main)
        records = [json.loads(open(os.path.join(staging, "records", n)).read())
                   for n in os.listdir(os.path.join(staging, "records"))]
        assert [r["sealed"] for r in records] == [len(FSYNCED + LATER)]
    finally:
        bucket.remove()


def test_a_clean_stop_seals_what_is_staged(tmp_path):
    """A daemon stopping cleanly (``--no-drain``, or a drain that timed out) fsyncs and seals its
    staging files: a next start on another mount (a clean reboot) uploads all of them."""
    bucket = MemoryBucket()
    staging = str(tmp_path / "staging")
    try:
        vfs, wb = make_stack(counted(bucket), staging)

        async def main():
            async with running(vfs, wb):
                await Driver(vfs).call("write_at", "run.log", os.O_CREAT, 0, FSYNCED + LATER)   # never fsynced
        trio.run(main)
        wb.close()
        run = os.path.join(staging, "run.json")
        identity = json.loads(open(run).read())
        with open(run, "w") as fh:
            json.dump({**identity, "mount": identity["mount"] + 1}, fh)
        data, _ = _restart_and_sync(bucket, staging)
        assert data == FSYNCED + LATER
        assert not os.path.exists(os.path.join(staging, "lost+found"))
    finally:
        bucket.remove()


def test_a_rename_over_a_staged_file_journals_the_new_record_first(tmp_path):
    """torch.save's rename of a fsynced temp file over a staged checkpoint: the replaced file's
    record may go only once the moved one names the path (crash campaign, normal variant: a kill
    in between left neither, and the last acknowledged checkpoint never reached the bucket)."""
    bucket = MemoryBucket()
    bucket.put("other.bin", b"x")
    staging = str(tmp_path / "staging")
    try:
        vfs, wb = make_stack(counted(bucket), staging)
        on_disk_at_removal = []
        real_remove = wb.journal.remove_record

        def remove_record(ident):
            folder = os.path.join(staging, "records")
            on_disk_at_removal.append(sorted(json.loads(open(os.path.join(folder, n)).read())["path"]
                                             for n in os.listdir(folder) if n.endswith(".json")))
            real_remove(ident)
        wb.journal.remove_record = remove_record

        async def main():
            async with running(vfs, wb):
                fs = Driver(vfs)
                await fs.call("write_at", "ckpt.pt", os.O_CREAT, 0, b"acknowledged")
                await fs.call("fsync_path", "ckpt.pt")
                await fs.call("write_at", "ckpt.pt.tmp", os.O_CREAT, 0, b"next")
                await fs.call("fsync_path", "ckpt.pt.tmp")
                await fs.call("rename", "ckpt.pt.tmp", "ckpt.pt")
        trio.run(main)
        assert on_disk_at_removal[0] == ["ckpt.pt", "ckpt.pt"]    # a crash here keeps one of the two
    finally:
        bucket.remove()
