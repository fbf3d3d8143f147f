"""Open file handles: the version a reader pinned, its readahead stream, the staged file a writer holds.

A handle number names its inode (``make_fh``): the daemon that takes over a live mount serves a
handle the kernel opened with its predecessor by rebuilding it from the inode (``Vfs.handle``).
Bits 0-39 are the inode, 40-47 the daemon's generation (one per takeover, so a new handle never
equals one its predecessor gave out), 48-62 a sequence number. Bit 63 is never set: it marks the
handles request-loop processes give out (``fuse/looptable.py``, ``LOOP_FH``), whose releases and
ioctls are answered without a handle here.
"""

from cachefs.namespace.nodes import Node
from cachefs.tiers.cache import FileVersion, Stream
from cachefs.writeback.staged import StagedFile

INODE_BITS = 40
_INODE_MASK = (1 << INODE_BITS) - 1


def make_fh(inode: int, generation: int, seq: int) -> int:
    return (seq & 0x7FFF) << 48 | (generation & 0xFF) << INODE_BITS | (inode & _INODE_MASK)


def fh_inode(fh: int) -> int:
    return fh & _INODE_MASK


class Handle:
    __slots__ = ("fh", "node", "file", "stream", "entry", "writable")

    def __init__(self, fh: int, node: Node, file: FileVersion | None, entry: StagedFile | None = None,
                 writable: bool = False) -> None:
        self.fh = fh
        self.node = node
        self.file = file
        self.stream = Stream()
        self.entry = entry          # the staged file this handle opened (kept open while it lives)
        self.writable = writable
