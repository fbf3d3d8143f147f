"""The requests in flight, kept where the next daemon finds them: for kernels that cannot resend.

A FUSE request the daemon has read is the daemon's alone: the kernel keeps its caller waiting
until an answer with its ``unique`` comes back on the descriptor it was read from. Since Linux 6.9
a new daemon asks the kernel to send every such request again (``FUSE_NOTIFY_RESEND``); before
that, a daemon that dies leaves their callers waiting forever (and a lost READ keeps its page
locked, so every later reader of that page waits too). So on those kernels the session reads each
request straight into a free slot of this log, a file in the cache dir mapped in memory, and frees
the slot once the answer is written. The kernel's copy into the slot is the record: a daemon killed
at any point after ``read(2)`` returned, even before it ran another instruction, leaves the request
in the page cache of the file, where the next daemon finds it. That daemon handles the requests
still there as resent ones (``Context.resent``: a mkdir, unlink, rmdir or rename that was already
applied is answered as done) and answers each with its own unique on its own descriptor.

Layout: a 4 KiB header (magic, slot count, slot size), then ``slots`` slots, each a 16-byte prefix
(the index of the descriptor it is read from, written when the slot is handed to a reader) and the
request as the kernel wrote it; the request's length field is the slot's state (0: free).

What is not kept: requests read while every slot was taken (counted, ``unlogged``); FORGET,
BATCH_FORGET and INTERRUPT, which have no answer and are not run again (a lost FORGET leaves a node
in memory). What can run twice: a request whose answer was written but whose slot was not yet freed
when the daemon died. The kernel drops an answer nobody waits for; the request itself does the same
thing again (WRITE, SETATTR, reads) or is answered as already applied (the namespace operations).
"""

import contextlib
import logging
import mmap
import os
import struct
import threading

from cachefs.fuse import abi

log = logging.getLogger(__name__)

MAGIC = b"CFSINFL2"
FILE_HEADER = struct.Struct("<8sII")        # magic, slots, slot size
PREFIX = struct.Struct("<I12x")             # the descriptor index; the request follows
REQUEST_HEAD = struct.Struct("<II")         # the request's own length (0: a free slot) and opcode
HEADER_SIZE = 4096
SLOTS = 128
_NOT_RUN_AGAIN = {abi.FORGET, abi.BATCH_FORGET, abi.INTERRUPT, abi.INIT}     # no answer to give


class InflightLog:
    """``reserve`` a slot to read a request into (any thread), ``done`` once it is answered;
    ``pending`` what a dead predecessor left unanswered."""

    def __init__(self, path: str, *, fresh: bool, slots: int = SLOTS, slot_size: int = 0) -> None:
        self.path = path
        self.unlogged = 0
        self.replayed = 0
        self._pending: list[tuple[int, int, memoryview]] = []
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if not fresh:
                fresh = not self._read_geometry(fd)
            if fresh:
                self.slots = slots
                self.slot_size = _round_up(slot_size or abi.BUFFER_SIZE + PREFIX.size, 4096)
                os.ftruncate(fd, 0)                  # every slot free (a sparse file: only used pages count)
                os.ftruncate(fd, HEADER_SIZE + self.slots * self.slot_size)
                os.pwrite(fd, FILE_HEADER.pack(MAGIC, self.slots, self.slot_size), 0)
            self._map = mmap.mmap(fd, HEADER_SIZE + self.slots * self.slot_size)
        finally:
            os.close(fd)
        self._view = memoryview(self._map)
        self.capacity = self.slot_size - PREFIX.size     # the largest request a slot takes
        self._lock = threading.Lock()
        taken = set()
        if not fresh:                                # a fresh file is all zeros: every slot free
            for slot in range(self.slots):
                index, length, opcode = self._slot_state(slot)
                if 0 < length <= self.capacity and opcode not in _NOT_RUN_AGAIN:
                    self._pending.append((slot, index, self._request(slot, length)))
                    taken.add(slot)
                elif length:
                    self._clear(slot)                # torn, or nothing to run again
        self._free = [slot for slot in reversed(range(self.slots)) if slot not in taken]

    def _read_geometry(self, fd: int) -> bool:
        """Whether the file holds a log this version can read (else it starts afresh)."""
        head = os.pread(fd, FILE_HEADER.size, 0)
        if len(head) < FILE_HEADER.size:
            return False
        magic, slots, slot_size = FILE_HEADER.unpack(head)
        if magic != MAGIC or not 0 < slots <= 4096 or slot_size < 4096 or \
                os.fstat(fd).st_size != HEADER_SIZE + slots * slot_size:
            log.warning("%s is not an in-flight log this cachefs can read: nothing to answer from it", self.path)
            return False
        self.slots, self.slot_size = slots, slot_size
        return True

    def _offset(self, slot: int) -> int:
        return HEADER_SIZE + slot * self.slot_size

    def _slot_state(self, slot: int) -> tuple[int, int, int]:
        offset = self._offset(slot)
        index, = PREFIX.unpack_from(self._map, offset)
        length, opcode = REQUEST_HEAD.unpack_from(self._map, offset + PREFIX.size)
        return index, length, opcode

    def _request(self, slot: int, length: int) -> memoryview:
        start = self._offset(slot) + PREFIX.size
        return self._view[start:start + length]

    def _clear(self, slot: int) -> None:
        REQUEST_HEAD.pack_into(self._map, self._offset(slot) + PREFIX.size, 0, 0)

    def pending(self) -> list[tuple[int, int, memoryview]]:
        """(slot, descriptor index, request) of each request a predecessor read and did not
        answer, in slot order; their slots stay taken until ``done``."""
        pending, self._pending = self._pending, []
        self.replayed += len(pending)
        return pending

    def reserve(self, index: int) -> tuple[int, memoryview] | None:
        """A free slot for the next request read from descriptor ``index``, and the buffer to read
        it into; None (counted) when every slot is taken."""
        with self._lock:
            if not self._free:
                self.unlogged += 1
                if self.unlogged == 1:
                    log.warning("every slot of the in-flight log is taken: a request read now is lost "
                                "if the daemon dies before answering it")
                return None
            slot = self._free.pop()
        offset = self._offset(slot)
        PREFIX.pack_into(self._map, offset, index)
        return slot, self._view[offset + PREFIX.size:offset + self.slot_size]

    def done(self, slot: int) -> None:
        """The slot's request is answered (or needs no answer): free it."""
        self._clear(slot)
        with self._lock:
            self._free.append(slot)

    def status(self) -> dict:
        return {"slots": self.slots, "free": len(self._free), "unlogged": self.unlogged, "replayed": self.replayed}

    def close(self) -> None:
        """Unmap (where no request still refers to its slot; else at exit)."""
        self._pending = []
        with contextlib.suppress(BufferError):
            self._view.release()
            self._map.close()


def _round_up(n: int, unit: int) -> int:
    return (n + unit - 1) // unit * unit
