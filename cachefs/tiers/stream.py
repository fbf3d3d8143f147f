"""A reader's sequential-access state, which drives the tiers' readahead (``Tiers.read``)."""

from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from cachefs.tiers.cache import FileVersion


class Stream:
    """Per-handle sequential-access state that drives readahead. ``drop_behind``: a block this
    reader has read all of leaves the memory tier (the kernel page cache and the disk tier hold
    it); off for a stream that several readers share (a packed shard's)."""

    __slots__ = ("next_offset", "window", "drop_behind", "ahead", "consumed", "read_to_end")

    def __init__(self, *, drop_behind: bool = True) -> None:
        self.next_offset = 0
        self.window = 0
        self.drop_behind = drop_behind
        self.ahead: dict[int, trio.CancelScope] = {}     # block index -> its readahead GET under way
        self.consumed: dict[int, int] = {}               # block index -> bytes of it read (drop_behind)
        self.read_to_end: FileVersion | None = None      # a large file this reader read the end of

    def blocks_ahead(self, stop: int, size: int, block_size: int, max_window: int) -> range:
        """The blocks the next readahead after ``stop`` would fetch, of a file of ``size`` bytes
        (the window doubled, at least a block, at most ``max_window``)."""
        window = min(max(self.window * 2, block_size), max_window)
        return range(stop // block_size, (min(stop + window, size) - 1) // block_size + 1)

    def advance(self, offset: int, end: int, block_size: int, max_window: int) -> int:
        """Record a read of [offset, end); return the readahead window in bytes (0: none)."""
        if offset == self.next_offset and offset > 0:
            self.window = min(max(self.window * 2, block_size), max_window)
        elif offset != self.next_offset:
            self.window = 0
        self.next_offset = end
        return self.window
