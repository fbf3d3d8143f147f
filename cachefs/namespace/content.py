"""Where a file's bytes come from: one source per kind of file (the namespace's content seam).

``Vfs`` keeps names, nodes and handles; for a file's bytes it asks the file's source:

==============  ===========================================================================
StoreContent    an object version through the block cache (``Tiers``): pinned at open
PackedContent   a file inside a packed dataset's shards (``PackedView``), or a raw object of
                its layout; read-only
StagedContent   a file the write-back holds (written here, not yet, or not all, in the store)
==============  ===========================================================================

A mount has one store-side source (``StoreContent``, or ``PackedContent`` for a packed dataset)
and, when writable, a ``StagedContent``; ``Vfs.source`` picks one per handle. Every source
answers the same calls: ``open`` (the version a new handle pins, and whether the kernel may keep
its cached pages; ``file``, the same without the pin, for a handle a previous daemon opened),
``preload_needed`` / ``preload`` (content pushed to the kernel at open),
``read_now`` (no wait, or NeedsWait) and ``read``. A new kind of file is one more class here.
"""

from __future__ import annotations

import errno
import logging
import os

from cachefs.errors import NeedsWait, StoreError
from cachefs.namespace.handles import Handle
from cachefs.namespace.nodes import FsError, Node
from cachefs.packed.view import PackedView
from cachefs.tiers.cache import FileVersion, Tiers
from cachefs.writeback.engine import Writeback

log = logging.getLogger(__name__)

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND


def _pin(node: Node) -> bool:
    """The kernel now caches this node's current version: whether it may keep the pages it has."""
    keep_cache = node.kernel_etag == node.etag
    node.kernel_etag = node.etag
    return keep_cache


class StoreContent:
    """An object in the store, read through the block cache at the version an open pinned."""

    hands_over = True          # the kernel may read its cache file itself (FUSE passthrough)
    writable = True            # a write opens a staged copy (the write-back)

    def __init__(self, blocks: Tiers) -> None:
        self.blocks = blocks

    @staticmethod
    def version(node: Node) -> FileVersion:
        return FileVersion(node.path, node.etag, node.size)

    def looked_up(self, node: Node) -> None:
        """A fresh file was looked up and its open comes next: a small one's GET starts now."""
        if node.kernel_etag != node.etag:
            self.blocks.readahead_file(self.version(node))

    def preload_needed(self, node: Node) -> bool:
        return node.kernel_etag != node.etag and self.blocks.preload_needed(self.version(node))

    def open(self, node: Node, flags: int) -> tuple[FileVersion | None, bool]:
        return self.file(node), _pin(node)

    def file(self, node: Node) -> FileVersion | None:
        """What a handle on ``node`` reads through the block cache (also one a previous daemon
        opened): the version the node shows."""
        return self.version(node)

    async def preload(self, handle: Handle) -> bytes | None:
        return await self.blocks.preload(handle.file, handle.stream) if handle.file is not None else None

    def read_now(self, handle: Handle, offset: int, size: int) -> bytes | memoryview:
        if handle.file is None:
            raise NeedsWait
        return self.blocks.read_now(handle.file, offset, size, handle.stream)

    async def read(self, handle: Handle, offset: int, size: int) -> bytes | memoryview:
        if handle.file is None:      # opened while staged, since uploaded: read that version
            handle.file = self.version(handle.node)
        try:
            return await self.blocks.read(handle.file, offset, size, handle.stream)
        except StoreError:
            handle.node.checked_at = 0.0      # the next open revalidates
            raise


class PackedContent:
    """A file of a packed dataset: a record of a shard (checked against its CRC as it is read),
    or a raw object of the layout (its own file, read through the block cache)."""

    hands_over = False
    writable = False           # read-only: a write is refused (EROFS)

    def __init__(self, packed: PackedView, blocks: Tiers) -> None:
        self.packed = packed
        self.blocks = blocks

    def looked_up(self, node: Node) -> None:
        pass

    def preload_needed(self, node: Node) -> bool:
        return node.kernel_etag != node.etag

    def open(self, node: Node, flags: int) -> tuple[FileVersion | None, bool]:
        if flags & WRITE_FLAGS:
            log.info("%s: refused a write (EROFS): a packed dataset is read-only; repack to change it", node.path)
            raise FsError(errno.EROFS)
        return self.file(node), _pin(node)

    def file(self, node: Node) -> FileVersion | None:
        """Locate ``node`` in the shards anew (each open verifies it); a raw object of the layout
        is its own file, read through the block cache (preload works): its version; a record: None."""
        node.packed = self.packed.ref(node.path, node.size, node.etag, node.row)
        return node.packed.file if node.packed.crc is None else None

    async def preload(self, handle: Handle) -> bytes | None:
        if handle.file is None:
            return await self.packed.preload(handle.node.packed, handle.stream)
        return await self.blocks.preload(handle.file, handle.stream)

    def read_now(self, handle: Handle, offset: int, size: int) -> bytes | memoryview:
        raise NeedsWait

    async def read(self, handle: Handle, offset: int, size: int) -> bytes | memoryview:
        return await self.packed.read(handle.node.packed, handle.stream, offset, size)


class StagedContent:
    """A file the write-back holds: its staged copy, read from the local journal."""

    def __init__(self, wb: Writeback) -> None:
        self.wb = wb

    @staticmethod
    def entry(handle: Handle):
        """The staged file a read of ``handle`` reads (the node's, else the handle's own), if any."""
        return handle.node.staged if handle.node.staged is not None else handle.entry

    def preload_needed(self, node: Node) -> bool:
        return False

    async def preload(self, handle: Handle) -> bytes | None:
        return None

    def read_now(self, handle: Handle, offset: int, size: int) -> bytes | memoryview:
        raise NeedsWait

    async def read(self, handle: Handle, offset: int, size: int) -> bytes:
        return self.wb.read(self.entry(handle), offset, size)
