"""The disk tier's read policy: verified reads of block files, inline or in worker threads.

Reads are inline ``os.pread`` calls in the trio thread when the pages are resident: a thread
hop costs more than a page-cache read (docs/design.md, measured facts). A cold small range is read ahead and then
inline while the disk answers fast; large ranges and a slow disk go to worker threads, so a
slow disk never stalls the trio thread. Hot blocks keep their file open (an LRU of fds).
Every chunk a read touches is verified; a bad block is handed to ``drop`` and read as a miss.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable

import trio

from cachefs.errors import CorruptBlock
from cachefs.metrics import Metrics
from cachefs.sched import in_thread
from cachefs.tiers.disk import format as fmt
from cachefs.tiers.disk.health import DiskHealth
from cachefs.tiers.disk.index import Layout, SegmentedLRU
from cachefs.tiers.metrics import TierMetrics

log = logging.getLogger(__name__)

_TIER = "disk"
_COLD = object()      # a read whose pages are not resident: ``_read_cold`` does it instead
_COMBINED_READ_MAX = 256 << 10     # read at most this much data together with the header
INLINE_MAX = 256 << 10             # cold ranges up to this size may be read on the trio thread
_INLINE_SLOW_S = 0.002             # ... while the moving average of those reads stays below this
_INLINE_WEIGHT = 0.1
_INLINE_BACKOFF_S = 10.0           # then they go to worker threads for this long
_INLINE_YIELDS = 3                 # checkpoints between the read-ahead hint and the read (measured:
                                   # 1-2 let too few other requests start their I/O, 5 no better)


class BlockReader:
    """Reads of indexed block files. ``drop(digest, exc)`` is told of a corrupt block
    (CorruptBlock) or an I/O error (OSError); ``pread`` is a seam for tests."""

    def __init__(self, index: SegmentedLRU, layout: Layout, health: DiskHealth, metrics: Metrics, *,
                 chunk_size: int, drop: Callable[[str, Exception], None]) -> None:
        self._index = index
        self._layout = layout
        self._health = health
        self._chunk_size = chunk_size
        self._drop = drop
        self.handles: OrderedDict[str, fmt.OpenBlock] = OrderedDict()
        self.max_open = 256
        self.pread = os.pread
        self._inline_avg = 0.0                    # moving average of inline cold reads' blocking time
        self.inline_off_until = -math.inf         # cold reads go to threads until then (slow disk)
        self._limiter = trio.CapacityLimiter(16)  # cold reads in flight (like an NVMe queue)
        m = metrics.group(TierMetrics)
        self._hits = m.tier_hits.labels(_TIER)          # bound once: read() is hot
        self._misses = m.tier_misses.labels(_TIER)
        self._hit_bytes = m.tier_hit_bytes.labels(_TIER)

    def _readable(self, digest: str) -> bool:
        return self._health.state != DiskHealth.DOWN and digest in self._index

    # -- the open-file cache --

    def close(self, digest: str) -> None:
        opened = self.handles.pop(digest, None)
        if opened is not None:
            os.close(opened.fd)

    def close_all(self) -> None:
        while self.handles:
            os.close(self.handles.popitem()[1].fd)

    def _remember_open(self, digest: str, fd: int, header: fmt.BlockHeader) -> fmt.OpenBlock:
        opened = self.handles[digest] = fmt.OpenBlock(fd, header)
        if len(self.handles) > self.max_open:
            os.close(self.handles.popitem(last=False)[1].fd)
        self._index.get(digest).length = header.data_len
        return opened

    def _keep_or_close(self, digest: str, fd: int, header: fmt.BlockHeader) -> None:
        if digest in self._index and digest not in self.handles:
            self._remember_open(digest, fd, header)
        else:
            os.close(fd)

    # -- inline reads --

    def read(self, digest: str, offset: int, size: int) -> bytes | None:
        """Bytes [offset, min(offset+size, block length)) of a cached block, verified; None on a miss."""
        data = self._checked_read(digest, offset, size) if self._readable(digest) else None
        return self._counted(digest, data)

    def block_length(self, digest: str) -> int | None:
        """Data length of a cached block (reads its header once after a restart); None if absent."""
        entry = self._index.get(digest)
        if entry is None or self._health.state == DiskHealth.DOWN:
            return None
        if entry.length is None and self._checked_read(digest, 0, 0) is None:
            return None
        return entry.length

    def _counted(self, digest: str, data: bytes | None) -> bytes | None:
        """Count a read's hit or miss (a hit also refreshes the block's place in the LRU)."""
        if data is None:
            self._misses.inc()
            return None
        if digest in self._index:         # it may have been evicted while a thread read it
            self._index.touch(digest)
        self._hits.inc()
        self._hit_bytes.inc(len(data))
        return data

    def _checked_read(self, digest: str, offset: int, size: int) -> bytes | None:
        """``_read_verified``, with a bad block dropped and an I/O error counted: None then."""
        return self._guarded(digest, lambda: self._read_verified(digest, offset, size))

    def _guarded(self, digest: str, read: Callable[[], bytes]) -> bytes | None:
        """``read()``; a corrupt block or an I/O error goes to ``drop``: None then.
        _COLD when its pages are not resident (RWF_NOWAIT)."""
        try:
            return read()
        except BlockingIOError:
            return _COLD
        except (CorruptBlock, OSError) as exc:
            self._drop(digest, exc)
        return None

    def _read_verified(self, digest: str, offset: int, size: int) -> bytes:
        opened = self.handles.get(digest)
        prefix = None
        if opened is None:
            opened, prefix = self._open(digest, self._combined_want(digest, offset, size))
        else:
            self.handles.move_to_end(digest)
        return fmt.read_range(opened.fd, opened.header, offset, size, prefix, self.pread)

    def _combined_want(self, digest: str, offset: int, size: int) -> int:
        """How much data to read together with the header on a first open (0: apart).

        A small range in chunk 0 comes with the header in one pread; a large one is read
        apart, so an aligned read returns pread's bytes without a copy."""
        want = min(fmt.round_up(offset + size, self._chunk_size), self._index.get(digest).size)
        return 0 if offset >= self._chunk_size or want > _COMBINED_READ_MAX else want

    def _open(self, digest: str, want: int) -> tuple[fmt.OpenBlock, bytes]:
        try:
            fd, header, buf = fmt.open_block(self._layout.block_file(digest), want, self.pread)
        except FileNotFoundError:
            raise CorruptBlock("file missing") from None
        return self._remember_open(digest, fd, header), buf

    # -- reads that may wait for the disk --

    async def read_async(self, digest: str, offset: int, size: int) -> bytes | None:
        """Like ``read``, but never lets a slow disk stall the trio thread: a range whose pages
        are resident is read inline (``RWF_NOWAIT``); a cold small range is read ahead and then
        inline while the disk answers fast (``_read_cold``); anything else (large ranges, a
        slow disk) is read and verified in a worker thread, so cold reads proceed in parallel."""
        data = None
        if self._readable(digest):
            opened = self.handles.get(digest)
            data = _COLD
            if opened is not None:
                self.handles.move_to_end(digest)
                data = self._guarded(digest, lambda: fmt.read_resident(opened, offset, size))
            if data is _COLD:
                data = await self._read_cold(digest, offset, size)
        return self._counted(digest, data)

    def _inline_ok(self, size: int) -> bool:
        return (size <= INLINE_MAX and self._health.state == DiskHealth.HEALTHY
                and time.monotonic() >= self.inline_off_until)

    async def _read_cold(self, digest: str, offset: int, size: int) -> bytes | None:
        """Read a range whose pages are not resident, on the trio thread or in a worker thread.

        Inline (small ranges, fast disk): ``POSIX_FADV_WILLNEED`` starts the block file's I/O
        and returns; a few checkpoints let the other requests that are ready start theirs; then
        the blocking read mostly waits for an I/O already under way. On a fast disk this beats
        a worker thread, whose hand-offs (GIL, futexes, wake-ups) cost more CPU than the read.
        A disk whose inline reads average over ``_INLINE_SLOW_S`` is read in threads for
        ``_INLINE_BACKOFF_S``, so a slow disk never serialises the mount behind it."""
        opened = self.handles.get(digest)
        try:
            if opened is not None:
                # a dup shares the open file (and the kernel's readahead state for it) and stays
                # valid if the trio thread closes the cached fd meanwhile
                fd = os.dup(opened.fd)
                return await self._run(fd, fmt.read_dup, (fd, opened.header, offset, size), size)
            fd, header, data = await self._open_and_read(digest, offset, size)
        except FileNotFoundError:
            return None                   # evicted meanwhile: a plain miss
        except (CorruptBlock, OSError) as exc:
            self._drop(digest, exc)
            return None
        self._keep_or_close(digest, fd, header)
        return data

    async def _open_and_read(self, digest: str, offset: int, size: int):
        path, want = self._layout.block_file(digest), self._combined_want(digest, offset, size)
        if self._inline_ok(size):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            return await self._run(fd, fmt.read_opened, (fd, want, offset, size), size)
        return await self._run(None, fmt.open_and_read, (path, want, offset, size), size)

    async def _run(self, fd: int | None, read: Callable, args: tuple, size: int):
        """``read(*args)`` inline (``fd`` given and the policy allows it) or in a worker thread."""
        if fd is not None and self._inline_ok(size):
            return await self._run_inline(fd, read, args)
        return await in_thread(read, *args, limiter=self._limiter)

    async def _run_inline(self, fd: int, read: Callable, args: tuple):
        """``read(*args)`` (which owns ``fd``) on the trio thread after a read-ahead hint and
        ``_INLINE_YIELDS`` checkpoints; its blocking time feeds the moving average that can
        turn this off."""
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            for _ in range(_INLINE_YIELDS):
                await trio.lowlevel.checkpoint()
        except BaseException:
            os.close(fd)
            raise
        start = time.monotonic()
        try:
            return read(*args)
        finally:
            took = time.monotonic() - start
            self._inline_avg += (took - self._inline_avg) * _INLINE_WEIGHT
            if self._inline_avg > _INLINE_SLOW_S:
                self.inline_off_until = start + _INLINE_BACKOFF_S
                self._inline_avg = 0.0
                log.info("cache disk %s: inline reads average over %.0f ms; reading in threads for %.0f s",
                         self._layout.root, _INLINE_SLOW_S * 1e3, _INLINE_BACKOFF_S)

    async def readahead(self, digest: str) -> None:
        """Have the kernel read a cached block's file ahead (a sequential reader will want it):
        open it in a worker thread with POSIX_FADV_WILLNEED and keep the fd."""
        if not self._readable(digest) or digest in self.handles:
            return
        try:
            fd, header, _ = await in_thread(
                fmt.open_block, self._layout.block_file(digest), 0, fmt.pread_willneed, limiter=self._limiter)
        except (OSError, CorruptBlock):
            return                        # the read that follows will find and handle it
        self._keep_or_close(digest, fd, header)
