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

A backing id lives in the connection, not in the daemon: one a previous daemon of the mount
registered is taken over (``restore``) and answers every open of its inode from then on. How many
files the kernel has open on it is not known, so it is never closed while idle, only at the
inode's FORGET.
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from cachefs.tiers.handover import ExactFile


@dataclass(slots=True)
class Backing:
    id: int
    exact: ExactFile | None       # None: restored (the kernel holds the file; no cache file is held here)
    opens: int = 1
    inode: int = 0

    @property
    def size(self) -> int:
        return self.exact.size if self.exact is not None else 0


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
        if backing.opens == 0 and inode in self._idle:
            del self._idle[inode]
            self._idle_bytes -= backing.size
        backing.opens += 1
        return backing.id

    def add(self, inode: int, backing_id: int, exact: ExactFile) -> None:
        self.by_inode[inode] = Backing(backing_id, exact, inode=inode)

    def restore(self, inode: int, backing_id: int) -> None:
        """A backing id a previous daemon registered for ``inode`` (pinned until its FORGET)."""
        self.by_inode[inode] = Backing(backing_id, None, opens=0, inode=inode)

    def bind(self, fh: int, inode: int) -> None:
        self.by_fh[fh] = inode

    def unbind(self, fh: int) -> None:
        """``fh`` was released; its inode's backing becomes idle when that was its last handle."""
        inode = self.by_fh.pop(fh, None)
        backing = self.by_inode.get(inode) if inode is not None else None
        if backing is None:
            return
        backing.opens -= 1
        if backing.opens == 0 and backing.exact is not None:
            self._idle[inode] = backing
            self._idle_bytes += backing.size
            while self._idle and (len(self._idle) > self.max_idle or self._idle_bytes > self.max_idle_bytes):
                self._drop(next(iter(self._idle)))

    def forget(self, inode: int) -> None:
        """The kernel forgot ``inode``: its idle (or restored) backing is closed."""
        if inode in self._idle:
            self._drop(inode)
        else:
            backing = self.by_inode.get(inode)
            if backing is not None and backing.exact is None and backing.opens <= 0:
                del self.by_inode[inode]
                self._close(backing)

    def close_all(self) -> None:
        for inode in list(self._idle):
            self._drop(inode)

    def _drop(self, inode: int) -> None:
        backing = self._idle.pop(inode)
        self._idle_bytes -= backing.size
        del self.by_inode[inode]
        self._close(backing)
