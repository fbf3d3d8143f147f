"""The write path without a kernel: ``Vfs`` + ``Writeback`` + ``Tiers`` over a store and a
staging dir, and a POSIX-like driver that does what the kernel does before it calls the
filesystem (path walk, the type and ancestry checks of rename/unlink/rmdir, open-or-create)
and maps errors as ``fuse_ops`` does. ``Portal`` runs the stack's trio loop in a thread so a
synchronous caller (a Hypothesis state machine) can drive it while uploads run in real time.
"""

import errno
import os
import random
import threading
from contextlib import asynccontextmanager

import pytest
import trio
from memory_stores import BS, CountingStore, MemoryBucket, make_cache

from cachefs.errors import CachefsError
from cachefs.metrics import Metrics
from cachefs.namespace.catalog import Catalog
from cachefs.namespace.vfs import ROOT_INODE, FsError, Node, Vfs, join, split
from cachefs.ports import Port
from cachefs.store import ObjectStore
from cachefs.writeback.engine import Writeback
from cachefs.writeback.journal import Journal
from cachefs.writeback.policy import SyncPolicy, WritebackOptions


def make_policy(*, log_period: float = 600.0, quiet: float = 600.0, checkpoint: float = 600.0,
                small: int = 100 << 10) -> SyncPolicy:
    return SyncPolicy(("*.log", "*.txt"), ("*.pt",), small, log_period, quiet, checkpoint)


def build_vfs(store: ObjectStore, blocks, snapshot=None, *, ttl: float = 60.0, immutable: bool = False,
              writeback: Writeback | None = None, **kwargs) -> Vfs:
    """A ``Vfs`` over its own ``Catalog``, the two wired as daemon.py wires them."""
    listed, versioned = Port("listed"), Port("versioned")
    catalog = Catalog(store, snapshot, metadata_ttl=ttl, immutable=immutable, listed=listed, versioned=versioned,
                      replayed=writeback.replayed_dirs if writeback is not None else None)
    return Vfs(store, blocks, catalog, writeback=writeback, listed=listed, versioned=versioned, **kwargs)


def make_stack(store: ObjectStore, staging: str, *, policy: SyncPolicy | None = None, metrics: Metrics | None = None,
               staging_size: int = 1 << 30, staging_wait: float = 1.0, part_size: int = 5 << 20,
               fsync_remote: bool = False, ttl: float = 60.0) -> tuple[Vfs, Writeback]:
    metrics = metrics or Metrics()
    retired, barrier = Port("retired"), Port("barrier")     # wired as daemon.py wires them
    options = WritebackOptions(policy or make_policy(), staging_size=staging_size, staging_wait=staging_wait,
                               part_size=part_size, upload_concurrency=4, log_concurrency=2)
    wb = Writeback(store, Journal(staging, fsync=False), options, metrics, retired=retired, barrier=barrier)
    blocks = make_cache(store, metrics)    # the read path, as its own tests build it
    vfs = build_vfs(store, blocks, ttl=ttl, writeback=wb, fsync_remote=fsync_remote, retired=retired,
                    barrier=barrier)
    return vfs, wb


@asynccontextmanager
async def running(vfs: Vfs, wb: Writeback):
    """The stack's background tasks (block cache, write-back scheduler) for the body's duration."""
    async with trio.open_nursery() as nursery:
        await nursery.start(vfs.blocks.run)
        await nursery.start(wb.run)
        try:
            yield nursery
        finally:
            nursery.cancel_scope.cancel()


def _oserror(exc: BaseException) -> OSError:
    """As ``fuse_ops._operation`` maps it: the errno a caller of the mount would see."""
    code = getattr(exc, "errno", None) or errno.EIO
    return OSError(code, f"{os.strerror(code)}: {exc}")


class Driver:
    """Path operations on a Vfs as a process sees them through the kernel (async; relative paths)."""

    def __init__(self, vfs: Vfs, root: str = "") -> None:
        self.vfs = vfs
        self.root = root

    def _full(self, rel: str) -> str:
        rel = rel.strip("/")
        return join(self.root, rel) if rel else self.root

    async def _walk(self, path: str) -> Node:
        node = self.vfs.node(ROOT_INODE)
        for name in filter(None, path.split("/")):
            if not node.is_dir:
                raise OSError(errno.ENOTDIR, path)
            node = await self.vfs.child(node, name)
        return node

    async def _child(self, parent: Node, name: str) -> Node | None:
        try:
            return await self.vfs.child(parent, name)
        except FsError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise

    async def _dir(self, rel: str) -> tuple[Node, str]:
        """The parent directory of ``rel`` (walked as the kernel does) and the last name."""
        parent_path, name = split(self._full(rel))
        parent = await self._walk(parent_path)
        if not parent.is_dir:
            raise OSError(errno.ENOTDIR, rel)
        return parent, name

    async def _parent(self, rel: str) -> tuple[Node, str, Node | None]:
        parent, name = await self._dir(rel)
        return parent, name, await self._child(parent, name)

    async def call(self, name: str, *args):
        try:
            return await getattr(self, "_" + name)(*args)
        except (CachefsError, OSError) as exc:
            raise _oserror(exc) from None

    # ---- files ------------------------------------------------------------------------------
    async def _open(self, rel: str, flags: int) -> int:
        parent, name, node = await self._parent(rel)
        if node is None:
            if not flags & os.O_CREAT:
                raise OSError(errno.ENOENT, rel)
            handle, _ = await self.vfs.create(parent.inode, name, flags & ~os.O_CREAT)
            return handle.fh
        if node.is_dir:     # open(2) for writing, or Python's open() after its fstat
            raise OSError(errno.EISDIR, rel)
        handle, _ = await self.vfs.open(node.inode, flags & ~os.O_CREAT)
        return handle.fh

    async def _close(self, fh: int) -> None:
        await self.vfs.release(fh)

    async def _pwrite(self, fh: int, data: bytes, offset: int) -> int:
        return await self.vfs.write(fh, offset, data)

    async def _append(self, fh: int, data: bytes) -> int:
        return await self.vfs.write(fh, self.vfs.handles[fh].node.size, data)

    async def _pread(self, fh: int, size: int, offset: int) -> bytes:
        parts, got = [], 0
        while got < size:
            chunk = await self.vfs.read(fh, offset + got, min(size - got, 128 << 10))
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    async def _fsync(self, fh: int) -> None:
        await self.vfs.fsync(fh)

    async def _write_at(self, rel: str, flags: int, offset: int, data: bytes) -> int:
        fh = await self._open(rel, os.O_WRONLY | flags)
        try:
            if flags & os.O_APPEND:
                return await self._append(fh, data)
            return await self._pwrite(fh, data, offset)
        finally:
            await self.vfs.release(fh)

    async def _read_all(self, rel: str) -> bytes:
        fh = await self._open(rel, os.O_RDONLY)
        try:
            return await self._pread(fh, 1 << 40, 0)
        finally:
            await self.vfs.release(fh)

    async def _fsync_path(self, rel: str) -> None:
        fh = await self._open(rel, os.O_RDWR)
        try:
            await self.vfs.fsync(fh)
        finally:
            await self.vfs.release(fh)

    async def _truncate(self, rel: str, size: int) -> None:
        node = await self._walk(self._full(rel))
        if node.is_dir:
            raise OSError(errno.EISDIR, rel)
        await self.vfs.setattr(node.inode, size, None)

    async def _kind_and_size(self, rel: str) -> tuple[str, int]:
        node = await self.vfs.getattr((await self._walk(self._full(rel))).inode)
        return ("dir", 0) if node.is_dir else ("file", node.size)

    # ---- names ------------------------------------------------------------------------------
    async def _listdir(self, rel: str) -> list[str]:
        node = await self._walk(self._full(rel))
        if not node.is_dir:
            raise OSError(errno.ENOTDIR, rel)
        fh = await self.vfs.opendir(node.inode)
        try:
            return sorted(name for name, _, _ in self.vfs.readdir_entries(fh, 0))
        finally:
            self.vfs.releasedir(fh)

    async def _mkdir(self, rel: str) -> None:
        parent, name, node = await self._parent(rel)
        if node is not None:
            raise OSError(errno.EEXIST, rel)
        await self.vfs.mkdir(parent.inode, name)

    async def _rmdir(self, rel: str) -> None:
        parent, name, node = await self._parent(rel)
        if node is None:
            raise OSError(errno.ENOENT, rel)
        if not node.is_dir:
            raise OSError(errno.ENOTDIR, rel)
        await self.vfs.rmdir(parent.inode, name)

    async def _unlink(self, rel: str) -> None:
        parent, name, node = await self._parent(rel)
        if node is None:
            raise OSError(errno.ENOENT, rel)
        if node.is_dir:
            raise OSError(errno.EISDIR, rel)
        await self.vfs.unlink(parent.inode, name)

    async def _rename(self, src: str, dst: str, flags: int = 0) -> None:
        """The checks of Linux ``renameat2`` before it calls the filesystem, in its order."""
        old, new = self._full(src), self._full(dst)
        old_parent, old_name = await self._dir(src)        # both parents first, then the names
        new_parent, new_name = await self._dir(dst)
        old_node = await self._child(old_parent, old_name)
        if old_node is None:
            raise OSError(errno.ENOENT, src)
        new_node = await self._child(new_parent, new_name)
        if new.startswith(old + "/"):
            raise OSError(errno.EINVAL, "a directory cannot move below itself")
        if old.startswith(new + "/"):
            raise OSError(errno.ENOTEMPTY, "the target is an ancestor of the source")
        if old == new:
            return
        if new_node is not None:
            if old_node.is_dir and not new_node.is_dir:
                raise OSError(errno.ENOTDIR, dst)
            if not old_node.is_dir and new_node.is_dir:
                raise OSError(errno.EISDIR, dst)
        await self.vfs.rename(old_parent.inode, old_name, new_parent.inode, new_name, flags)

    async def _tree(self) -> tuple[dict[str, bytes], set[str]]:
        """Every file (with its content) and folder below the root, relative to it."""
        files, folders = {}, set()

        async def visit(rel: str) -> None:
            for name in await self._listdir(rel):
                child = f"{rel}/{name}" if rel else name
                kind, _ = await self._kind_and_size(child)
                if kind == "dir":
                    folders.add(child)
                    await visit(child)
                else:
                    files[child] = await self._read_all(child)

        await visit("")
        return files, folders


class Portal:
    """A trio loop in a thread running a Vfs + Writeback; synchronous calls into it."""

    def __init__(self, vfs: Vfs, wb: Writeback) -> None:
        self.vfs, self.wb = vfs, wb
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="kernel-free-stack", daemon=True)

    def __enter__(self) -> "Portal":
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc) -> None:
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(30)
        self.vfs.close()

    def _main(self) -> None:
        async def main():
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            async with running(self.vfs, self.wb):
                self._ready.set()
                await self._stop.wait()

        try:
            trio.run(main)
        except BaseException as exc:    # reported by __enter__ or the next call
            self._error = exc
            self._ready.set()

    def run(self, fn, *args):
        """``await fn(*args)`` on the stack's loop; its result or exception."""
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def sync(self, timeout: float = 60.0) -> bool:
        async def flush() -> bool:
            self.wb.request_sync()
            return await self.wb.wait_synced(None, timeout)

        return self.run(flush)


class SyncDriver:
    """``Driver`` as blocking calls (through a ``Portal``), rooted at ``root``."""

    def __init__(self, portal: Portal, root: str = "") -> None:
        self.portal = portal
        self.driver = Driver(portal.vfs, root)

    def __getattr__(self, name: str):
        return lambda *args: self.portal.run(self.driver.call, name, *args)


class WriteCountingStore(CountingStore):
    """``CountingStore`` whose write calls are counted too, and can be failed or held at a Gate."""

    def _pass(method: str):     # noqa: N805  (a helper that builds methods)
        def call(self, *args):
            self._enter(method, *args)
            return getattr(self.inner, method)(*args)

        call.__name__ = method
        return call

    put = _pass("put")
    start_upload = _pass("start_upload")
    upload_part = _pass("upload_part")
    finish_upload = _pass("finish_upload")
    abort_upload = _pass("abort_upload")
    delete = _pass("delete")
    copy = _pass("copy")
    make_dir = _pass("make_dir")
    remove_dir = _pass("remove_dir")
    del _pass


# ---- helpers of the kernel-free write-back tests ----------------------------------------------

def counted(bucket: MemoryBucket) -> WriteCountingStore:
    return WriteCountingStore(bucket.store().inner)


def stored(store, path: str) -> bytes:
    info = store.inner.head(path)
    return store.inner.get(path, 0, info.size, info.etag, info.size)


async def oserror(coro) -> int:
    with pytest.raises(OSError) as info:
        await coro
    return info.value.errno


async def until(predicate, timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


# ---- a small tree, and walking it as the kernel would (namespace tests) -------------------------

BIG = random.Random(1).randbytes(3 * BS + 5)
TREE = {"a.txt": b"hello world", "d/b.bin": BIG, "d/e/c": b"c", "z": b""}


async def walk(vfs: Vfs, path: str):
    """Look up each component of ``path`` as the kernel would; the last node."""
    node = vfs.node(ROOT_INODE)
    for name in path.split("/"):
        node = await vfs.lookup(node.inode, name)
    return node


async def listdir(vfs: Vfs, inode: int, start: int = 0) -> list[tuple[str, int]]:
    fh = await vfs.opendir(inode)
    try:
        return [(name, next_offset) for name, _, next_offset in vfs.readdir_entries(fh, start)]
    finally:
        vfs.releasedir(fh)
