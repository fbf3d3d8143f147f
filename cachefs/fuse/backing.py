"""The backing files the kernel reads an open file from (FUSE passthrough), by inode.

The kernel's rules, each measured (docs/design.md, measured facts): every open of an inode that has
a backing file must use that one backing id, and a cached or direct-I/O open beside it fails; an
id must live until the inode's last RELEASE. So: one ``Backing`` per inode, counted by its open
handles; an inode with other handles open is not handed over.

A backing whose last handle is released stays registered while the kernel still knows the inode
(until its FORGET), so the next open of a file read again (a hot epoch) is answered with the same
id: no syscall, no verification. Such idle backings keep their cache files held from eviction,
so they are bounded (``max_idle`` of them, ``max_idle_bytes`` of files); past either, the oldest
are closed.
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from cachefs.tiers.handover import ExactFile


@dataclass(slots=True)
class Backing:
    id: int
    exact: ExactFile
    opens: int = 1


class Backings:
    def __init__(self, close: Callable[[Backing], None], *, max_idle: int = 65536,
                 max_idle_bytes: int = 4 << 30) -> None:
        self._close = close                        # closes the id and releases the cache file
        self.max_idle, self.max_idle_bytes = max_idle, max_idle_bytes
        self.by_inode: dict[int, Backing] = {}
        self.by_fh: dict[int, int] = {}            # file handle -> inode
        self._idle: OrderedDict[int, Backing] = OrderedDict()     # inode -> backing with no open handle
        self._idle_bytes = 0

    def __len__(self) -> int:
        return len(self.by_inode)

    def reuse(self, inode: int) -> int:
        """The backing id of ``inode`` with one more open, or 0 if it has none."""
        backing = self.by_inode.get(inode)
        if backing is None:
            return 0
        if backing.opens == 0:
            del self._idle[inode]
            self._idle_bytes -= backing.exact.size
        backing.opens += 1
        return backing.id

    def add(self, inode: int, backing_id: int, exact: ExactFile) -> None:
        self.by_inode[inode] = Backing(backing_id, exact)

    def bind(self, fh: int, inode: int) -> None:
        self.by_fh[fh] = inode

    def unbind(self, fh: int) -> None:
        """``fh`` was released; its inode's backing becomes idle when that was its last handle."""
        inode = self.by_fh.pop(fh, None)
        backing = self.by_inode.get(inode) if inode is not None else None
        if backing is None:
            return
        backing.opens -= 1
        if backing.opens == 0:
            self._idle[inode] = backing
            self._idle_bytes += backing.exact.size
            while self._idle and (len(self._idle) > self.max_idle or self._idle_bytes > self.max_idle_bytes):
                self._drop(next(iter(self._idle)))

    def forget(self, inode: int) -> None:
        """The kernel forgot ``inode``: its idle backing (if any) is closed."""
        if inode in self._idle:
            self._drop(inode)

    def close_all(self) -> None:
        for inode in list(self._idle):
            self._drop(inode)

    def _drop(self, inode: int) -> None:
        backing = self._idle.pop(inode)
        self._idle_bytes -= backing.exact.size
        del self.by_inode[inode]
        self._close(backing)
