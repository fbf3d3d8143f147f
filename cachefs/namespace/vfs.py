"""The namespace: directories from prefixes, files from objects, inodes and handles.

Kernel-free: ``fuse_ops`` turns these calls into FUSE replies. All state here is
owned by the trio thread; store calls run in worker threads. Listings are the
``Catalog``'s (``catalog.py``: listed, saved, fresh for ``metadata_ttl`` seconds or
forever when the dataset is immutable); this module lays what the write-back has
staged over each listing it takes, and keeps the nodes. The write-back is asked only
what is staged (``staged``, ``overlay``, ``space``); ``nodes``, ``dirs`` and
``handles`` hold the plain data. A file's bytes come from its source (``content.py``:
the store through the block cache, a packed dataset, or a staged file), picked per
handle by ``source``; this module never reads them itself.
"""

import errno
import itertools
import logging
import os
import time

import trio

from cachefs.control.protocol import CONTROL_NAME
from cachefs.errors import NeedsWait, NoSuchKey, StoreError
from cachefs.namespace.adopt import Adoption
from cachefs.namespace.catalog import Catalog
from cachefs.namespace.changes import NameChanges
from cachefs.namespace.content import WRITE_FLAGS, PackedContent, StagedContent, StoreContent
from cachefs.namespace.dirs import DirHandle, DirState, dir_prefix, join, split
from cachefs.namespace.handles import Handle, fh_inode
from cachefs.namespace.ids import IdLog
from cachefs.namespace.nodes import CONTROL_INODE, ROOT_INODE, FsError, FsStats, Node, NodeTable
from cachefs.packed.view import PACKED_DIR, PackedView
from cachefs.ports import Port
from cachefs.store import ObjectInfo, ObjectStore
from cachefs.tiers.cache import FileVersion, Tiers
from cachefs.writeback.engine import Writeback
from cachefs.writeback.staged import StagedFile, Superseded

__all__ = ["CONTROL_INODE", "CONTROL_NAME", "ROOT_INODE", "DirState", "FsError", "FsStats", "Handle", "Node",
           "Vfs", "dir_prefix", "join", "split"]

log = logging.getLogger(__name__)


class Vfs(NameChanges, Adoption):
    def __init__(self, store: ObjectStore, blocks: Tiers, catalog: Catalog, *,
                 writeback: Writeback | None = None, fsync_remote: bool = False, packed: PackedView | None = None,
                 listed: Port | None = None, versioned: Port | None = None, retired: Port | None = None,
                 barrier: Port | None = None, ids: IdLog | None = None, generation: int = 0,
                 versioned_inodes: bool = False) -> None:
        self.store = store
        self.catalog = catalog      # every directory's listing (catalog.py)
        self.packed = packed        # a packed dataset's view (packed/view.py), also the catalog's source
        self.wb = writeback         # None: a read-only mount (EROFS)
        self.fsync_remote = fsync_remote
        self._uploaded: dict[str, tuple[ObjectInfo, float]] = {}   # retired lately: for racing listings
        self._saved = catalog.saved                     # told of the mount's own changes
        if listed is not None:
            listed.connect(self._listed)                # the catalog took a listing
        if versioned is not None:
            versioned.connect(self._versioned)          # a warmup saw a newer version
        if retired is not None:
            retired.connect(self._retired)              # a staged file reached the store
        if barrier is not None:
            barrier.connect(self._saved.sync)           # rows durable before the record covering them goes
        self.blocks = blocks
        # where files' bytes come from (content.py): the store (or a packed dataset), and staged files
        self.files = PackedContent(packed, blocks) if packed is not None else StoreContent(blocks)
        self.staged = StagedContent(writeback) if writeback is not None else None
        self._limiter = catalog.limiter
        # versioned_inodes: a new version of a file is a new inode (nodes.NodeTable), for FUSE
        # passthrough on a mount whose objects can change
        self._nodes = NodeTable(time.time(), ids, versioned=versioned_inodes)
        self._next_fh = itertools.count(1)
        self.generation = generation        # 0: a new mount; n: the n-th daemon to serve it (keeper.py)
        self.handles: dict[int, Handle] = {}
        self.dir_handles: dict[int, DirHandle] = {}

    # ---- freshness and listings (catalog.py) ------------------------------------------------
    def is_fresh(self, stamp: float) -> bool:
        return self.catalog.is_fresh(stamp)

    async def dir_state(self, path: str) -> DirState:
        return await self.catalog.state(path)

    def _listed(self, path: str, state: DirState, from_store: bool) -> None:
        """The catalog took a listing of ``path``: lay the staged changes over it; one fresh from
        the store also refreshes the nodes of the files it names."""
        if from_store:
            self._refresh_known_children(path, state, state.listed_at)
        self._overlay(path, state)

    def _refresh_known_children(self, path: str, state: DirState, now: float) -> None:
        for name, info in state.files.items():
            node = self._nodes.at(join(path, name))
            if node is not None and node.is_store_file:
                self._nodes.new_version(node, info, now)

    def _overlay(self, path: str, state: DirState) -> None:
        """Apply what is written but not yet (or only just) in the store to a fresh listing."""
        if self.wb is None:
            return
        state.apply(self.wb.overlay(path))
        for target, (info, at) in self._uploaded.items():
            parent, name = split(target)
            if parent == path and at >= state.listed_at - 5 and self.wb.staged(target) is None:
                state.files[name] = info

    # ---- nodes ------------------------------------------------------------------------------
    def node(self, inode: int) -> Node:
        return self._nodes.get(inode)

    def find_node(self, inode: int) -> Node | None:
        """The node of ``inode``, or None if the kernel forgot it (for log lines)."""
        return self._nodes.find(inode)

    def inode_count(self) -> int:
        return len(self._nodes)

    @property
    def writable(self) -> bool:
        return self.wb is not None

    def statfs(self) -> FsStats:
        if self.wb is None:
            return FsStats(None, 0, len(self._nodes))
        capacity, used = self.wb.space()
        return FsStats(capacity, max(0, capacity - used), len(self._nodes))

    def _node_for(self, path: str, is_dir: bool, info: ObjectInfo | None) -> Node:
        return self._nodes.node_for(path, is_dir, info, time.time())

    def remember(self, node: Node) -> None:
        """The kernel now holds one more reference to ``node``."""
        node.lookups += 1

    def forget(self, inode: int, count: int) -> None:
        self._nodes.forget(inode, count)

    async def lookup(self, parent_inode: int, name: str) -> Node:
        parent = self.node(parent_inode)
        if not parent.is_dir:
            raise FsError(errno.ENOTDIR)
        node = await self.child(parent, name)
        self.remember(node)
        if node.is_store_file and self.is_fresh(node.checked_at):
            self.files.looked_up(node)          # an open comes next
        return node

    def lookup_now(self, parent_inode: int, name: str) -> Node:
        """``lookup`` when the parent's listing is cached and fresh (NeedsWait otherwise)."""
        parent = self.node(parent_inode)
        if not parent.is_dir:
            raise FsError(errno.ENOTDIR)
        if self.packed is not None and parent.inode == ROOT_INODE and name == PACKED_DIR:
            node = self._node_for(PACKED_DIR, True, None)
        else:
            state = self.catalog.fresh(parent.path)
            if state is None:
                raise NeedsWait
            node = self._child_in(state, parent, name)
        self.remember(node)
        if node.is_store_file and self.is_fresh(node.checked_at):
            self.files.looked_up(node)          # an open comes next
        return node

    def getattr_now(self, inode: int) -> Node:
        """``getattr`` when the node needs no revalidation (NeedsWait otherwise)."""
        node = self.node(inode)
        if node.is_store_file and not self.is_fresh(node.checked_at):
            raise NeedsWait
        return node

    async def child(self, parent: Node, name: str) -> Node:
        """The node for ``name`` in ``parent`` without touching its lookup count."""
        if self.packed is not None and parent.inode == ROOT_INODE and name == PACKED_DIR:
            return self._node_for(PACKED_DIR, True, None)    # the raw layout: found, not listed
        return self._child_in(await self.dir_state(parent.path), parent, name)

    def _child_in(self, state: DirState, parent: Node, name: str) -> Node:
        path = join(parent.path, name)
        if name in state.dirs:
            return self._node_for(path, True, None)
        info = state.files.get(name)
        if info is None:
            raise FsError(errno.ENOENT)
        return self._file_node(path, info)

    def _file_node(self, path: str, info: ObjectInfo) -> Node:
        if self.packed is not None:
            node = self._node_for(path, False, info)
            if node.mode is None:
                node.row, node.mode = self.packed.locate(path, info)   # the mode from the index
            return node
        entry = self.wb.staged(path) if self.wb is not None else None
        if entry is None:
            return self._node_for(path, False, info)
        node = self._node_for(path, False, None)
        node.show(entry)
        return node

    async def getattr(self, inode: int) -> Node:
        node = self.node(inode)
        if node.is_store_file:
            await self.revalidate(node)
        return node

    async def revalidate(self, node: Node) -> None:
        """Refresh a file's metadata with a HEAD once its TTL has passed (docs/design.md, invariant 1).
        With versioned inodes a new version supersedes the node (``node.superseded``), which keeps
        the version it had."""
        if self.is_fresh(node.checked_at) or node.superseded:
            return
        try:
            info = await trio.to_thread.run_sync(self.store.head, node.path, limiter=self._limiter)
        except NoSuchKey:
            raise FsError(errno.ENOENT, f"{node.path} no longer exists in the store") from None
        except StoreError as exc:
            # the store is down: keep serving the version we know (its blocks may be cached)
            log.info("revalidating %s failed (%s); serving the known version", node.path, exc)
            node.checked_at = self.catalog.retry_stamp()
            return
        if info.etag != node.etag:
            log.info("%s changed in the store (ETag %s -> %s)", node.path, node.etag, info.etag)
        self._nodes.new_version(node, info, time.time())
        self.catalog.publish(info)

    # ---- directories ------------------------------------------------------------------------
    async def opendir(self, inode: int) -> int:
        node = self.node(inode)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        fh = self.new_fh(inode)
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
                node = self._file_node(path, handle.state.files[name])
            yield name, node, offset + 1

    def releasedir(self, fh: int) -> None:
        self.dir_handles.pop(fh, None)

    # ---- files ------------------------------------------------------------------------------
    def handover_version(self, inode: int, flags: int) -> FileVersion | None:
        """The version an open of ``inode`` would pin, when the open could be handed to the kernel
        (a store file of an unpacked mount, opened for reading, nothing staged, fresh): None when
        it cannot; NeedsWait when the node needs revalidating first. No side effect."""
        node = self.node(inode)
        if (node.is_dir or not node.is_store_file or node.staged is not None or not self.files.hands_over
                or flags & WRITE_FLAGS):
            return None
        if not self.is_fresh(node.checked_at) or node.superseded:
            raise NeedsWait
        return StoreContent.version(node)

    def open_now(self, inode: int, flags: int, *, handed_over: bool = False) -> tuple[Handle, bool]:
        """``open`` of a file for reading that needs no revalidation and no content pushed to the
        kernel first (``preload``; none when the kernel reads the cache file itself,
        ``handed_over``): NeedsWait otherwise."""
        node = self.node(inode)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if flags & WRITE_FLAGS or not self.is_fresh(node.checked_at) or node.superseded:
            raise NeedsWait
        if not handed_over and node.staged is None and self.files.preload_needed(node):
            raise NeedsWait               # the open pushes the content to the kernel: an await
        if node.staged is not None:
            return self._new_handle(node, node.staged, writable=False), False
        return self._open_file(node, flags)

    async def open(self, inode: int, flags: int) -> tuple[Handle, bool]:
        """A handle pinned to the object's current version, and whether the kernel may keep
        its cached pages (only when the version it cached is still current)."""
        node = self.node(inode)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if flags & WRITE_FLAGS and self.files.writable:
            return await self._open_for_write(node, flags), False
        if node.staged is not None:
            return self._new_handle(node, node.staged, writable=False), False
        await self.revalidate(node)          # a packed dataset is immutable: always fresh
        if node.superseded:
            # a newer version has its own inode: ESTALE makes the kernel look the path up again
            raise FsError(errno.ESTALE, f"{node.path}: a newer version has a new inode")
        return self._open_file(node, flags)

    def _open_file(self, node: Node, flags: int) -> tuple[Handle, bool]:
        """A handle on the version of ``node`` its source pins (content.py)."""
        file, keep_cache = self.files.open(node, flags)
        fh = self.new_fh(node.inode)
        handle = self.handles[fh] = Handle(fh, node, file)
        node.opens += 1
        return handle, keep_cache

    def source(self, handle: Handle) -> StoreContent | PackedContent | StagedContent:
        """Where a read of ``handle`` gets its bytes: the staged file it reads while there is
        one readable, else the mount's files."""
        if self.staged is not None:
            entry = StagedContent.entry(handle)
            if entry is not None and entry.readable:
                return self.staged
        return self.files

    async def preload(self, handle: Handle) -> bytes | None:
        """Content to push into the kernel page cache at open (see Tiers.preload)."""
        return await self.source(handle).preload(handle)

    def read_now(self, fh: int, offset: int, size: int) -> bytes | memoryview:
        """``read`` that needs no wait: a store file whose blocks the memory tier holds
        (NeedsWait otherwise)."""
        handle = self.handle(fh)
        return self.source(handle).read_now(handle, offset, size)

    def release_now(self, fh: int) -> None:
        """``release`` of a handle with no staged file (NeedsWait for one that has)."""
        handle = self.handles.get(fh)
        if handle is not None and handle.entry is not None:
            raise NeedsWait
        if handle is not None:
            del self.handles[fh]
            handle.node.opens -= 1
            self.blocks.stop(handle.stream)
            self.forget(handle.node.inode, 0)

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        handle = self.handle(fh)
        return await self.source(handle).read(handle, offset, size)

    async def release(self, fh: int) -> None:
        handle = self.handles.pop(fh, None)
        if handle is not None:
            handle.node.opens -= 1
            self.blocks.stop(handle.stream)
            if handle.entry is not None:
                await self.wb.released(handle.entry, writable=handle.writable)
            self.forget(handle.node.inode, 0)

    def close(self) -> None:
        self.catalog.close()
        if self.wb is not None:
            self.wb.close()

    # ---- writes (docs/writeback.md) --------------------------------------------------------
    def _writeback(self) -> Writeback:
        if self.wb is None:
            raise FsError(errno.EROFS)
        return self.wb

    def _new_handle(self, node: Node, entry: StagedFile | None, *, writable: bool) -> Handle:
        fh = self.new_fh(node.inode)
        handle = self.handles[fh] = Handle(fh, node, None, entry, writable)
        node.opens += 1
        if entry is not None:
            self.wb.opened(entry, writable=writable)
        return handle

    async def _stage(self, node: Node, *, empty: bool) -> StagedFile:
        """The staged file of ``node``: its own, a new empty one, or a copy of its object."""
        wb = self._writeback()
        if node.staged is not None:
            return node.staged
        if empty:
            entry = await wb.create(node.path, remote=True)
        else:
            await self.revalidate(node)
            entry = await wb.copy_up(node.path, node.etag, node.size)
        node.show(entry)
        return entry

    async def _open_for_write(self, node: Node, flags: int) -> Handle:
        wb = self._writeback()
        truncate = bool(flags & os.O_TRUNC)
        entry = await self._stage(node, empty=truncate)
        if truncate and entry.size:
            await wb.truncate(entry, 0)
        node.show(entry)
        return self._new_handle(node, entry, writable=bool(flags & (os.O_WRONLY | os.O_RDWR)))

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        handle = self.handles.get(fh) or await self.adopt_writer(fh)
        if not handle.writable or handle.entry is None:
            raise FsError(errno.EBADF)
        written = await self.wb.write(handle.entry, offset, data)
        if handle.node.staged is handle.entry:
            handle.node.size, handle.node.mtime = handle.entry.size, handle.entry.mtime
        return written

    async def fsync(self, fh: int) -> None:
        handle = self.handle(fh)
        entry = handle.entry or handle.node.staged
        if entry is not None and entry.readable:
            await self.wb.fsync(entry, remote=self.fsync_remote)

    async def setattr(self, inode: int, size: int | None, mtime: float | None, fh: int | None = None) -> Node:
        node = self.node(inode)
        self._writeback()
        if size is not None:
            if node.is_dir:
                raise FsError(errno.EISDIR)
            if fh is not None and fh not in self.handles and fh_inode(fh) == inode:
                await self.adopt_writer(fh)      # ftruncate on a file a previous daemon opened: a writer
            for _ in range(3):
                entry = await self._stage(node, empty=size == 0)
                try:
                    await self.wb.truncate(entry, size)
                    break
                except Superseded:      # uploaded and retired meanwhile (no writer held it): stage it again
                    continue
            else:
                raise FsError(errno.EAGAIN, f"{node.path}: retired three times during a truncate")
            node.show(entry)
        if mtime is not None and node.staged is not None:
            self.wb.set_mtime(node.staged, mtime)
            node.mtime = mtime
        return node

    async def _parent_state(self, parent_inode: int) -> tuple[Node, DirState]:
        parent = self.node(parent_inode)
        if not parent.is_dir:
            raise FsError(errno.ENOTDIR)
        return parent, await self.dir_state(parent.path)

    def _retired(self, entry: StagedFile, info: ObjectInfo) -> None:
        """``entry`` is in the store as ``info``: serve it through the block cache from now on."""
        now = time.time()
        node = self._nodes.at(entry.path)
        if node is not None and node.staged is entry:
            node.staged = None
            self._nodes.update(node, info, now)
            for handle in self.handles.values():
                if handle.node is node:
                    handle.file = None
        self.catalog.set_file(entry.path, info)
        self._uploaded[entry.path] = (info, now)
        if len(self._uploaded) > 10000:
            self._uploaded = {p: v for p, v in self._uploaded.items() if now - v[1] < 300}
        self._saved.file_changed(entry.path, info)

    def _versioned(self, info: ObjectInfo) -> None:
        """A newer version of a file (a warmup's HEAD after a 412): its node shows it from now on."""
        node = self._nodes.at(info.path)
        if node is not None and node.is_store_file:
            self._nodes.new_version(node, info, time.time())
