"""Inodes: the ``Node`` of a file or directory and the inode table (inode -> node, path -> inode).

Lookup counts follow the kernel: +1 per lookup reply and per readdirplus entry, -n on forget;
a node is dropped when the kernel forgets it and no handle holds it open, never on unlink.
Every node id handed out and every one retired is written down (``ids.IdLog``), so that the
next daemon of a live mount knows them (``restore``).
"""

import errno
import itertools
import os
from dataclasses import dataclass

from cachefs.errors import CachefsError
from cachefs.namespace.ids import IdLog, KnownNode
from cachefs.store import ObjectInfo
from cachefs.writeback.staged import StagedFile

ROOT_INODE = 1
CONTROL_INODE = 2
_FIRST_INODE = 16
_RESTORED = 1 << 48      # the lookup count of a node a previous daemon handed out (its own count is unknown)


class FsError(CachefsError):
    """A POSIX error for one operation (ENOENT, ENOTDIR, EROFS, ...)."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message or os.strerror(code))
        self.errno = code


@dataclass(frozen=True, slots=True)
class FsStats:
    """What ``statfs`` reports: staging space on a writable mount (None: read-only), inodes known."""

    capacity: int | None
    free: int
    inodes: int


class Node:
    __slots__ = ("inode", "path", "is_dir", "size", "mtime", "etag", "checked_at", "lookups",
                 "opens", "kernel_etag", "staged", "packed", "mode", "row", "superseded")

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
        self.staged: StagedFile | None = None  # written here, not (yet) retired to the store
        self.packed = None          # a packed dataset's file: where its bytes are (packed/view.py)
        self.mode: int | None = None  # st_mode a packed dataset's index records (None: the mount's file mode)
        self.row = -1               # a packed dataset's file: its index row (-1: not known)
        self.superseded = False     # a newer version of its path has a node of its own (NodeTable.versioned)

    def show(self, entry: StagedFile) -> None:
        self.staged = entry
        self.size, self.mtime = entry.size, entry.mtime

    def update(self, info: ObjectInfo, now: float) -> None:
        self.size, self.mtime, self.etag, self.checked_at = info.size, info.mtime, info.etag, now

    @property
    def restored(self) -> bool:
        """Handed out by a previous daemon of this mount (its kernel lookups are not known)."""
        return self.lookups >= _RESTORED and self.inode != ROOT_INODE

    @property
    def is_store_file(self) -> bool:
        """A file served from the store (not a directory, not staged)."""
        return not self.is_dir and self.staged is None


class NodeTable:
    """The inodes the kernel knows, and the path each names now.

    ``versioned``: a new version of a file gets a new inode (``supersede``); the old node keeps
    its version for the handles and the kernel references that hold it, and its path no longer
    names it. A mount whose kernel reads cache files itself (FUSE passthrough) needs this when its
    objects can change: the kernel keeps one backing file per inode while it is open."""

    def __init__(self, now: float, ids: IdLog | None = None, *, versioned: bool = False) -> None:
        root = Node(ROOT_INODE, "", True, None, now)
        root.lookups = 1 << 62      # never forgotten
        self._nodes: dict[int, Node] = {ROOT_INODE: root}
        self._by_path: dict[str, int] = {"": ROOT_INODE}
        self._next_inode = itertools.count(_FIRST_INODE)
        self.ids = ids
        self.versioned = versioned

    def restore(self, known: list[KnownNode]) -> None:
        """Take over the nodes a previous daemon handed out: same ids, same paths. Their
        versions are revalidated before use (unless the dataset is immutable); the kernel's
        lookup counts are not known, so the first FORGET of one drops it (the kernel sends
        FORGET when it evicts an inode, with every lookup it holds)."""
        for item in known:
            if item.inode in self._nodes:
                continue
            node = Node(item.inode, item.path, item.is_dir,
                        None if item.is_dir else ObjectInfo(item.path, item.size, item.mtime, item.etag), 0.0)
            node.checked_at = item.checked     # fresh until its TTL runs out, as in the previous daemon
            node.lookups = _RESTORED
            self._nodes[item.inode] = node
            if item.linked and item.path not in self._by_path:
                self._by_path[item.path] = item.inode
        top = max((item.inode for item in known), default=0)
        self._next_inode = itertools.count(max(_FIRST_INODE, top + 1))

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self):
        return iter(list(self._nodes.values()))

    def get(self, inode: int) -> Node:
        try:
            return self._nodes[inode]
        except KeyError:
            raise FsError(errno.ESTALE, f"unknown inode {inode}") from None

    def find(self, inode: int) -> Node | None:
        return self._nodes.get(inode)

    def at(self, path: str) -> Node | None:
        """The node that names ``path`` now, if the kernel knows one."""
        inode = self._by_path.get(path)
        return None if inode is None else self._nodes[inode]

    def node_for(self, path: str, is_dir: bool, info: ObjectInfo | None, now: float) -> Node:
        """The node of ``path`` (updated to ``info`` if its version changed), made if needed."""
        node = self.at(path)
        if node is not None:
            if node.is_dir == is_dir:
                if info is None or info.etag == node.etag:
                    return node
                if not self.new_version(node, info, now):
                    return node
            else:
                self.drop(node)
        node = Node(next(self._next_inode), path, is_dir, info, now)
        self._nodes[node.inode] = node
        self._by_path[path] = node.inode
        if self.ids is not None:
            self.ids.node(node.inode, path, is_dir, node.size, node.mtime, node.checked_at, node.etag)
        return node

    def new_version(self, node: Node, info: ObjectInfo, now: float) -> bool:
        """The store holds ``info`` for ``node``'s path: update the node in place, or, ``versioned``
        and the ETag changed, supersede it (True: the path names no node until it is looked up)."""
        if self.versioned and not node.is_dir and node.etag and info.etag != node.etag:
            self.supersede(node)
            return True
        self.update(node, info, now)
        return False

    def supersede(self, node: Node) -> None:
        """A newer version of ``node``'s path gets a node of its own; ``node`` keeps its version."""
        node.superseded = True
        if self._by_path.get(node.path) == node.inode:
            self.unlink(node.path)

    def update(self, node: Node, info: ObjectInfo, now: float) -> None:
        """``node`` names ``info``'s version, current as of ``now`` (a new version is written down)."""
        changed = info.etag != node.etag or info.size != node.size
        node.update(info, now)
        if changed and self.ids is not None and node.inode in self._nodes:
            self.ids.version(node.inode, node.size, node.mtime, now, node.etag)

    def drop(self, node: Node) -> None:
        if self._nodes.pop(node.inode, None) is not None and self.ids is not None:
            self.ids.dropped(node.inode)
        if self._by_path.get(node.path) == node.inode:
            del self._by_path[node.path]

    def forget(self, inode: int, count: int) -> None:
        node = self._nodes.get(inode)
        if node is None or inode == ROOT_INODE:
            return
        if node.lookups >= _RESTORED and count:
            node.lookups = 0              # a restored node: the kernel evicted it
        node.lookups -= count
        if node.lookups <= 0 and node.opens <= 0:
            self.drop(node)

    def unlink(self, path: str) -> None:
        inode = self._by_path.pop(path, None)     # the kernel may still hold the inode; forget drops it
        if inode is not None and self.ids is not None:
            self.ids.unlinked(inode)

    def move(self, old: str, new: str) -> None:
        inode = self._by_path.pop(old, None)
        replaced = self._by_path.pop(new, None)
        if replaced is not None and self.ids is not None:
            self.ids.unlinked(replaced)
        if inode is not None:
            self._nodes[inode].path = new
            self._by_path[new] = inode
            if self.ids is not None:
                self.ids.moved(inode, new)
