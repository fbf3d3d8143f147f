"""The namespace: directories from prefixes, files from objects, inodes and handles.

Kernel-free: ``fuse_ops`` turns these calls into FUSE replies. All state here is
owned by the trio thread; store calls run in worker threads. Listings are
cached in memory and in the on-disk ``ListingSnapshot``; they are fresh for
``metadata_ttl`` seconds (forever when the dataset is immutable). Lookup counts
follow the kernel: +1 per lookup reply and per readdirplus entry, -n on forget.
"""

import errno
import itertools
import logging
import os
import time
from dataclasses import dataclass

import trio

from .block_cache import BlockCache, FileVersion, Stream
from .errors import CachefsError, NoSuchKey, StoreError
from .listing_snapshot import ListingSnapshot
from .singleflight import SingleFlight
from .store import Listing, ObjectInfo, ObjectStore

log = logging.getLogger(__name__)

ROOT_INODE = 1
CONTROL_INODE = 2
CONTROL_NAME = ".cachefs-control"
_FIRST_INODE = 16


class FsError(CachefsError):
    """A POSIX error for one operation (ENOENT, ENOTDIR, EROFS, ...)."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message or os.strerror(code))
        self.errno = code


class Node:
    __slots__ = ("inode", "path", "is_dir", "size", "mtime", "etag", "checked_at", "lookups",
                 "opens", "kernel_etag")

    def __init__(self, inode: int, path: str, is_dir: bool, info: ObjectInfo | None, now: float) -> None:
        self.inode = inode
        self.path = path            # relative to the mount root, "" for the root, no trailing "/"
        self.is_dir = is_dir
        self.size = info.size if info else 0
        self.mtime = info.mtime if info else now
        self.etag = info.etag if info else ""
        self.checked_at = now
        self.lookups = 0
        self.opens = 0
        self.kernel_etag: str | None = None   # the version whose pages the kernel may hold

    def update(self, info: ObjectInfo, now: float) -> None:
        self.size, self.mtime, self.etag, self.checked_at = info.size, info.mtime, info.etag, now


@dataclass(slots=True)
class DirState:
    listed_at: float
    files: dict[str, ObjectInfo]
    dirs: set[str]

    @classmethod
    def from_listing(cls, listing: Listing, listed_at: float) -> "DirState":
        files = {info.path.rsplit("/", 1)[-1]: info for info in listing.files}
        dirs = set(listing.dirs)
        for name in dirs & files.keys():
            del files[name]   # a directory shadows a file of the same name (as mountpoint-s3 does)
        return cls(listed_at, files, dirs)

    def names(self) -> list[str]:
        return sorted(self.dirs | self.files.keys())


class Handle:
    __slots__ = ("fh", "node", "file", "stream")

    def __init__(self, fh: int, node: Node, file: FileVersion | None) -> None:
        self.fh = fh
        self.node = node
        self.file = file
        self.stream = Stream()


class DirHandle:
    __slots__ = ("node", "names", "state")

    def __init__(self, node: Node, state: DirState) -> None:
        self.node = node
        self.state = state
        self.names = state.names()


def dir_prefix(path: str) -> str:
    return path + "/" if path else ""


def join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


class Vfs:
    def __init__(self, store: ObjectStore, blocks: BlockCache, snapshot: ListingSnapshot | None, *,
                 metadata_ttl: float, immutable: bool, list_limiter: trio.CapacityLimiter | None = None
                 ) -> None:
        self.store = store
        self.blocks = blocks
        self.snapshot = snapshot
        self.ttl = metadata_ttl
        self.immutable = immutable
        self._limiter = list_limiter or trio.CapacityLimiter(16)
        now = time.time()
        self._nodes: dict[int, Node] = {ROOT_INODE: Node(ROOT_INODE, "", True, None, now)}
        self._nodes[ROOT_INODE].lookups = 1 << 62      # never forgotten
        self._by_path: dict[str, int] = {"": ROOT_INODE}
        self._dirs: dict[str, DirState] = {}
        self._listings = SingleFlight()
        self._next_inode = itertools.count(_FIRST_INODE)
        self._next_fh = itertools.count(1)
        self.handles: dict[int, Handle] = {}
        self.dir_handles: dict[int, DirHandle] = {}

    # ---- freshness and listings -------------------------------------------------------------
    def is_fresh(self, stamp: float) -> bool:
        return self.immutable or time.time() - stamp < self.ttl

    async def dir_state(self, path: str) -> DirState:
        state = self._dirs.get(path)
        if state is not None and self.is_fresh(state.listed_at):
            return state
        if state is None and self.snapshot is not None:
            saved = self.snapshot.load(dir_prefix(path))
            if saved is not None:
                state = self._dirs[path] = DirState.from_listing(saved[1], saved[0])
                if self.is_fresh(state.listed_at):
                    return state
        return await self._listings.do(path, lambda: self._relist(path, state))

    async def _relist(self, path: str, stale: DirState | None) -> DirState:
        prefix = dir_prefix(path)
        started = time.time()
        try:
            listing = await trio.to_thread.run_sync(self.store.list_dir, prefix, limiter=self._limiter)
        except StoreError as exc:
            if stale is None:
                raise
            log.info("listing %r failed (%s); serving the previous listing", prefix, exc)
            return stale
        state = self._dirs[path] = DirState.from_listing(listing, started)
        if self.snapshot is not None:
            self.snapshot.save(prefix, listing, started)
        self._refresh_known_children(path, state, started)
        return state

    def _refresh_known_children(self, path: str, state: DirState, now: float) -> None:
        for name, info in state.files.items():
            inode = self._by_path.get(join(path, name))
            if inode is not None and not self._nodes[inode].is_dir:
                self._nodes[inode].update(info, now)

    # ---- nodes ------------------------------------------------------------------------------
    def node(self, inode: int) -> Node:
        try:
            return self._nodes[inode]
        except KeyError:
            raise FsError(errno.ESTALE, f"unknown inode {inode}") from None

    def _node_for(self, path: str, is_dir: bool, info: ObjectInfo | None) -> Node:
        inode = self._by_path.get(path)
        now = time.time()
        if inode is not None:
            node = self._nodes[inode]
            if node.is_dir == is_dir:
                if info is not None and info.etag != node.etag:
                    node.update(info, now)
                return node
            self._drop(node)
        node = Node(next(self._next_inode), path, is_dir, info, now)
        self._nodes[node.inode] = node
        self._by_path[path] = node.inode
        return node

    def _drop(self, node: Node) -> None:
        self._nodes.pop(node.inode, None)
        if self._by_path.get(node.path) == node.inode:
            del self._by_path[node.path]

    def remember(self, node: Node) -> None:
        """The kernel now holds one more reference to ``node``."""
        node.lookups += 1

    def forget(self, inode: int, count: int) -> None:
        node = self._nodes.get(inode)
        if node is None or inode == ROOT_INODE:
            return
        node.lookups -= count
        if node.lookups <= 0 and node.opens <= 0:
            self._drop(node)

    async def lookup(self, parent_inode: int, name: str) -> Node:
        parent = self.node(parent_inode)
        if not parent.is_dir:
            raise FsError(errno.ENOTDIR)
        node = await self.child(parent, name)
        self.remember(node)
        return node

    async def child(self, parent: Node, name: str) -> Node:
        """The node for ``name`` in ``parent`` without touching its lookup count."""
        state = await self.dir_state(parent.path)
        path = join(parent.path, name)
        if name in state.dirs:
            return self._node_for(path, True, None)
        info = state.files.get(name)
        if info is None:
            raise FsError(errno.ENOENT)
        return self._node_for(path, False, info)

    async def getattr(self, inode: int) -> Node:
        node = self.node(inode)
        if not node.is_dir:
            await self.revalidate(node)
        return node

    async def revalidate(self, node: Node) -> None:
        """Refresh a file's metadata with a HEAD once its TTL has passed (DESIGN invariant 1)."""
        if self.is_fresh(node.checked_at):
            return
        try:
            info = await trio.to_thread.run_sync(self.store.head, node.path, limiter=self._limiter)
        except NoSuchKey:
            raise FsError(errno.ENOENT, f"{node.path} no longer exists in the store") from None
        if info.etag != node.etag:
            log.info("%s changed in the store (ETag %s -> %s)", node.path, node.etag, info.etag)
        node.update(info, time.time())
        if self.snapshot is not None:
            self.snapshot.update_file(info)

    # ---- directories ------------------------------------------------------------------------
    async def opendir(self, inode: int) -> int:
        node = self.node(inode)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        fh = self.new_fh()
        self.dir_handles[fh] = DirHandle(node, await self.dir_state(node.path))
        return fh

    def readdir_entries(self, fh: int, start: int):
        """Yield (name, node, next_offset) from offset ``start``; stable across calls."""
        handle = self.dir_handles[fh]
        for offset in range(start, len(handle.names)):
            name = handle.names[offset]
            path = join(handle.node.path, name)
            if name in handle.state.dirs:
                node = self._node_for(path, True, None)
            else:
                node = self._node_for(path, False, handle.state.files[name])
            yield name, node, offset + 1

    def releasedir(self, fh: int) -> None:
        self.dir_handles.pop(fh, None)

    # ---- files ------------------------------------------------------------------------------
    async def open(self, inode: int, flags: int) -> tuple[Handle, bool]:
        """A handle pinned to the object's current version, and whether the kernel may keep
        its cached pages (only when the version it cached is still current)."""
        node = self.node(inode)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise FsError(errno.EROFS)
        await self.revalidate(node)
        keep_cache = node.kernel_etag == node.etag
        node.kernel_etag = node.etag
        fh = self.new_fh()
        handle = self.handles[fh] = Handle(fh, node, FileVersion(node.path, node.etag, node.size))
        node.opens += 1
        return handle, keep_cache

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        handle = self.handles[fh]
        try:
            return await self.blocks.read(handle.file, offset, size, handle.stream)
        except StoreError:
            handle.node.checked_at = 0.0      # the next open revalidates
            raise

    def release(self, fh: int) -> None:
        handle = self.handles.pop(fh, None)
        if handle is not None:
            handle.node.opens -= 1
            self.forget(handle.node.inode, 0)

    def new_fh(self) -> int:
        return next(self._next_fh)

    def close(self) -> None:
        if self.snapshot is not None:
            self.snapshot.close()
