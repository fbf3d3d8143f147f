"""Whole-object files: a large object, once all its blocks are cached, written as one exact file.

FUSE passthrough hands the kernel one backing file per open, holding the object's bytes from
offset 0. A small object's one block is such a file already (``disk.format``, exact files); a
large object is cached block by block, and once every block is in the disk tier this module has
them copied into one *whole-object file* (``DiskTier.assemble``: every block read verified, the
chunk digests of the whole in its extended attribute, one rename). From then on:

- an open hands it to the kernel, which reads it at the disk's speed with no READ request;
- it holds the object's bytes for the daemon too: the blocks leave the disk tier (unless a pin
  or a running warm holds them), a reader served by the daemon gets each block from the whole
  file into the memory tier (``read_block``), and a warm finds the object cached (``has``);
- its key is the blocks' key with the index ``key.WHOLE``: a new version is a new file.

It is written in the background (``soon``) when an open could not hand the object over, when a
reader that read its end closes it, and when a warm of it ends.
"""

from __future__ import annotations

import trio

from cachefs.tiers.disk import DiskTier
from cachefs.tiers.key import WHOLE, BlockKey
from cachefs.tiers.memory import MemoryTier

_REMEMBERED = 4096     # objects whose first missing block is remembered


def whole_key(key: BlockKey) -> BlockKey:
    """The key of the whole-object file of ``key``'s object (the same version and block size)."""
    return key.at(WHOLE)


class WholeFiles:
    def __init__(self, disk: DiskTier | None, memory: MemoryTier) -> None:
        self.disk = disk
        self.memory = memory
        self._missing_from: dict[BlockKey, int] = {}     # whole key -> the first block found missing

    def of(self, key: BlockKey) -> BlockKey | None:
        """The key of the whole-object file holding block ``key``'s bytes, when the disk tier has one."""
        if self.disk is None or key.index < 0:
            return None
        whole = whole_key(key)
        return whole if self.disk.contains(whole) else None

    def has(self, key: BlockKey) -> bool:
        """The disk tier has block ``key``'s bytes: its block file, or its object's whole file."""
        return self.disk is not None and (self.disk.contains(key) or self.of(key) is not None)

    async def read_block(self, key: BlockKey, length: int, whole: BlockKey) -> bytes | None:
        """Block ``key`` (``length`` bytes) read verified from the whole file ``whole`` into the
        memory tier, where the reads of it that follow find it (a READ's range alone would read
        and check a whole chunk each time); None if the file failed its check (it is dropped)."""
        data = await self.disk.read_async(whole, key.offset, length)
        if data is None or len(data) != length:
            return None
        self.memory.put(key, data)
        return data

    def soon(self, nursery: trio.Nursery, whole: BlockKey, size: int) -> None:
        """Write the object of ``size`` bytes as the whole file ``whole`` in ``nursery`` if all its
        blocks are in the disk tier or being written there. The first block found missing is
        remembered, so an object cached in part costs one digest a time, not one per block."""
        if self.disk.assembling(whole) or self.disk.contains(whole):
            return
        count = -(-size // whole.block_size)
        for index in range(self._missing_from.pop(whole, 0), count):
            key = whole.at(index)
            if not (self.disk.contains(key) or self.disk.filling(key)):
                if len(self._missing_from) >= _REMEMBERED:
                    self._missing_from.clear()
                self._missing_from[whole] = index
                return
        nursery.start_soon(self._assemble, whole, size, count)

    async def _assemble(self, whole: BlockKey, size: int, count: int) -> None:
        blocks = [whole.at(i) for i in range(count)]
        for key in blocks:
            await self.disk.wait_fill(key)
        await self.disk.assemble(whole, blocks, size)
