"""The kernel's ids kept for the next daemon of a live mount (cachefs/namespace/ids.py, adopt.py),
without a kernel: the id log's records and replay (torn records, compaction), and a second Vfs that
takes over a first one's nodes, handles and backing ids as a successor daemon does."""

import errno
import os
import types

import pytest
import trio
from kernel_free import TREE, WriteCountingStore, build_vfs, listdir, make_stack, running, walk
from memory_stores import MemoryBucket, make_cache

from cachefs.control.server import Control
from cachefs.fuse.looptable import LOOP_FH
from cachefs.fuse.types import Context
from cachefs.fuse_ops import Operations
from cachefs.metrics import Metrics
from cachefs.namespace.handles import fh_inode, make_fh
from cachefs.namespace.ids import IdLog
from cachefs.namespace.vfs import CONTROL_INODE, ROOT_INODE, FsError, Vfs


def test_the_log_replays_what_the_kernel_holds(tmp_path):
    path = str(tmp_path / "ids")
    log = IdLog(path, fresh=True)
    log.node(16, "a.txt", False, 11, 100.0, 500.0, "e1")
    log.node(17, "d", True, 0, 0.0, 500.0, "")
    log.node(18, "d/b", False, 5, 101.0, 500.0, "e2")
    log.node(19, "gone", False, 1, 1.0, 500.0, "e3")
    log.version(16, 12, 102.0, 600.0, "e1b")
    log.moved(18, "d/c")
    log.unlinked(16)
    log.dropped(19)
    log.backing(18, 7)
    log.backing(17, 9)
    log.backing_closed(17)
    log.close()
    known = IdLog(path, fresh=False).known
    assert sorted(known.nodes) == [16, 17, 18]
    a, d, c = known.nodes[16], known.nodes[17], known.nodes[18]
    assert (a.path, a.size, a.mtime, a.checked, a.etag, a.linked) == ("a.txt", 12, 102.0, 600.0, "e1b", False)
    assert d.is_dir and d.linked and (c.path, c.etag, c.linked) == ("d/c", "e2", True)
    assert known.backings == {18: 7}
    assert IdLog(path, fresh=True).known.nodes == {}           # a new mount starts empty


@pytest.mark.allow_warnings          # the unknown record is logged
def test_a_torn_last_record_is_dropped(tmp_path):
    path = str(tmp_path / "ids")
    log = IdLog(path, fresh=True)
    log.node(16, "a", False, 1, 1.0, 1.0, "x")
    second = log._size
    log.node(17, "bbbbbbbbbb", False, 1, 1.0, 1.0, "y")
    end = log._size
    log.close()
    assert os.path.getsize(path) >= 1 << 20 and open(path, "rb").read()[end:] == bytes(os.path.getsize(path) - end)
    with open(path, "r+b") as fh:             # the daemon died storing the second record: its kind byte
        fh.seek(second)                       # (stored last) is still zero
        fh.write(b"\0")
    assert sorted(IdLog(path, fresh=False).known.nodes) == [16]
    log = IdLog(path, fresh=True)             # a log an earlier version appended to, cut in a record
    log.node(16, "a", False, 1, 1.0, 1.0, "x")
    log.node(17, "bbbbbbbbbb", False, 1, 1.0, 1.0, "y")
    end = log._size
    log.close()
    os.truncate(path, end - 3)
    assert sorted(IdLog(path, fresh=False).known.nodes) == [16]
    again = IdLog(path, fresh=False)          # (a start rewrites the log: node 16 only)
    at = again._size
    again.close()
    with open(path, "r+b") as fh:             # garbage after the records is ignored with a warning
        fh.seek(at)
        fh.write(b"Z" + b"\1" * 8)
    assert sorted(IdLog(path, fresh=False).known.nodes) == [16]


def test_a_record_lands_in_the_file_as_it_is_made(tmp_path):
    """No buffering in the process: what a SIGKILL right after ``node`` leaves is in the file."""
    path = str(tmp_path / "ids")
    log = IdLog(path, fresh=True)
    for inode in range(16, 16 + 5000):       # past the first allocation: the file grows, mapped again
        log.node(inode, f"train/{inode:08d}.jpg", False, 100_000, 1.0, 1.0, "0123456789abcdef")
    log.backing(20, 3)
    known = IdLog(path, fresh=False).known   # read while the first log is open, as a successor does
    assert len(known.nodes) == 5000 and known.backings == {20: 3}
    log.close()


@pytest.mark.allow_warnings          # the full disk is logged once
def test_a_full_cache_disk_leaves_the_mount_unprotected_not_broken(tmp_path, monkeypatch, caplog):
    path = str(tmp_path / "ids")
    log = IdLog(path, fresh=True)
    log.node(16, "kept", False, 1, 1.0, 1.0, "x")

    def full(*_args):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    for inode in range(17, 17 + 20_000):      # past the first allocation: growing it fails
        log.node(inode, f"train/{inode:08d}.jpg", False, 1, 1.0, 1.0, "0123456789abcdef")
    log.backing(16, 4)                        # no-ops from here on, never an exception
    assert sum("cannot record kernel ids" in r.getMessage() for r in caplog.records) == 1
    log.close()
    monkeypatch.undo()
    known = IdLog(path, fresh=False).known    # what was recorded before the disk filled is there
    assert 16 in known.nodes and 17 in known.nodes and 17 + 19_999 not in known.nodes
    monkeypatch.setattr(os, "posix_fallocate", full)
    assert IdLog(str(tmp_path / "other"), fresh=True)._map is None      # at start: unprotected, serving


def test_the_log_stays_the_size_of_the_live_set(tmp_path):
    path = str(tmp_path / "ids")
    log = IdLog(path, fresh=True)
    for round_ in range(6):                   # epochs that make and forget 10,000 nodes each
        base = 16 + round_ * 10_000
        for inode in range(base, base + 10_000):
            log.node(inode, f"train/{inode:08d}.jpg", False, 100_000, 1.0, 1.0, "0123456789abcdef")
        for inode in range(base, base + 10_000 - 10):
            log.dropped(inode)
    assert os.path.getsize(path) < 2 * (1 << 20)
    log.close()
    known = IdLog(path, fresh=False).known
    assert len(known.nodes) == 60 and all(node.path == f"train/{inode:08d}.jpg" for inode, node in known.nodes.items())


def test_a_handle_number_names_its_inode():
    fh = make_fh(123456789, 3, 70_000)
    assert fh_inode(fh) == 123456789 and fh < 1 << 64
    assert make_fh(5, 0, 1) != make_fh(5, 1, 1)        # another generation: another number


def test_no_handle_number_the_daemon_gives_out_looks_like_a_loop_processes():
    """Bit 63 marks a loop process's handle, whose RELEASE and ioctls the daemon answers without
    a handle: once 32,768 files had been opened in a daemon's life, every handle it gave out had
    it, so none was released again and the control file's ioctls answered ENOTTY."""
    for seq in (1, 0x7FFF, 0x8000, 0xFFFF, 1 << 20, (1 << 20) + 0x8000):
        fh = make_fh((1 << 40) - 1, 255, seq)
        assert not fh & LOOP_FH and fh_inode(fh) == (1 << 40) - 1, hex(fh)


def _vfs(store, ids, generation, wb=None) -> Vfs:
    return build_vfs(store, make_cache(store, Metrics()), ids=ids, generation=generation, writeback=wb)


def test_a_successor_serves_the_ids_its_predecessor_handed_out(tmp_path):
    bucket = MemoryBucket()
    for name, data in TREE.items():
        bucket.put(name, data)
    store = bucket.store()
    path = str(tmp_path / "ids")
    first = _vfs(store, IdLog(path, fresh=True), 0)
    state = {}

    async def before():
        a = await walk(first, "a.txt")
        d = await walk(first, "d")
        handle, _ = await first.open(a.inode, os.O_RDONLY)
        state.update(a=a.inode, d=d.inode, fh=handle.fh, dir_fh=await first.opendir(d.inode),
                     names=[n for n, _ in await listdir(first, d.inode)], calls=dict(store.calls))
        with pytest.raises(FsError) as info:        # a first daemon has no predecessor: unknown is EBADF
            await first.read(make_fh(a.inode, 7, 1), 0, 5)
        assert info.value.errno == errno.EBADF
    trio.run(before)
    first._nodes.ids.close()

    ids = IdLog(path, fresh=False)
    second = _vfs(store, ids, 1)
    second.restore(list(ids.known.nodes.values()))

    async def after():
        # the same inode numbers, the same paths; no HEAD (fresh as when the first daemon saw them)
        assert second.node(state["a"]).path == "a.txt" and second.node(state["d"]).is_dir
        assert await second.read(state["fh"], 0, 100) == TREE["a.txt"]           # a handle opened before
        assert store.calls.get("head", 0) == state["calls"].get("head", 0)
        handle = await second.dir_handle(state["dir_fh"])                       # an open directory too
        assert handle.names == state["names"]
        new = await walk(second, "z")
        assert new.inode > max(state["a"], state["d"])                          # new ids never collide
        with pytest.raises(FsError):
            second.handle(make_fh(CONTROL_INODE, 0, 1))                         # a control conversation is over
        # a restored node is dropped at its first FORGET (the kernel forgets an inode all at once)
        second.forget(state["d"], 1)
        assert second.find_node(state["d"]) is None
        second.forget(ROOT_INODE, 1)
        assert second.find_node(ROOT_INODE) is not None
        await second.release(state["fh"])
        assert second.node(state["a"]).opens == 0
    trio.run(after)


def test_restored_backing_ids_answer_their_inodes_opens_until_forget(tmp_path):
    bucket = MemoryBucket()
    bucket.put("a.txt", b"hello")
    store = bucket.store()
    ids = IdLog(str(tmp_path / "ids"), fresh=True)
    first = _vfs(store, ids, 0)
    inode = trio.run(walk, first, "a.txt").inode
    ids.backing(inode, 42)
    ids.close()
    ids = IdLog(str(tmp_path / "ids"), fresh=False)
    vfs = _vfs(store, ids, 1)
    vfs.restore(list(ids.known.nodes.values()))
    closed = []
    kernel = types.SimpleNamespace(passthrough=True, backing_close=closed.append)
    ops = Operations(vfs, Control(lambda: vfs.new_fh(CONTROL_INODE)), Metrics(), kernel, uid=0, gid=0,
                     file_mode=0o644, dir_mode=0o755, metadata_ttl=60.0, immutable=True)
    ops.restore_backings(ids.known.backings)
    assert ops.backings.reuse(inode) == 42 and ops.backings.reuse(inode) == 42
    ops.forget([(inode, 1)])                  # still open (two reuses): kept
    assert closed == [] and inode in ops.backings.by_inode
    for fh in (1, 2):
        ops.backings.bind(fh, inode)
        ops.backings.unbind(fh)
    assert closed == []                       # idle, yet never closed before the inode's FORGET
    ops.forget([(inode, 1)])
    assert closed == [42] and ids.known.backings == {inode: 42}
    assert ops.backings.by_inode == {}


def writable_ops(tmp_path):
    """A writable namespace (no kernel) and the FUSE operations over it."""
    store = WriteCountingStore(MemoryBucket().store().inner)
    vfs, wb = make_stack(store, str(tmp_path / "staging"))
    ops = Operations(vfs, Control(lambda: vfs.new_fh(CONTROL_INODE)), Metrics(),
                     types.SimpleNamespace(passthrough=False), uid=0, gid=0, file_mode=0o644, dir_mode=0o755,
                     metadata_ttl=60.0, immutable=False)
    return vfs, wb, ops


def test_resent_requests_count_what_was_applied_as_done(tmp_path):
    """A request the kernel sends again (bit 63 of its unique) may have been applied by the dead
    daemon: mkdir then finds the directory, unlink and rmdir find nothing, rename finds the new name."""
    vfs, wb, ops = writable_ops(tmp_path)
    fresh, resent = Context(0, 0, 1), Context(0, 0, 1, resent=True)

    async def main():
        async with running(vfs, wb):
            await ops.mkdir(ROOT_INODE, b"out", 0o755, fresh)
            attr = await ops.mkdir(ROOT_INODE, b"out", 0o755, resent)          # applied already: its entry
            assert attr.ino == (await vfs.lookup(ROOT_INODE, "out")).inode
            with pytest.raises(Exception) as info:
                await ops.mkdir(ROOT_INODE, b"out", 0o755, fresh)              # a real second mkdir: EEXIST
            assert info.value.errno == errno.EEXIST
            info_, _ = await ops.create(ROOT_INODE, b"f", 0o644, os.O_WRONLY, fresh)
            await ops.release(info_.fh)
            await ops.rename(ROOT_INODE, b"f", ROOT_INODE, b"g", 0, fresh)
            await ops.rename(ROOT_INODE, b"f", ROOT_INODE, b"g", 0, resent)     # moved already: done
            with pytest.raises(Exception) as info:
                await ops.rename(ROOT_INODE, b"f", ROOT_INODE, b"h", 0, resent)  # nothing at either name
            assert info.value.errno == errno.ENOENT
            await ops.unlink(ROOT_INODE, b"g", fresh)
            await ops.unlink(ROOT_INODE, b"g", resent)
            await ops.rmdir(ROOT_INODE, b"out", fresh)
            await ops.rmdir(ROOT_INODE, b"out", resent)
            with pytest.raises(Exception) as info:
                await ops.unlink(ROOT_INODE, b"g", fresh)
            assert info.value.errno == errno.ENOENT
    trio.run(main)


def test_a_resent_change_the_journal_holds_but_the_node_table_missed_is_shown_there_too(tmp_path, monkeypatch):
    """The dead daemon staged the rename (or unlink) in the journal and died before moving the node:
    the resent request, answered as done, moves it too, so the kernel's inode names the new path and
    what is written through it is staged there, not under the old name (a campaign saw a checkpoint
    rewritten in place staged as its temporary file)."""
    vfs, wb, ops = writable_ops(tmp_path)
    fresh, resent = Context(0, 0, 1), Context(0, 0, 1, resent=True)

    async def main():
        async with running(vfs, wb):
            info, attr = await ops.create(ROOT_INODE, b"f.tmp", 0o644, os.O_WRONLY, fresh)
            await ops.write(info.fh, 0, b"first")
            await ops.release(info.fh)
            with monkeypatch.context() as patched:      # the daemon dies after the journal, before the nodes
                patched.setattr(vfs._nodes, "move", lambda old, new: None)
                await ops.rename(ROOT_INODE, b"f.tmp", ROOT_INODE, b"f", 0, fresh)
            assert vfs._nodes.at("f.tmp").inode == attr.ino       # the lag this test is about
            await ops.rename(ROOT_INODE, b"f.tmp", ROOT_INODE, b"f", 0, resent)
            assert vfs._nodes.at("f.tmp") is None and vfs._nodes.at("f").inode == attr.ino
            info = await ops.open(attr.ino, os.O_RDWR, fresh)        # rewritten in place through that inode
            await ops.write(info.fh, 0, b"again")
            await ops.release(info.fh)
            assert wb.staged("f.tmp") is None and wb.staged("f") is not None
            assert await ops.read((await ops.open(attr.ino, os.O_RDONLY, fresh)).fh, 0, 10) == b"again"
            with monkeypatch.context() as patched:
                patched.setattr(vfs._nodes, "unlink", lambda path: None)
                await ops.unlink(ROOT_INODE, b"f", fresh)
            assert vfs._nodes.at("f") is not None
            await ops.unlink(ROOT_INODE, b"f", resent)
            assert vfs._nodes.at("f") is None
    trio.run(main)
