"""The write path without a kernel (docs/design.md, tests: layer 3): Vfs + Writeback + the block cache over a
counted in-memory store and a tmp staging dir, inside ``trio.run``. Create, write, fsync, rename,
unlink, mkdir/rmdir, truncate, both sync classes, multipart, replay after a crash, superseded
uploads, a full staging area and the errors a caller sees (docs/design.md invariant 5 and 7)."""

import errno
import os
import random

import pytest
import trio
from kernel_free import (
    Driver,
    build_vfs,
    counted,
    make_policy,
    make_stack,
    oserror,
    running,
    stored,
    until,
)
from memory_stores import MemoryBucket, count

from cachefs.errors import NoSuchKey, Unreachable
from cachefs.metrics import Metrics
from cachefs.namespace.dirs import DirState, UnionSource
from cachefs.namespace.vfs import ROOT_INODE, FsError
from cachefs.store import Listing, ObjectInfo
from cachefs.writeback.commands import sync_command
from cachefs.writeback.journal import Journal
from cachefs.writeback.overlay import DirOverlay
from cachefs.writeback.policy import CHECKPOINT, LOG

KIB = 1 << 10


@pytest.fixture
def bucket():
    bucket = MemoryBucket()
    bucket.put("old.txt", b"old content")
    bucket.put("ds/x.bin", b"x" * 1000)
    yield bucket
    bucket.remove()


def run(stack, body):
    vfs, wb = stack

    async def main():
        async with running(vfs, wb):
            await body(Driver(vfs), vfs, wb)

    trio.run(main)


# --- create, write, read, sync -------------------------------------------------------------------

def test_new_file_is_readable_at_once_then_uploaded_and_retired(bucket, tmp_path):
    store = counted(bucket)
    metrics = Metrics()
    stack = make_stack(store, str(tmp_path), metrics=metrics)

    async def body(fs, vfs, wb):
        assert await oserror(fs.call("write_at", "d/new.txt", os.O_CREAT, 0, b"x")) == errno.ENOENT
        await fs.call("mkdir", "d")
        assert await fs.call("write_at", "d/new.txt", os.O_CREAT, 0, b"hello ") == 6
        assert await fs.call("write_at", "d/new.txt", os.O_APPEND, 0, b"world") == 5
        assert await fs.call("read_all", "d/new.txt") == b"hello world"
        assert await fs.call("listdir", "d") == ["new.txt"]
        assert await fs.call("kind_and_size", "d/new.txt") == ("file", 11)
        assert store.calls["put"] == 0                       # nothing due yet (600 s periods)
        assert wb.pending()["files"] == 1 and wb.status()["classes"][LOG]["dirty_files"] == 1
        assert wb.staged("d/new.txt") is not None
        wb.request_sync()
        assert await wb.wait_synced(None, 5)
        assert stored(store, "d/new.txt") == b"hello world"
        assert wb.staged("d/new.txt") is None                # retired: reads go through the block cache
        assert wb.space() == (1 << 30, 0)
        assert await fs.call("read_all", "d/new.txt") == b"hello world"
        assert store.calls["get"] >= 1
        await until(lambda: not os.listdir(os.path.join(str(tmp_path), "data")))   # removed by a worker thread

    run(stack, body)
    assert count(metrics, "uploads", sync_class=LOG, result="ok") == 1


def test_log_file_uploads_after_its_period_and_checkpoint_after_quiet(bucket, tmp_path):
    store = counted(bucket)
    stack = make_stack(store, str(tmp_path), policy=make_policy(log_period=0.2, quiet=0.3, checkpoint=30))

    async def body(fs, vfs, wb):
        await fs.call("write_at", "a.log", os.O_CREAT, 0, b"line\n")
        fh = await fs.call("open", "m.pt", os.O_CREAT | os.O_RDWR)
        await fs.call("pwrite", fh, b"weights", 0)
        await until(lambda: wb.staged("a.log") is None, 3)          # uploaded and retired by the period
        assert stored(store, "a.log") == b"line\n"
        await trio.sleep(0.5)
        assert store.calls["put"] == 1                               # the open checkpoint waits
        assert wb.status()["classes"][CHECKPOINT]["dirty_files"] == 1
        await fs.call("close", fh)
        await until(lambda: wb.staged("m.pt") is None, 3)            # closed, then quiet: uploaded
        assert stored(store, "m.pt") == b"weights"

    run(stack, body)


def test_checkpoint_period_uploads_a_file_that_stays_open(bucket, tmp_path):
    store = counted(bucket)
    stack = make_stack(store, str(tmp_path), policy=make_policy(quiet=30, checkpoint=0.3))

    async def body(fs, vfs, wb):
        fh = await fs.call("open", "m.pt", os.O_CREAT | os.O_RDWR)
        await fs.call("pwrite", fh, b"v1", 0)
        await until(lambda: store.calls["put"] == 1, 3)
        await until(lambda: not wb.pending()["files"], 3)
        assert stored(store, "m.pt") == b"v1"
        assert wb.staged("m.pt") is not None                        # still open for writing: stays staged
        await fs.call("close", fh)
        await until(lambda: wb.staged("m.pt") is None, 3)           # clean on close: HEAD, retired

    run(stack, body)


def test_multipart_above_the_part_size_appears_only_complete(bucket, tmp_path):
    store = counted(bucket)
    metrics = Metrics()
    stack = make_stack(store, str(tmp_path), metrics=metrics, part_size=64 * KIB)
    data = random.Random(3).randbytes(200 * KIB + 7)

    async def body(fs, vfs, wb):
        gate = store.hold("finish_upload")
        await fs.call("write_at", "big.pt", os.O_CREAT, 0, data)
        wb.request_sync()
        await gate.wait_reached()
        assert store.calls["upload_part"] == 4
        with pytest.raises(NoSuchKey):
            store.inner.head("big.pt")                               # nothing visible before completion
        gate.open()
        assert await wb.wait_synced(None, 5)
        assert stored(store, "big.pt") == data

    run(stack, body)
    assert count(metrics, "uploads", sync_class=CHECKPOINT, result="ok") == 1
    assert count(metrics, "uploaded_bytes", sync_class=CHECKPOINT) == len(data)


@pytest.mark.parametrize("size", [20 * KIB, 150 * KIB])      # one PUT, and a multipart upload
def test_an_upload_that_lands_after_its_file_was_replaced_then_deleted_is_deleted_too(bucket, tmp_path, size):
    """A save's upload already sent when the next save renames over it and the file is deleted:
    the sent upload still lands, so the delete must leave a tombstone (run after it), or the first
    save comes back (a crash campaign saw exactly this: a deleted checkpoint in the bucket)."""
    store = counted(bucket)
    stack = make_stack(store, str(tmp_path), part_size=64 * KIB)
    last = "finish_upload" if size > 64 * KIB else "put"

    async def body(fs, vfs, wb):
        gate = store.hold(last, lambda path, *args: path == "ckpt/s0.pt")
        await fs.call("mkdir", "tmp")
        await fs.call("mkdir", "ckpt")
        await fs.call("write_at", "tmp/s0.tmp", os.O_CREAT, 0, b"1" * size)
        await fs.call("rename", "tmp/s0.tmp", "ckpt/s0.pt")
        wb.request_sync()
        await gate.wait_reached()                                    # version 1 is on its way
        await fs.call("write_at", "tmp/s0.tmp", os.O_CREAT, 0, b"2" * 1000)
        await fs.call("rename", "tmp/s0.tmp", "ckpt/s0.pt")           # version 2 replaces it
        await fs.call("unlink", "ckpt/s0.pt")                         # and is deleted
        gate.open()
        await until(lambda: "ckpt/s0.pt" not in wb._busy, 10)      # version 1's upload has ended (landed)
        assert await wb.wait_synced(None, 10)
        assert not _exists(store, "ckpt/s0.pt")

    run(stack, body)


def _exists(store, path: str) -> bool:
    try:
        store.inner.head(path)
        return True
    except NoSuchKey:
        return False


def test_an_overwrite_supersedes_the_upload_in_flight(bucket, tmp_path):
    store = counted(bucket)
    metrics = Metrics()
    stack = make_stack(store, str(tmp_path), metrics=metrics, part_size=64 * KIB)

    async def body(fs, vfs, wb):
        gate = store.hold("upload_part", lambda path, upload_id, number, data: number == 2)
        fh = await fs.call("open", "big.pt", os.O_CREAT | os.O_RDWR)
        await fs.call("pwrite", fh, b"a" * (150 * KIB), 0)
        wb.request_sync()
        await gate.wait_reached()
        await fs.call("pwrite", fh, b"B", 10)                        # below the uploaded size
        gate.open()
        await until(lambda: count(metrics, "uploads", sync_class=CHECKPOINT, result="superseded") == 1)
        assert store.calls["abort_upload"] == 1 and store.calls["finish_upload"] == 0
        await fs.call("pwrite", fh, b"tail", 150 * KIB)              # an append: never supersedes
        await fs.call("close", fh)
        wb.request_sync()
        assert await wb.wait_synced(None, 5)
        want = b"a" * 10 + b"B" + b"a" * (150 * KIB - 11) + b"tail"
        assert stored(store, "big.pt") == want
        assert await fs.call("read_all", "big.pt") == want

    run(stack, body)


# --- names -------------------------------------------------------------------------------------

def test_rename_unlink_mkdir_rmdir_reach_the_store(bucket, tmp_path):
    store = counted(bucket)
    stack = make_stack(store, str(tmp_path))

    async def body(fs, vfs, wb):
        await fs.call("rename", "old.txt", "moved.txt")              # store-only: server-side copy + tombstone
        assert store.calls["copy"] == 1
        assert await fs.call("read_all", "moved.txt") == b"old content"
        assert await fs.call("listdir", "") == ["ds", "moved.txt"]
        await fs.call("write_at", "s.log", os.O_CREAT, 0, b"staged")
        await fs.call("rename", "s.log", "t.log")                    # staged: the record moves
        await fs.call("mkdir", "e")
        await fs.call("mkdir", "e/f")
        await fs.call("rename", "e/f", "e/g")                        # an empty directory moves
        await fs.call("unlink", "ds/x.bin")
        assert await fs.call("listdir", "ds") == []
        await fs.call("rmdir", "ds")
        assert sorted(await fs.call("listdir", "")) == ["e", "moved.txt", "t.log"]
        wb.request_sync()
        assert await wb.wait_synced(None, 5)
        inner = store.inner
        assert sorted(i.path for i in inner.list_all("")) == ["moved.txt", "t.log"]
        assert inner.list_dir("e/").dirs == ["g"]
        assert stored(store, "t.log") == b"staged"

    run(stack, body)


def test_rename_over_a_staged_file_and_a_store_file(bucket, tmp_path):
    store = counted(bucket)
    stack = make_stack(store, str(tmp_path))

    async def body(fs, vfs, wb):
        await fs.call("write_at", "a.txt", os.O_CREAT, 0, b"A")
        await fs.call("write_at", "b.txt", os.O_CREAT, 0, b"B")
        await fs.call("rename", "a.txt", "b.txt")                    # staged over staged
        await fs.call("rename", "b.txt", "old.txt")                  # staged over a store file
        await fs.call("write_at", "c.txt", os.O_CREAT, 0, b"C")
        await fs.call("rename", "ds/x.bin", "c.txt")                 # store file over a staged file
        assert sorted(await fs.call("listdir", "")) == ["c.txt", "ds", "old.txt"]
        wb.request_sync()
        assert await wb.wait_synced(None, 5)
        assert stored(store, "old.txt") == b"A"
        assert stored(store, "c.txt") == b"x" * 1000
        assert sorted(i.path for i in store.inner.list_all("")) == ["c.txt", "old.txt"]

    run(stack, body)


def test_truncate_copies_up_then_cuts(bucket, tmp_path):
    store = counted(bucket)
    stack = make_stack(store, str(tmp_path))

    async def body(fs, vfs, wb):
        await fs.call("truncate", "old.txt", 3)
        assert await fs.call("read_all", "old.txt") == b"old"
        await fs.call("truncate", "old.txt", 5)
        assert await fs.call("read_all", "old.txt") == b"old\0\0"
        node = await vfs.lookup(ROOT_INODE, "old.txt")
        await vfs.setattr(node.inode, None, 1234.5)                  # mtime kept while staged
        assert node.mtime == 1234.5
        await fs.call("truncate", "ds/x.bin", 0)                     # to zero: no download
        assert store.calls["get"] == 1
        wb.request_sync()
        assert await wb.wait_synced(None, 5)
        assert stored(store, "old.txt") == b"old\0\0" and stored(store, "ds/x.bin") == b""

    run(stack, body)


def test_posix_errors_a_caller_sees(bucket, tmp_path):
    stack = make_stack(counted(bucket), str(tmp_path))

    async def body(fs, vfs, wb):
        await fs.call("mkdir", "d")
        await fs.call("write_at", "d/f", os.O_CREAT, 0, b"f")
        assert await oserror(fs.call("mkdir", "d")) == errno.EEXIST
        assert await oserror(fs.call("rmdir", "d")) == errno.ENOTEMPTY
        assert await oserror(fs.call("rmdir", "old.txt")) == errno.ENOTDIR
        assert await oserror(fs.call("unlink", "d")) == errno.EISDIR
        assert await oserror(fs.call("unlink", "nope")) == errno.ENOENT
        assert await oserror(fs.call("rename", "d", "e")) == errno.EXDEV      # a non-empty directory
        assert await oserror(fs.call("read_all", "old.txt/x")) == errno.ENOTDIR
        root = vfs.node(ROOT_INODE)
        d = await vfs.child(root, "d")
        with pytest.raises(FsError) as info:
            await vfs.rename(ROOT_INODE, "old.txt", ROOT_INODE, "d", 0)
        assert info.value.errno == errno.EISDIR
        with pytest.raises(FsError) as info:
            await vfs.rename(ROOT_INODE, "old.txt", d.inode, "f", 1)        # RENAME_NOREPLACE
        assert info.value.errno == errno.EEXIST
        with pytest.raises(FsError) as info:
            await vfs.rename(ROOT_INODE, "old.txt", d.inode, "g", 2)        # RENAME_EXCHANGE
        assert info.value.errno == errno.EINVAL
        with pytest.raises(FsError) as info:
            await vfs.create(ROOT_INODE, "d", os.O_WRONLY)
        assert info.value.errno == errno.EISDIR
        with pytest.raises(FsError) as info:
            await vfs.setattr(d.inode, 0, None)
        assert info.value.errno == errno.EISDIR
        fh = await fs.call("open", "old.txt", os.O_RDONLY)
        assert await oserror(fs.call("pwrite", fh, b"x", 0)) == errno.EBADF
        await fs.call("close", fh)
        await fs.call("mkdir", "empty")
        await fs.call("mkdir", "d2")
        await fs.call("write_at", "d2/g", os.O_CREAT, 0, b"g")
        with pytest.raises(FsError) as info:
            await vfs.rename(ROOT_INODE, "empty", ROOT_INODE, "old.txt", 0)
        assert info.value.errno == errno.ENOTDIR
        await fs.call("mkdir", "empty2")
        await fs.call("write_at", "empty2/h", os.O_CREAT, 0, b"h")
        await fs.call("mkdir", "e3")
        with pytest.raises(FsError) as info:
            await vfs.rename(ROOT_INODE, "e3", ROOT_INODE, "empty2", 0)
        assert info.value.errno == errno.ENOTEMPTY
        with pytest.raises(FsError) as info:
            await vfs.rename(ROOT_INODE, "nope", ROOT_INODE, "x", 0)
        assert info.value.errno == errno.ENOENT
        await vfs.rename(ROOT_INODE, "old.txt", ROOT_INODE, "old.txt", 0)   # onto itself: nothing
        with pytest.raises(FsError) as info:
            await vfs.unlink(ROOT_INODE, "nope")
        assert info.value.errno == errno.ENOENT

    run(stack, body)


def test_a_read_only_vfs_refuses_every_write(bucket):
    store = counted(bucket)
    from memory_stores import make_cache
    vfs = build_vfs(store, make_cache(store, Metrics()))
    assert not vfs.writable and vfs.statfs().capacity is None

    async def main():
        fs = Driver(vfs)
        for call in (fs.call("mkdir", "n"), fs.call("write_at", "n", os.O_CREAT, 0, b""),
                     fs.call("unlink", "old.txt"), fs.call("truncate", "old.txt", 0),
                     fs.call("rename", "old.txt", "n"), fs.call("write_at", "old.txt", 0, 0, b"x")):
            assert await oserror(call) == errno.EROFS
        assert await fs.call("read_all", "old.txt") == b"old content"

    trio.run(main)


# --- durability, space, failures -------------------------------------------------------------

@pytest.mark.allow_warnings
def test_journal_replay_after_a_crash_uploads_everything_staged(bucket, tmp_path):
    store = counted(bucket)
    staging = str(tmp_path / "staging")
    vfs, wb = make_stack(store, staging)

    async def crash():
        fs = Driver(vfs)
        store.failures["delete"] = store.failures["make_dir"] = Unreachable("store down")
        async with running(vfs, wb):
            await fs.call("write_at", "a.log", os.O_CREAT, 0, b"acknowledged")
            fh = await fs.call("open", "b.pt", os.O_CREAT | os.O_RDWR)
            await fs.call("pwrite", fh, b"open at the crash", 0)
            await fs.call("fsync", fh)
            await fs.call("unlink", "old.txt")
            await fs.call("mkdir", "newdir")
        # the daemon dies here: nothing uploaded, descriptors never closed

    trio.run(crash)
    assert store.calls["put"] == 0 and store.inner.head("old.txt")
    store.failures.clear()
    vfs2, wb2 = make_stack(store, staging)

    async def restart():
        async with running(vfs2, wb2):
            assert wb2.pending()["files"] == 2 and wb2.pending()["operations"] == 2
            assert await wb2.wait_synced(None, 5)                     # replayed entries are urgent
            assert await Driver(vfs2).call("listdir", "") == ["a.log", "b.pt", "ds", "newdir"]

    trio.run(restart)
    vfs2.close()
    assert stored(store, "a.log") == b"acknowledged" and stored(store, "b.pt") == b"open at the crash"
    assert sorted(i.path for i in store.inner.list_all("")) == ["a.log", "b.pt", "ds/x.bin"]
    assert Journal(staging).replay() == []


def test_a_full_staging_area_blocks_then_gives_enospc(bucket, tmp_path):
    store = counted(bucket)
    metrics = Metrics()
    stack = make_stack(store, str(tmp_path), metrics=metrics, staging_size=10 * KIB, staging_wait=0.3)

    async def body(fs, vfs, wb):
        gate = store.hold("put")
        await fs.call("write_at", "a.txt", os.O_CREAT, 0, b"a" * 8 * KIB)
        assert vfs.statfs().free == 2 * KIB
        assert await oserror(fs.call("write_at", "b.txt", os.O_CREAT, 0, b"b" * 4 * KIB)) == errno.ENOSPC
        await gate.wait_reached()                                    # the full area made a.txt due now
        gate.open()
        await until(lambda: wb.space()[1] == 0)
        assert await fs.call("write_at", "b.txt", os.O_CREAT, 0, b"b" * 4 * KIB) == 4 * KIB

    run(stack, body)
    assert count(metrics, "staging_full") == 1


@pytest.mark.allow_warnings
def test_a_writer_waiting_for_space_does_not_retry_a_failing_upload_in_a_loop(bucket, tmp_path):
    store = counted(bucket)
    stack = make_stack(store, str(tmp_path), staging_size=10 * KIB, staging_wait=1.5)

    async def body(fs, vfs, wb):
        store.failures["put"] = Unreachable("store down")
        await fs.call("write_at", "a.txt", os.O_CREAT, 0, b"a" * 8 * KIB)
        wb.request_sync()
        await until(lambda: wb.pending()["failing"] == 1)
        tries = store.calls["put"]
        # 1.5 s waiting for room: the failing upload keeps its backoff (2 s after one failure)
        assert await oserror(fs.call("write_at", "b.txt", os.O_CREAT, 0, b"b" * 4 * KIB)) == errno.ENOSPC
        assert store.calls["put"] - tries <= 1
        del store.failures["put"]
        wb.request_sync()                                            # an explicit sync retries at once
        assert await wb.wait_synced(None, 5)
        assert stored(store, "a.txt") == b"a" * 8 * KIB

    run(stack, body)


@pytest.mark.allow_warnings
def test_failing_uploads_stay_staged_and_a_remote_fsync_says_eio(bucket, tmp_path):
    store = counted(bucket)
    stack = make_stack(store, str(tmp_path), fsync_remote=True)

    async def body(fs, vfs, wb):
        store.failures["put"] = Unreachable("store down")
        store.failures["delete"] = Unreachable("store down")
        fh = await fs.call("open", "a.txt", os.O_CREAT | os.O_RDWR)
        await fs.call("pwrite", fh, b"precious", 0)
        assert await oserror(fs.call("fsync", fh)) == errno.EIO
        await fs.call("unlink", "old.txt")
        wb.request_sync()
        await until(lambda: wb.pending()["failing"] == 2)
        status = wb.status()
        assert status["failing"] == 2 and status["classes"][LOG]["failing"] == 1
        assert any("store down" in e for e in status["errors"])
        assert await fs.call("read_all", "a.txt") == b"precious"     # still served from staging
        del store.failures["put"], store.failures["delete"]
        wb.request_sync()                                            # a retry now, not after the backoff
        assert await wb.wait_synced(None, 5)
        await fs.call("fsync", fh)                                   # remote-durable now
        await fs.call("close", fh)
        assert stored(store, "a.txt") == b"precious"

    run(stack, body)


def test_sync_command_streams_progress_then_done(bucket, tmp_path):
    store = counted(bucket)
    stack = make_stack(store, str(tmp_path))

    async def body(fs, vfs, wb):
        replies = [r async for r in sync_command(wb, {"class": "bogus"})]
        assert "unknown sync class" in replies[0]["error"]
        await fs.call("write_at", "a.log", os.O_CREAT, 0, b"x")
        gate = store.hold("put")
        replies = []

        async def collect():
            async for reply in sync_command(wb, {"class": "log", "wait": True, "timeout": 5}):
                replies.append(reply)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect)
            await gate.wait_reached()
            gate.open()
        assert replies[0]["progress"]["files"] == 1
        assert replies[-1] == {"done": True, "pending": wb.pending("log")}
        replies = [r async for r in sync_command(wb, {"class": "checkpoint"})]
        assert replies == [{"done": True, "pending": wb.pending(CHECKPOINT)}]

    run(stack, body)


# --- the namespace's view of the write-back ---------------------------------------------------

@pytest.mark.allow_warnings
def test_overlay_shows_staged_names_under_a_directory(bucket, tmp_path):
    store = counted(bucket)
    stack = make_stack(store, str(tmp_path))

    async def body(fs, vfs, wb):
        for method in ("delete", "make_dir", "remove_dir"):         # operations stay pending
            store.failures[method] = Unreachable("store down")
        await fs.call("mkdir", "p")
        await fs.call("mkdir", "p/q")
        await fs.call("write_at", "p/f.txt", os.O_CREAT, 0, b"12345")
        await fs.call("unlink", "ds/x.bin")
        over = wb.overlay("p")
        assert over.dirs == {"q"} and set(over.files) == {"f.txt"} and over.files["f.txt"].size == 5
        assert wb.overlay("").dirs == {"p"} and wb.overlay("ds").gone_files == {"x.bin"}
        await fs.call("rmdir", "p/q")
        assert wb.overlay("p").gone_dirs == {"q"}
        state = DirState(0.0, {"x": ObjectInfo("x", 1, 0.0, "e")}, {"y"})
        state.apply(DirOverlay(files={"z": ObjectInfo("z", 2, 0.0, "")}, dirs={"w"}, gone_files={"x"},
                               gone_dirs={"y"}))
        assert state.names() == ["w", "z"]
        assert vfs.inode_count() >= 1 and vfs.find_node(10 ** 9) is None

    run(stack, body)


def test_union_source_stacks_directory_listings():
    class Fixed:
        def __init__(self, files, dirs):
            self.listing = Listing([ObjectInfo(f"d/{n}", 1, 0.0, n) for n in files], list(dirs))

        def list_dir(self, prefix):
            return self.listing

    union = UnionSource(Fixed(["a", "b"], ["s"]), Fixed(["b", "c", "s"], ["t", "a"]))
    merged = union.list_dir("d/")
    assert sorted(i.path for i in merged.files) == ["d/a", "d/b", "d/c"]
    assert [i.etag for i in merged.files if i.path == "d/b"] == ["b"]          # the first source wins
    assert sorted(merged.dirs) == ["s", "t"]


def test_a_write_the_full_disk_cuts_short_is_undone_never_half_uploaded(bucket, tmp_path, monkeypatch):
    """A nearly full disk writes part of a pwrite, then ENOSPC: the write fails whole and the file
    keeps its length, so no upload (or replay) ever holds half of one write()."""
    from cachefs.writeback import staged
    store = counted(bucket)
    stack = make_stack(store, str(tmp_path), staging_wait=0.2)
    real = os.pwrite

    calls = []

    def short_then_full(fd, data, offset):      # what ext4 does on a nearly full disk
        calls.append(len(data))
        if len(calls) == 1:
            return real(fd, bytes(data[:len(data) // 2]), offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    async def body(fs, vfs, wb):
        fh = await fs.call("open", "run.log", os.O_CREAT | os.O_WRONLY)
        await fs.call("pwrite", fh, b"first record\n", 0)
        monkeypatch.setattr(staged.os, "pwrite", short_then_full)
        assert await oserror(fs.call("pwrite", fh, b"x" * 3000, 13)) == errno.ENOSPC
        monkeypatch.setattr(staged.os, "pwrite", real)
        await fs.call("close", fh)
        assert await fs.call("read_all", "run.log") == b"first record\n"
        wb.request_sync()
        assert await wb.wait_synced(None, 5)
        assert stored(store, "run.log") == b"first record\n"

    run(stack, body)
