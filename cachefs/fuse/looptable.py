"""The table request-loop processes answer from: which inodes have a published backing id, and
what each loop has opened and released on it.

A loop process (``loop_worker.py``) reads requests from a cloned ``/dev/fuse`` descriptor and
answers the OPEN of an inode whose backing id the daemon published here, and the RELEASE of what
such an open returned, by itself; every other request goes to the daemon. The table is one
shared memory file (``memfd``) the daemon creates and each loop maps:

- ``inode[n]``: 0, or ``(slot + 1) << 32 | backing_id``: the backing every open of inode ``n``
  must be answered with (the kernel allows one per inode while any file of it is open). Written
  by the daemon only, one aligned 8-byte word at a time (a loop never sees half of one);
- ``opened[loop][slot]``, ``released[loop][slot]``: 32-bit counters, each row written by one
  loop only (row 0: the daemon, for the releases it reads itself). The files the loops hold open
  on a slot's backing are the sum of ``opened`` less the sum of ``released``;
- ``seq[loop]``: odd while the loop answers a request, even between requests. A backing the daemon
  takes out of ``inode`` is closed only after every loop has been even, or moved on, since (so no
  loop still answers an open with it) and its open count is zero.

Handles a loop gives out carry ``LOOP_FH``, the daemon's nonce and the slot, so any loop (or the
daemon) can count their RELEASE, and a handle of an earlier daemon of the mount (another nonce)
is answered without being counted.

The daemon's own request loop answers from the table too (row 0), with the same code as a loop
process (``answerer``): an open of a published inode costs it a table read and an answer, not
the layers of an open (a request object, the operations, the namespace, a handle). So the table
exists wherever the loops could run, with or without loop processes (``loops`` 0).

Only this module (with ``abi``'s constants) is shared with the loop processes; they import
nothing else of cachefs.
"""

import errno
import mmap
import os
import struct
from collections.abc import Callable

from cachefs.fuse import abi

MAGIC = 0x63_66_73_6C_6F_6F_70_31        # "cfsloop1"
LOOP_FH = 1 << 63                         # the bit of a handle a loop process gave out
HEADER = 4096
SEQ_STRIDE = 64                           # one cache line per loop: seq, then its counters
STATS = ("opens", "releases", "ioctls", "forwarded")     # row 0: what the daemon answered from the table
OPEN_REFUSED = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT      # opens a table never answers
READY = b"ready"                          # a loop's first message on its socket: it reads requests now

_HEAD = struct.Struct("<IIQQ")            # len, opcode, unique, nodeid: what the answerer reads of a request
_OPEN_FLAGS = struct.Struct("<I")
_FH = struct.Struct("<Q")
_OPEN_ANSWER = abi.OUT_HEADER.size + abi.OPEN_OUT.size
_GONE = (errno.ENOENT, errno.ENODEV, errno.ECONNABORTED)    # an answer nobody waits for any more


class LoopTable:
    """A view of the shared table (``fd``: its memfd). ``create`` makes one; a loop maps it."""

    def __init__(self, fd: int, *, inodes: int, slots: int, loops: int) -> None:
        self.fd = fd
        self.inodes, self.slots, self.loops = inodes, slots, loops
        rows = loops + 1
        self._seq_at = HEADER
        self._counts_at, self._inode_at, self.size = self._layout(inodes=inodes, slots=slots, loops=loops)
        self.map = mmap.mmap(fd, self.size)
        self._words = memoryview(self.map).cast("Q")
        self.header = self._words[:HEADER // 8]
        self.seq = self._words[self._seq_at // 8:self._counts_at // 8]     # [row * 8]: seq, [row * 8 + 1..]: stats
        self._counts = memoryview(self.map)[self._counts_at:self._inode_at].cast("I")
        self.opened = [self._counts[r * slots:(r + 1) * slots] for r in range(rows)]
        self.released = [self._counts[(rows + r) * slots:(rows + r + 1) * slots] for r in range(rows)]
        self.inode = self._words[self._inode_at // 8:]

    @classmethod
    def create(cls, *, inodes: int = 1 << 24, slots: int = 81920, loops: int = 1, nonce: int = 0) -> "LoopTable":
        """A new table in a memfd (sparse: an inode's page is backed once one near it is published)."""
        fd = os.memfd_create("cachefs-loops", os.MFD_CLOEXEC)
        os.ftruncate(fd, cls._layout(inodes=inodes, slots=slots, loops=loops)[2])
        table = cls(fd, inodes=inodes, slots=slots, loops=loops)
        table.header[0], table.header[1], table.header[2], table.header[3], table.header[4] = (
            MAGIC, nonce, loops, inodes, slots)
        return table

    @classmethod
    def attach(cls, fd: int) -> "LoopTable":
        """Map the table of ``fd`` (a loop process): its shape is in its header."""
        head = mmap.mmap(fd, HEADER, prot=mmap.PROT_READ)
        magic, _nonce, loops, inodes, slots = memoryview(head).cast("Q")[:5]
        head.close()
        if magic != MAGIC:
            raise ValueError("not a cachefs loop table")
        return cls(fd, inodes=inodes, slots=slots, loops=loops)

    @staticmethod
    def _layout(*, inodes: int, slots: int, loops: int) -> tuple[int, int, int]:
        """Where the counters and the inode table start, and the table's whole size."""
        rows = loops + 1
        counts_at = HEADER + rows * SEQ_STRIDE
        counts_at += -counts_at % 8
        inode_at = counts_at + 2 * rows * slots * 4
        inode_at += -inode_at % 4096
        return counts_at, inode_at, inode_at + inodes * 8

    @property
    def nonce(self) -> int:
        return self.header[1]

    # ---- the daemon's side -------------------------------------------------------------------------
    def publish(self, inode: int, slot: int, backing_id: int) -> bool:
        """Loops may answer opens of ``inode`` with ``backing_id`` (counted on ``slot``)."""
        if not 0 < inode < self.inodes:
            return False
        self.inode[inode] = (slot + 1) << 32 | backing_id
        return True

    def retract(self, inode: int) -> None:
        if 0 < inode < self.inodes:
            self.inode[inode] = 0

    def open_files(self, slot: int) -> int:
        """Files the loops opened on ``slot`` and the kernel has not released (any loop's count)."""
        opened = sum(row[slot] for row in self.opened)
        released = sum(row[slot] for row in self.released)
        return (opened - released) & 0xFFFFFFFF

    def reset(self, slot: int) -> None:
        """``slot`` holds a new backing: its counts start again (no loop counts on it now)."""
        for row in self.opened:
            row[slot] = 0
        for row in self.released:
            row[slot] = 0

    def positions(self) -> list[int]:
        return [self.seq[r * 8] for r in range(1, self.loops + 1)]

    def passed(self, since: list[int], gone: set[int]) -> bool:
        """Whether every loop has been between requests since ``positions()`` gave ``since``
        (a loop in ``gone``, exited, counts as between requests)."""
        for i, then in enumerate(since, start=1):
            if i in gone or not then & 1:
                continue
            if self.seq[i * 8] == then:
                return False
        return True

    def released_here(self, fh: int, row: int = 0) -> None:
        """The RELEASE of a loop's handle ``fh`` was read (by the daemon: row 0, or by loop ``row``):
        counted on its slot, unless an earlier daemon gave it out (another nonce)."""
        if (fh >> 32) & 0xFFFF == self.nonce & 0xFFFF:
            slot = fh & 0xFFFFFFFF
            if slot < self.slots:
                self.released[row][slot] = (self.released[row][slot] + 1) & 0xFFFFFFFF
        self.seq[row * 8 + 2] += 1

    def answerer(self, row: int, opened_inode: Callable[[int], None] | None = None
                 ) -> Callable[[memoryview, int], int]:
        """What answers the requests this table can answer alone, counting them in ``row`` (a
        loop's; 0: the daemon's): the OPEN of a published inode (read-only), the RELEASE of a
        handle a loop gave out, an ioctl on one (ENOTTY: CPython's ``open`` asks ``isatty``). It
        takes a request as read and the descriptor it was read from (the answer goes there), and
        returns its opcode if answered, else 0 (the caller's to answer). ``opened_inode`` is told
        each inode opened. An answer the kernel no longer waits for (interrupted, unmounted) counts
        as given, but an open so refused is not counted open; other write errors are raised."""
        inode, opened, seq, released_here = self.inode, self.opened[row], self.seq, self.released_here
        inodes, nonce, stat = self.inodes, self.nonce & 0xFFFF, row * 8
        mine = LOOP_FH | nonce << 32
        head, open_flags, fh_at = _HEAD.unpack_from, _OPEN_FLAGS.unpack_from, _FH.unpack_from
        pack_out, pack_open = abi.OUT_HEADER.pack, abi.OPEN_OUT.pack
        OPEN, RELEASE, IOCTL, PASSTHROUGH = abi.OPEN, abi.RELEASE, abi.IOCTL, abi.FOPEN_PASSTHROUGH
        body, empty, writev = abi.IN_HEADER.size, abi.OUT_HEADER.size, os.writev

        def answer(view: memoryview, fuse_fd: int) -> int:
            try:
                return _answer(view, fuse_fd)
            except struct.error:           # shorter than its opcode's request: the caller's to refuse
                return 0

        def _answer(view: memoryview, fuse_fd: int) -> int:
            _len, opcode, unique, nodeid = head(view)
            if opcode == OPEN:
                entry = inode[nodeid] if nodeid < inodes else 0
                if not entry or open_flags(view, body)[0] & OPEN_REFUSED:
                    return 0
                slot = (entry >> 32) - 1
                opened[slot] = (opened[slot] + 1) & 0xFFFFFFFF        # counted before the kernel can release
                try:
                    writev(fuse_fd, [pack_out(_OPEN_ANSWER, 0, unique),
                                     pack_open(mine | slot, PASSTHROUGH, entry & 0xFFFFFFFF)])
                except OSError as exc:
                    opened[slot] = (opened[slot] - 1) & 0xFFFFFFFF    # not opened: no RELEASE will come
                    if exc.errno not in _GONE:
                        raise
                    return opcode
                seq[stat + 1] += 1
                if opened_inode is not None:
                    opened_inode(nodeid)
                return opcode
            if opcode == RELEASE:
                fh = fh_at(view, body)[0]
                if not fh & LOOP_FH:
                    return 0
                released_here(fh, row)
                error = 0
            elif opcode == IOCTL and fh_at(view, body)[0] & LOOP_FH:
                seq[stat + 3] += 1
                error = -errno.ENOTTY
            else:
                return 0
            try:
                writev(fuse_fd, [pack_out(empty, error, unique)])
            except OSError as exc:
                if exc.errno not in _GONE:
                    raise
            return opcode

        return answer

    def stats(self, loop: int) -> dict[str, int]:
        return {name: self.seq[loop * 8 + 1 + i] for i, name in enumerate(STATS)}

    def close(self) -> None:
        for view in (*self.opened, *self.released, self.header, self.seq, self.inode, self._counts, self._words):
            view.release()
        try:
            self.map.close()
        except BufferError:             # a view still held somewhere: the mapping goes with the process
            pass
        os.close(self.fd)
