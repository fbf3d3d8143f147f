"""The backing files the kernel reads an open file from (FUSE passthrough), by inode.

The kernel's rules, each measured (docs/design.md, measured facts): every open of an inode that has
a backing file must use that one backing id, and a cached or direct-I/O open beside it fails; an
id must live until the inode's last RELEASE. So: one ``Backing`` per inode, counted by its open
handles; an inode with other handles open is not handed over.

A backing whose last handle is released stays registered while the kernel still knows the inode
(until its FORGET), so the next open of a file read again (a hot epoch) is answered with the same
id: no syscall, no verification. Such idle backings keep their cache files held from eviction,
so they are bounded (``max_idle`` of them, ``--fuse-idle-backings``; ``max_idle_bytes`` of files,
a quarter of the disk tier); past either, the oldest are closed.

Where request loops can run as processes (``loop_procs.py``; an ``--immutable`` mount with
passthrough), every backing is published in their table for them, and the daemon's own loop, to
answer opens with (``attach``), with or without loop processes. Closing one then waits: it is
taken out of the table and kept, still answering the daemon's full-path opens of its inode, until
no loop can still answer an open with it and every file opened from the table on it is released
(``sweep``, ticked by the loops).

There a backing is also registered ahead, when a file is looked up, or listed with its attributes
(READDIRPLUS: registered once no request waits), and its verified cache file is at hand (``add``
with no open): the OPEN that follows is answered from the table (by a loop, or by the daemon's
loop with no operation run). It starts idle, so it is bounded and closed like any idle one; a
listing registers only while there is ``room``, so a dataset listed whole keeps the first files
it listed rather than churning.

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
    slot: int = -1                # its slot in the loop processes' table (-1: not published)
    closing: object = None        # taken out of the loops' table, to close once they let go (Closing)
    stale: bool = False           # its cache file was found corrupt: never answers another open

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
        self._loops = None                         # the loop processes (loop_procs.LoopProcesses), if any
        self._closing: dict[int, Backing] = {}     # inode -> backing waiting for the loops to let go

    def attach(self, loops) -> None:
        """Request loop processes run: publish every backing for them, from now on each new one."""
        self._loops = loops
        loops.ticks.append(self.sweep)
        for backing in self.by_inode.values():
            self._publish(backing)

    def _publish(self, backing: Backing) -> None:
        if self._loops is not None:
            backing.slot = self._loops.publish(backing.inode, backing.id, backing.slot)

    def __len__(self) -> int:
        return len(self.by_inode)

    def reuse(self, inode: int) -> int:
        """The backing id of ``inode`` with one more open, or 0 if it has none."""
        backing = self.by_inode.get(inode)
        if backing is None or backing.stale:
            return 0
        if backing.closing is not None:            # still registered: the loops may answer opens again
            backing.closing = None
            del self._closing[inode]
            self._publish(backing)
        if backing.opens == 0 and inode in self._idle:
            del self._idle[inode]
            self._idle_bytes -= backing.size
        backing.opens += 1
        return backing.id

    def add(self, inode: int, backing_id: int, exact: ExactFile, *, opens: int = 1) -> None:
        """A new backing of ``inode``, with ``opens`` handles (0: registered ahead of any open,
        idle from the start)."""
        self.by_inode[inode] = backing = Backing(backing_id, exact, opens=opens, inode=inode)
        self._publish(backing)
        if opens == 0:
            self._rest(inode, backing)

    def restore(self, inode: int, backing_id: int) -> None:
        """A backing id a previous daemon registered for ``inode`` (pinned until its FORGET)."""
        self.by_inode[inode] = backing = Backing(backing_id, None, opens=0, inode=inode)
        self._publish(backing)

    def bind(self, fh: int, inode: int) -> None:
        self.by_fh[fh] = inode

    def unbind(self, fh: int) -> None:
        """``fh`` was released; its inode's backing becomes idle when that was its last handle."""
        inode = self.by_fh.pop(fh, None)
        backing = self.by_inode.get(inode) if inode is not None else None
        if backing is None:
            return
        backing.opens -= 1
        if backing.opens == 0 and backing.stale:
            self._idle[inode] = backing         # closed at once (once the loops let go)
            self._idle_bytes += backing.size
            self._drop(inode)
        elif backing.opens == 0 and backing.exact is not None:
            self._rest(inode, backing)

    def _rest(self, inode: int, backing: Backing) -> None:
        """``backing`` has no open handle: kept idle, the oldest idle ones closed past the bounds."""
        self._idle[inode] = backing
        self._idle_bytes += backing.size
        while self._idle and (len(self._idle) > self.max_idle or self._idle_bytes > self.max_idle_bytes):
            self._drop(next(iter(self._idle)))

    @property
    def ahead(self) -> bool:
        """Whether a looked-up file's backing is worth registering before its open: that open is
        then answered from the loops' table (a loop process's, or the daemon's lean path)."""
        return self._loops is not None

    def room(self, size: int) -> bool:
        """Whether one more idle backing of ``size`` bytes fits with none closed for it."""
        return len(self._idle) < self.max_idle and self._idle_bytes + size <= self.max_idle_bytes

    def blocked(self, inode: int) -> bool:
        """``inode`` has a backing no open may use (stale) that the kernel may still read through:
        no other backing can be registered for it yet."""
        backing = self.by_inode.get(inode)
        return backing is not None and backing.stale

    def corrupt(self, digest: str) -> int:
        """The cache file ``digest`` was found corrupt: its backings answer no more opens (new ones
        go the usual way, which fetches the object again) and close once nothing reads them; files
        already open keep reading what they read. The number of backings so marked."""
        marked = 0
        for inode, backing in list(self.by_inode.items()):
            if backing.exact is None or backing.stale or backing.exact.key.digest() != digest:
                continue
            backing.stale = True
            marked += 1
            if inode in self._idle:
                self._drop(inode)
            elif backing.slot >= 0 and backing.closing is None:
                backing.closing = self._loops.retract(inode, backing.slot)    # the loops stop answering with it
                self._closing[inode] = backing
        return marked

    def forget(self, inode: int) -> None:
        """The kernel forgot ``inode``: its idle (or restored) backing is closed (no file of the
        inode is open any more, in any loop, and no open of it can come)."""
        if inode in self._idle:
            self._drop(inode, now=True)
        else:
            backing = self.by_inode.get(inode)
            if backing is not None and (backing.closing is not None or backing.exact is None and backing.opens <= 0):
                self._closing.pop(inode, None)
                self._unpublish(backing)
                del self.by_inode[inode]
                self._close(backing)

    def close_all(self) -> None:
        """The session ends: every idle backing is closed, and those the loops had not let go."""
        for inode in list(self._idle):
            self._drop(inode, now=True)
        for inode in list(self._closing):
            backing = self._closing.pop(inode)
            del self.by_inode[inode]
            self._close(backing)

    def sweep(self) -> None:
        """Close the backings the loops have let go of (``loop_procs``: ``closable``)."""
        for inode, backing in list(self._closing.items()):
            if backing.opens <= 0 and self._loops.closable(backing.closing):
                del self._closing[inode]
                del self.by_inode[inode]
                self._loops.free(backing.slot)
                self._close(backing)

    def _drop(self, inode: int, now: bool = False) -> None:
        backing = self._idle.pop(inode)
        self._idle_bytes -= backing.size
        if backing.slot >= 0 and not now:
            backing.closing = self._loops.retract(inode, backing.slot)    # closed by ``sweep``
            self._closing[inode] = backing
            return
        self._unpublish(backing)
        del self.by_inode[inode]
        self._close(backing)

    def _unpublish(self, backing: Backing) -> None:
        if backing.slot >= 0:
            self._loops.withdraw(backing.inode, backing.slot)
            backing.slot = -1
