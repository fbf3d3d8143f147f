"""The namespace without a kernel (docs/design.md, tests: layer 3): Vfs over the Tiers and a counted
in-memory store, inside ``trio.run``: listings, snapshots, TTLs, lookup counts, version pinning."""

import errno
import logging
import os
import random
import types

import pytest
import trio
from kernel_free import BIG, TREE, build_vfs, listdir, walk
from memory_stores import BS, MemoryBucket, make_cache

from cachefs.control.server import Control
from cachefs.errors import Unreachable, VersionChanged
from cachefs.fuse.types import FuseError
from cachefs.fuse_ops import Operations
from cachefs.metrics import Metrics
from cachefs.namespace import catalog as catalog_module
from cachefs.namespace import vfs as vfs_module
from cachefs.namespace.snapshot import ListingSnapshot
from cachefs.namespace.vfs import ROOT_INODE, FsError, Vfs

TTL = 60.0


# --- helpers ------------------------------------------------------------------------------------

class Clock:
    """Stands in for the ``time`` module inside cachefs.namespace.vfs."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(vfs_module, "time", fake)
    monkeypatch.setattr(catalog_module, "time", fake)
    return fake


@pytest.fixture
def bucket_mem():
    bucket = MemoryBucket()
    for path, data in TREE.items():
        bucket.put(path, data)
    yield bucket
    bucket.remove()


def make_vfs(store, *, snapshot_dir=None, ttl: float = TTL, immutable: bool = False) -> Vfs:
    snapshot = ListingSnapshot(str(snapshot_dir), store.identity) if snapshot_dir else None
    return build_vfs(store, make_cache(store, Metrics()), snapshot, ttl=ttl, immutable=immutable)


async def open_read(vfs: Vfs, path: str) -> bytes:
    node = await walk(vfs, path)
    handle, _ = await vfs.open(node.inode, os.O_RDONLY)
    try:
        return await vfs.read(handle.fh, 0, 1 << 30)
    finally:
        await vfs.release(handle.fh)


def errno_of(info: pytest.ExceptionInfo) -> int:
    return info.value.errno


# --- the tree -----------------------------------------------------------------------------------

def test_lookup_and_readdir_give_the_tree(bucket_mem):
    store = bucket_mem.store()
    vfs = make_vfs(store)

    async def main():
        assert await listdir(vfs, ROOT_INODE) == [("a.txt", 1), ("d", 2), ("z", 3)]
        assert await listdir(vfs, ROOT_INODE, start=2) == [("z", 3)]     # resumable by offset
        d = await walk(vfs, "d")
        assert d.is_dir and d.path == "d"
        assert [name for name, _ in await listdir(vfs, d.inode)] == ["b.bin", "e"]
        b = await walk(vfs, "d/b.bin")
        assert (b.is_dir, b.size, b.path) == (False, len(BIG), "d/b.bin")
        assert (await walk(vfs, "z")).size == 0
        for path, data in TREE.items():
            assert await open_read(vfs, path) == data
        assert store.calls["list_dir"] == 3          # "", "d/", "d/e/": each listed once
        assert store.calls["head"] == 0              # within the TTL, opens do not revalidate
    trio.run(main)


def test_readdir_nodes_are_the_lookup_nodes(bucket_mem):
    vfs = make_vfs(bucket_mem.store())

    async def main():
        a = await walk(vfs, "a.txt")
        fh = await vfs.opendir(ROOT_INODE)
        by_name = {name: node for name, node, _ in vfs.readdir_entries(fh, 0)}
        assert by_name["a.txt"] is a
        assert (await walk(vfs, "d")).inode == by_name["d"].inode
    trio.run(main)


# --- listings: TTL, snapshot, failures ---------------------------------------------------------

def test_a_snapshot_serves_listings_to_a_second_vfs_until_the_ttl(bucket_mem, tmp_path, clock):
    store = bucket_mem.store()

    async def main():
        first = make_vfs(store, snapshot_dir=tmp_path)
        assert (await walk(first, "d/e/c")).size == 1
        assert store.calls["list_dir"] == 3
        first.close()

        second = make_vfs(store, snapshot_dir=tmp_path)
        assert (await walk(second, "d/e/c")).size == 1
        assert [n for n, _ in await listdir(second, ROOT_INODE)] == ["a.txt", "d", "z"]
        assert store.calls["list_dir"] == 3          # nothing relisted within the TTL

        bucket_mem.put("new.txt", b"new")
        with pytest.raises(FsError) as info:
            await second.lookup(ROOT_INODE, "new.txt")
        assert errno_of(info) == errno.ENOENT        # still the snapshot's view
        clock.advance(TTL + 1)
        async with trio.open_nursery() as nursery:   # concurrent lookups share one relist
            for name in ("a.txt", "z", "new.txt", "d"):
                nursery.start_soon(second.lookup, ROOT_INODE, name)
        assert store.calls["list_dir"] == 4
        assert await open_read(second, "new.txt") == b"new"
        second.close()
    trio.run(main)


def test_listing_ahead_is_skipped_on_a_remount_within_the_ttl(bucket_mem, tmp_path, clock):
    """A remount whose root listing was saved within the TTL lists nothing ahead; past the TTL it does."""
    from cachefs.namespace.listahead import ListAhead
    store = bucket_mem.store()
    trees = []

    def list_tree(prefix, limit):
        trees.append(prefix)
        yield "", store.inner.list_dir("")
    store.list_tree = list_tree

    async def main():
        first = make_vfs(store, snapshot_dir=tmp_path)
        await listdir(first, ROOT_INODE)              # the root listing is saved
        first.close()
        second = make_vfs(store, snapshot_dir=tmp_path)
        lister = ListAhead(second.catalog, store, 1000)
        await lister.run()
        assert lister.status()["state"] == "skipped" and trees == []
        clock.advance(TTL + 1)
        lister = ListAhead(second.catalog, store, 1000)
        await lister.run()
        assert lister.status()["state"] == "done" and len(trees) == 1
        second.close()
    trio.run(main)


def test_a_store_failure_during_relist_serves_the_stale_listing(bucket_mem, clock):
    store = bucket_mem.store()
    vfs = make_vfs(store)

    async def main():
        await walk(vfs, "a.txt")
        clock.advance(TTL + 1)
        store.failures["list_dir"] = Unreachable("store down")
        assert (await vfs.lookup(ROOT_INODE, "z")).size == 0
        assert [n for n, _ in await listdir(vfs, ROOT_INODE)] == ["a.txt", "d", "z"]
        assert store.calls["list_dir"] >= 2          # it did try
        with pytest.raises(Unreachable):             # nothing stale to serve for "d/"
            await walk(vfs, "d/b.bin")
    trio.run(main)


# --- lookup counts and inodes --------------------------------------------------------------------

def test_forget_drops_a_node_only_at_zero_lookups(bucket_mem):
    vfs = make_vfs(bucket_mem.store())

    async def main():
        a = await walk(vfs, "a.txt")
        assert (await vfs.lookup(ROOT_INODE, "a.txt")).inode == a.inode    # stable while known
        assert a.lookups == 2
        vfs.forget(a.inode, 1)
        assert vfs.node(a.inode) is a
        vfs.forget(a.inode, 1)
        with pytest.raises(FsError) as info:
            vfs.node(a.inode)
        assert errno_of(info) == errno.ESTALE
        again = await vfs.lookup(ROOT_INODE, "a.txt")
        assert again is not a and again.lookups == 1
        vfs.forget(ROOT_INODE, 1 << 40)
        assert vfs.node(ROOT_INODE).is_dir            # the root is never forgotten
    trio.run(main)


def test_an_open_handle_keeps_a_forgotten_node(bucket_mem):
    vfs = make_vfs(bucket_mem.store())

    async def main():
        b = await walk(vfs, "d/b.bin")
        handle, _ = await vfs.open(b.inode, os.O_RDONLY)
        vfs.forget(b.inode, 1)
        assert vfs.node(b.inode) is b
        assert await vfs.read(handle.fh, 10, 100) == BIG[10:110]
        assert (await vfs.lookup((await walk(vfs, "d")).inode, "b.bin")).inode == b.inode
        vfs.forget(b.inode, 1)
        await vfs.release(handle.fh)
        with pytest.raises(FsError):
            vfs.node(b.inode)
    trio.run(main)


# --- POSIX errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC, os.O_RDONLY | os.O_APPEND,
                                   os.O_WRONLY | os.O_CREAT])
def test_a_read_only_vfs_refuses_write_flags_with_erofs(bucket_mem, flags):
    vfs = make_vfs(bucket_mem.store())

    async def main():
        a = await walk(vfs, "a.txt")
        with pytest.raises(FsError) as info:
            await vfs.open(a.inode, flags)
        assert errno_of(info) == errno.EROFS
        assert a.opens == 0 and not vfs.handles
    trio.run(main)


def test_eisdir_enotdir_enoent(bucket_mem):
    vfs = make_vfs(bucket_mem.store())

    async def main():
        d, a = await walk(vfs, "d"), await walk(vfs, "a.txt")
        cases = [(vfs.open(d.inode, os.O_RDONLY), errno.EISDIR), (vfs.opendir(a.inode), errno.ENOTDIR),
                 (vfs.lookup(a.inode, "x"), errno.ENOTDIR), (vfs.lookup(ROOT_INODE, "nope"), errno.ENOENT),
                 (vfs.lookup(d.inode, "e/c"), errno.ENOENT), (vfs.getattr(12345), errno.ESTALE)]
        for call, code in cases:
            with pytest.raises(FsError) as info:
                await call
            assert errno_of(info) == code
    trio.run(main)


# --- version pinning (docs/design.md, invariant 1) ------------------------------------------------------

def test_a_pinned_handle_never_returns_another_version(bucket_mem):
    store = bucket_mem.store()
    vfs = make_vfs(store)
    new = random.Random(2).randbytes(3 * BS + 99)

    async def main():
        b = await walk(vfs, "d/b.bin")
        handle, _ = await vfs.open(b.inode, os.O_RDONLY)
        assert await vfs.read(handle.fh, 0, 1000) == BIG[:1000]
        bucket_mem.put("d/b.bin", new)
        assert await vfs.read(handle.fh, 0, 1000) == BIG[:1000]     # cached block of version A
        for offset in (BS, 2 * BS, 3 * BS):                          # uncached: an error, never B
            with pytest.raises(VersionChanged) as info:
                await vfs.read(handle.fh, offset, BS)
            assert errno_of(info) == errno.ESTALE
        assert store.calls["head"] == 0
    trio.run(main)


def test_after_the_ttl_a_new_open_sees_the_new_version(bucket_mem, clock):
    store = bucket_mem.store()
    vfs = make_vfs(store)
    new = random.Random(3).randbytes(BS + 7)

    async def main():
        b = await walk(vfs, "d/b.bin")
        first, keep = await vfs.open(b.inode, os.O_RDONLY)
        assert not keep                                   # the kernel has no pages of it yet
        await vfs.release(first.fh)
        bucket_mem.put("d/b.bin", new)
        again, keep = await vfs.open(b.inode, os.O_RDONLY)
        assert keep and again.file == first.file          # within the TTL: no HEAD, same version
        await vfs.release(again.fh)
        assert store.calls["head"] == 0
        clock.advance(TTL + 1)
        fresh, keep = await vfs.open(b.inode, os.O_RDONLY)
        assert store.calls["head"] == 1
        assert not keep                                   # the kernel's pages are of version A
        assert (fresh.file.etag, fresh.file.size) != (first.file.etag, first.file.size)
        assert await vfs.read(fresh.fh, 0, 1 << 20) == new
        assert (await vfs.getattr(b.inode)).size == len(new)
    trio.run(main)


def test_a_lookup_after_the_ttl_sees_the_new_version(bucket_mem, clock):
    store = bucket_mem.store()
    vfs = make_vfs(store)
    new = random.Random(5).randbytes(7)

    async def main():
        a = await walk(vfs, "a.txt")
        bucket_mem.put("a.txt", new)
        assert (await vfs.lookup(ROOT_INODE, "a.txt")).size == len(TREE["a.txt"])    # within the TTL
        clock.advance(TTL + 1)
        again = await vfs.lookup(ROOT_INODE, "a.txt")
        assert again is a and a.size == len(new)          # same inode, refreshed by the relist
        handle, _ = await vfs.open(a.inode, os.O_RDONLY)
        assert await vfs.read(handle.fh, 0, 100) == new
    trio.run(main)
    assert store.calls["list_dir"] == 2 and store.calls["head"] == 0


def test_immutable_never_heads(bucket_mem, clock):
    store = bucket_mem.store()
    vfs = make_vfs(store, immutable=True)

    async def main():
        for _ in range(3):
            b = await walk(vfs, "d/b.bin")
            await vfs.getattr(b.inode)
            handle, _ = await vfs.open(b.inode, os.O_RDONLY)
            assert await vfs.read(handle.fh, 0, 10) == BIG[:10]
            await vfs.release(handle.fh)
            clock.advance(1e6)
    trio.run(main)
    assert store.calls["head"] == 0
    assert store.calls["list_dir"] == 2


def test_a_lookup_never_reverts_a_revalidated_node(bucket_mem, clock):
    store = bucket_mem.store()
    vfs = make_vfs(store)
    new = random.Random(4).randbytes(2 * BS + 1)

    async def main():
        b = await walk(vfs, "d/b.bin")
        first, _ = await vfs.open(b.inode, os.O_RDONLY)
        bucket_mem.put("d/b.bin", new)
        with pytest.raises(VersionChanged):
            await vfs.read(first.fh, 0, BS)          # marks the node for revalidation
        second, _ = await vfs.open(b.inode, os.O_RDONLY)
        assert second.file.size == len(new)          # HEAD saw version B
        d = await walk(vfs, "d")
        again = await vfs.lookup(d.inode, "b.bin")   # the kernel looks it up again, listing still fresh
        assert again.size == len(new)                # ... but it is A's size again
        third, _ = await vfs.open(b.inode, os.O_RDONLY)
        assert await vfs.read(third.fh, 0, 1 << 20) == new
    trio.run(main)


# --- errors are logged once (docs/design.md, invariant 7) ----------------------------------------------------

@pytest.mark.allow_warnings      # the one ERROR record of the failed read
def test_a_failed_read_is_logged_once(bucket_mem, caplog):
    store = bucket_mem.store()
    vfs = make_vfs(store)
    metrics = Metrics()
    ops = Operations(vfs, Control(lambda: vfs.new_fh(2)), metrics, types.SimpleNamespace(passthrough=False), uid=0, gid=0, file_mode=0o644, dir_mode=0o755,
                     metadata_ttl=TTL, immutable=False)

    async def main():
        b = await walk(vfs, "d/b.bin")
        info = await ops.open(b.inode, os.O_RDONLY, None)
        store.failures["get"] = Unreachable("get s3://bucket/d/b.bin: connection refused")
        with pytest.raises(FuseError) as failed:
            await ops.read(info.fh, 0, BS)
        assert failed.value.errno == errno.EIO

    with caplog.at_level(logging.ERROR):
        trio.run(main)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]


@pytest.mark.parametrize("plus", [True, False])
def test_only_a_readdirplus_entry_counts_as_a_lookup(bucket_mem, plus):
    """The kernel holds each READDIRPLUS entry as if looked up (a FORGET comes for it), but
    takes no reference from a plain READDIR (which it sends for later parts of a large listing
    when READDIRPLUS is adaptive): counted there, a node would never be forgotten."""
    from cachefs.fuse.types import DirReply
    vfs = make_vfs(bucket_mem.store())
    ops = Operations(vfs, Control(lambda: vfs.new_fh(2)), Metrics(), types.SimpleNamespace(passthrough=False),
                     uid=0, gid=0, file_mode=0o644, dir_mode=0o755, metadata_ttl=TTL, immutable=True)

    class Reply(DirReply):
        def __init__(self):
            self.names = []

        def add(self, name, attr, next_offset):
            self.names.append((name, attr.ino))
            return True
    Reply.plus = plus

    async def main():
        fh = await ops.opendir(ROOT_INODE, None)
        reply = Reply()
        await ops.readdir(fh, 0, reply)
        await ops.releasedir(fh)
        assert sorted(name for name, _ in reply.names) == [b"a.txt", b"d", b"z"]
        for name, ino in reply.names:
            node = vfs.node(ino)
            assert node.lookups == (1 if plus else 0)
            again = await ops.lookup(ROOT_INODE, name)           # the same inode, counted once more
            assert again.ino == ino and node.lookups == (2 if plus else 1)
            ops.forget([(ino, node.lookups)])
            assert vfs.find_node(ino) is None                     # forgotten with the kernel's count
    trio.run(main)


@pytest.mark.parametrize("fail", [False, True])
def test_listing_ahead_lists_every_folder_and_a_failure_drops_what_it_gave(bucket_mem, fail):
    """Listings found ahead (``listahead.py``) serve the first lookups with no LIST of their own;
    if the recursive listing fails part way, the folders it gave are listed again on demand."""
    from cachefs.namespace.listahead import ListAhead
    store = bucket_mem.store()
    vfs = make_vfs(store)

    def list_tree(prefix, limit):
        for done, path in enumerate(["d/e/", "d/", ""]):
            if fail and done == 2:
                raise Unreachable("the store went away")
            yield path, store.inner.list_dir(path)
    store.list_tree = list_tree

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(vfs.blocks.run)
            lister = ListAhead(vfs.catalog, store, 1000)
            await lister.run()
            assert lister.status()["state"] == ("failed" if fail else "done")
            assert lister.status()["taken"] == (0 if fail else 3)
            for path, data in TREE.items():
                assert await open_read(vfs, path) == data
            assert store.calls["list_dir"] == (3 if fail else 0)
            nursery.cancel_scope.cancel()
    trio.run(main)
