"""Inodes: the ``Node`` of a file or directory and the inode table (inode -> node, path -> inode).

Lookup counts follow the kernel: +1 per lookup reply and per readdirplus entry, -n on forget;
a node is dropped when the kernel forgets it and no handle holds it open, never on unlink.
"""

import errno
import itertools
import os
from dataclasses import dataclass

from cachefs.errors import CachefsError
from cachefs.store import ObjectInfo
from cachefs.writeback.staged import StagedFile

ROOT_INODE = 1
CONTROL_INODE = 2
_FIRST_INODE = 16


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
                 "opens", "kernel_etag", "staged", "packed", "mode", "row")

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
        self.packed = None          # a packed dataset's file: where its bytes are (namespace/packed.py)
        self.mode: int | None = None  # st_mode a packed dataset's index records (None: the mount's file mode)
        self.row = -1               # a packed dataset's file: its index row (-1: not known)

    def show(self, entry: StagedFile) -> None:
        self.staged = entry
        self.size, self.mtime = entry.size, entry.mtime

    def update(self, info: ObjectInfo, now: float) -> None:
        self.size, self.mtime, self.etag, self.checked_at = info.size, info.mtime, info.etag, now

    @property
    def is_store_file(self) -> bool:
        """A file served from the store (not a directory, not staged)."""
        return not self.is_dir and self.staged is None


class NodeTable:
    """The inodes the kernel knows, and the path each names now."""

    def __init__(self, now: float) -> None:
        root = Node(ROOT_INODE, "", True, None, now)
        root.lookups = 1 << 62      # never forgotten
        self._nodes: dict[int, Node] = {ROOT_INODE: root}
        self._by_path: dict[str, int] = {"": ROOT_INODE}
        self._next_inode = itertools.count(_FIRST_INODE)

    def __len__(self) -> int:
        return len(self._nodes)

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
                if info is not None and info.etag != node.etag:
                    node.update(info, now)
                return node
            self.drop(node)
        node = Node(next(self._next_inode), path, is_dir, info, now)
        self._nodes[node.inode] = node
        self._by_path[path] = node.inode
        return node

    def drop(self, node: Node) -> None:
        self._nodes.pop(node.inode, None)
        if self._by_path.get(node.path) == node.inode:
            del self._by_path[node.path]

    def forget(self, inode: int, count: int) -> None:
        node = self._nodes.get(inode)
        if node is None or inode == ROOT_INODE:
            return
        node.lookups -= count
        if node.lookups <= 0 and node.opens <= 0:
            self.drop(node)

    def unlink(self, path: str) -> None:
        self._by_path.pop(path, None)     # the kernel may still hold the inode; forget drops it

    def move(self, old: str, new: str) -> None:
        inode = self._by_path.pop(old, None)
        self._by_path.pop(new, None)
        if inode is not None:
            self._nodes[inode].path = new
            self._by_path[new] = inode
