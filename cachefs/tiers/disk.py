"""The disk tier: checksummed block files on the local NVMe, bounded in size.

Layout under ``root``::

    blocks/<digest[:2]>/<digest>     one file per block, in the format of ``BlockHeader``
    tmp/<digest>.<random>.tmp        fills being written; whatever is left here at start is removed

Concurrency and crash protocol (DESIGN invariants 2, 3, 4, 6)
-------------------------------------------------------------
* The trio thread owns all state here: the index (a segmented LRU), the reservation counter,
  the in-flight and unlinking maps, the open-file cache and the health state. Worker threads
  (``trio.to_thread.run_sync`` under one ``CapacityLimiter``) run only the module-level
  ``_``-functions at the bottom, which take paths and bytes and touch no shared structure.
* Reads are inline ``os.pread`` calls in the trio thread: a thread hop costs more than a
  page-cache read (DESIGN §3). Every chunk a read touches is verified before it is returned.
* A fill: ``start_fill`` registers the job in ``_inflight`` (so a second fill of the block is a
  no-op) and queues it. A fill worker waits for any pending unlink of the same digest, then
  reserves the file's size: it evicts index entries (probation LRU first) until index bytes +
  reserved bytes + size <= capacity and the filesystem keeps ``free_space_ratio`` free. Evicted
  entries leave the index at once (reads miss) and the same worker thread unlinks their files
  *before* it writes, so the bytes on disk never exceed capacity. The thread writes ``tmp/``,
  fsyncs and renames into ``blocks/`` (no directory fsync: a lost rename is a miss); only after the rename does the trio
  thread add the entry to the index and release the reservation.
* Every unlink (eviction, discard, corrupt block) is registered in ``_unlinking`` until it is
  done; a fill of the same digest waits for it, so an old unlink never removes a new file.
  Until then its bytes stay counted in ``_reserved`` (a fill holds max(its size, the bytes it
  evicted)), so ``used_bytes`` is an upper bound of what is on disk, at every instant.
* Eviction is a segmented LRU (``_SegmentedLRU``): the first read hit after a fill promotes a
  block to the protected segment (<= 80% of capacity); victims come from probation first.
  Repeated reads of one block within a pass are absorbed by the memory tier in front, so a
  one-pass scan never hits the disk tier twice and stays in probation.
* Health (``DiskHealth``): I/O errors move healthy -> unstable (no new fills) -> down (reads
  and fills bypass the tier); after a quiet cool-down a probe write in a worker thread brings
  it back. ENOSPC is a full disk, not a sick one: it drops the fill (no_space) only.
* Crash states and their one repair: a temp file (crash before the rename) is deleted by
  ``run``; a renamed but unindexed block (crash after the rename) is indexed by the rebuild in
  ``run``; a torn or rotten block fails its checksums on read and is unlinked and refetched;
  an evicted block whose unlink never ran is indexed again by the next rebuild (and evicted
  again if the cache is over capacity).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import secrets
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import trio
import xxhash

from cachefs.errors import CacheDirError, CorruptBlock
from cachefs.metrics import Metrics
from cachefs.tiers.key import BlockKey
from cachefs.tiers.pins import PinSet
from cachefs.tiers.slru import Entry as _Entry
from cachefs.tiers.slru import SegmentedLRU as _SegmentedLRU

log = logging.getLogger(__name__)

_TIER = "disk"
_HEADER_ALIGN = 4096
_MAX_CHUNKS = 1 << 20
_COLD = object()      # a read whose pages are not resident: ``_read_cold`` does it instead
_COMBINED_READ_MAX = 256 << 10     # read at most this much data together with the header
_INLINE_MAX = 256 << 10            # cold ranges up to this size may be read on the trio thread
_INLINE_SLOW_S = 0.002             # ... while the moving average of those reads stays below this
_INLINE_WEIGHT = 0.1
_INLINE_BACKOFF_S = 10.0           # then they go to worker threads for this long
_INLINE_YIELDS = 3                 # checkpoints between the read-ahead hint and the read (measured:
                                   # 1-2 let too few other requests start their I/O, 5 no better)
_DIGEST_NAME = re.compile(r"[0-9a-f]{40}")
_xxh = xxhash.xxh3_64_intdigest


# --- the block file format ----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The header of a block file (format version 1); all integers little-endian.

    ========  ======  =========================================================
    offset    size    field
    ========  ======  =========================================================
    0         4       magic ``b"CFSB"``
    4         2       format version (1)
    6         2       reserved, 0
    8         8       data length in bytes
    16        4       chunk size (every chunk but the last is this long)
    20        4       number of chunks n = ceil(data length / chunk size)
    24        8*n     xxh3_64 of each chunk of data
    24+8n     8       xxh3_64 of header bytes [0, 24+8n)
    32+8n     pad     zeros up to ``length``, the next multiple of 4 KiB
    length    data    the block's bytes
    ========  ======  =========================================================

    A file is valid only if its size is exactly ``length + data_len``.
    """

    data_len: int
    chunk_size: int
    digests: tuple[int, ...]
    length: int

    MAGIC = b"CFSB"
    VERSION = 1
    _FIXED = struct.Struct("<4sHHQII")

    @classmethod
    def length_for(cls, data_len: int, chunk_size: int) -> int:
        chunks = -(-data_len // chunk_size)
        return _round_up(cls._FIXED.size + 8 * chunks + 8, _HEADER_ALIGN)

    @classmethod
    def file_size(cls, data_len: int, chunk_size: int) -> int:
        return cls.length_for(data_len, chunk_size) + data_len

    @classmethod
    def encode(cls, data: bytes, chunk_size: int) -> bytes:
        view = memoryview(data)
        digests = [_xxh(view[i:i + chunk_size]) for i in range(0, len(data), chunk_size)]
        body = cls._FIXED.pack(cls.MAGIC, cls.VERSION, 0, len(data), chunk_size, len(digests))
        body += struct.pack(f"<{len(digests)}Q", *digests)
        body += struct.pack("<Q", _xxh(body))
        return body.ljust(cls.length_for(len(data), chunk_size), b"\0")

    @classmethod
    def peek_length(cls, buf: bytes) -> int:
        """The header length announced by the fixed fields at the start of ``buf``."""
        if len(buf) < cls._FIXED.size:
            raise CorruptBlock(f"truncated header ({len(buf)} bytes)")
        magic, version, _, data_len, chunk_size, chunks = cls._FIXED.unpack_from(buf)
        if magic != cls.MAGIC or version != cls.VERSION:
            raise CorruptBlock(f"bad magic or version {magic!r} {version}")
        if chunk_size == 0 or chunks > _MAX_CHUNKS or chunks != -(-data_len // chunk_size):
            raise CorruptBlock(f"inconsistent header: {data_len} bytes, {chunks} x {chunk_size}")
        return cls.length_for(data_len, chunk_size)

    @classmethod
    def parse(cls, buf: bytes) -> BlockHeader:
        """Parse and verify the header at the start of ``buf`` (which may hold more bytes)."""
        length = cls.peek_length(buf)
        _, _, _, data_len, chunk_size, chunks = cls._FIXED.unpack_from(buf)
        end = cls._FIXED.size + 8 * chunks
        if len(buf) < end + 8:
            raise CorruptBlock(f"truncated header ({len(buf)} bytes)")
        (stored,) = struct.unpack_from("<Q", buf, end)
        if _xxh(memoryview(buf)[:end]) != stored:
            raise CorruptBlock("header checksum mismatch")
        digests = struct.unpack_from(f"<{chunks}Q", buf, cls._FIXED.size)
        return cls(data_len, chunk_size, digests, length)

    def verify(self, first_chunk: int, data: memoryview) -> None:
        """Check ``data``, which holds whole chunks starting at ``first_chunk``."""
        size = self.chunk_size
        for i in range(0, len(data), size):
            index = first_chunk + i // size
            if _xxh(data[i:i + size]) != self.digests[index]:
                raise CorruptBlock(f"chunk {index} checksum mismatch")


# --- health -------------------------------------------------------------------------------

class DiskHealth:
    """healthy -> unstable (no new fills) -> down (reads and fills bypass the tier).

    ``unstable_errors`` I/O errors within ``window`` seconds make the disk unstable,
    ``down_errors`` make it down. Errors never improve the state; once ``cooldown`` seconds
    passed since the last error, the owner probes the disk and calls ``recovered``.
    """

    HEALTHY, UNSTABLE, DOWN = 0, 1, 2
    NAMES = ("healthy", "unstable", "down")

    def __init__(self, *, unstable_errors: int = 3, down_errors: int = 10, window: float = 10.0,
                 cooldown: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.unstable_errors = unstable_errors
        self.down_errors = down_errors
        self.window = window
        self.cooldown = cooldown
        self.state = self.HEALTHY
        self._clock = clock
        self._errors: deque[float] = deque()

    @property
    def name(self) -> str:
        return self.NAMES[self.state]

    def record_error(self) -> bool:
        """Count one I/O error; True when the state changed."""
        now = self._clock()
        self._errors.append(now)
        while self._errors[0] < now - self.window:
            self._errors.popleft()
        count = len(self._errors)
        worse = self.DOWN if count >= self.down_errors else (
            self.UNSTABLE if count >= self.unstable_errors else self.HEALTHY)
        old, self.state = self.state, max(self.state, worse)
        return self.state != old

    def probe_due(self) -> bool:
        return self.state != self.HEALTHY and self._clock() - self._errors[-1] >= self.cooldown

    def recovered(self) -> None:
        self.state = self.HEALTHY
        self._errors.clear()


# --- the tier -----------------------------------------------------------------------------

class _Open(NamedTuple):
    fd: int
    header: BlockHeader


@dataclass(eq=False)
class _FillJob:
    digest: str
    data: bytes
    done: trio.Event = field(default_factory=trio.Event)
    ok: bool = False
    cancelled: bool = False
    low: bool = False         # a warmup fill: its own writer threads, outside the fill queue's budget


@dataclass(slots=True)
class _Room:
    """Space reserved for one fill: its file size and the files evicted to make room."""
    size: int
    doomed: list[str] = field(default_factory=list)
    freed: int = 0

    @property
    def hold(self) -> int:          # capacity held while the thread runs
        return max(self.size, self.freed)

    @property
    def grow(self) -> int:          # most the filesystem can lose to this fill
        return max(0, self.size - self.freed)


class DiskTier:
    """Block files under ``root``, at most ``capacity`` bytes (headers included)."""

    def __init__(self, root: Path, *, capacity: int, free_space_ratio: float, metrics: Metrics,
                 fsync: bool = True, fill_workers: int = 4, max_pending_fill_bytes: int = 256 << 20,
                 chunk_size: int = 128 << 10, health: DiskHealth | None = None,
                 warm_workers: int = 8) -> None:
        self.root = Path(root)
        self.capacity = capacity
        self._free_ratio = free_space_ratio
        self._metrics = metrics
        self._fsync = fsync
        self._fill_workers = fill_workers
        self._max_pending = max_pending_fill_bytes
        self._chunk_size = chunk_size
        self._health = health or DiskHealth()
        self._blocks_dir = self.root / "blocks"
        self._blocks_str = str(self._blocks_dir)
        self._inline_avg = 0.0                    # moving average of inline cold reads' blocking time
        self._inline_off_until = -math.inf        # cold reads go to threads until then (slow disk)
        self._tmp_dir = self.root / "tmp"
        self._index = _SegmentedLRU(int(capacity * 0.8))
        self._reserved = 0                        # bytes being written or waiting to be unlinked
        self._growing = 0                         # bytes running fills will add to the filesystem
        self._pending_bytes = 0                   # data held by queued or running fills
        self._inflight: dict[str, _FillJob] = {}
        self._unlinking: dict[str, trio.Event] = {}
        self._handles: OrderedDict[str, _Open] = OrderedDict()
        self._max_open = 256
        self._limiter = trio.CapacityLimiter(fill_workers)
        self._warm_limiter = trio.CapacityLimiter(max(warm_workers, fill_workers))   # warmup writers
        self.pins = PinSet(self.root / "pins")
        self._read_limiter = trio.CapacityLimiter(16)      # cold reads in flight (like an NVMe queue)
        self._fill_send, self._fill_recv = trio.open_memory_channel[_FillJob](math.inf)
        self._nursery: trio.Nursery | None = None
        self._fs_free = 0                         # statvfs snapshot (bytes available, total)
        self._fs_total = 0
        self._fs_checked = -math.inf
        self._fs_delta = 0                        # our writes/evictions since the snapshot
        self._fs_ttl = 1.0
        # seams for tests: blocking calls that can fail
        self._pread = os.pread
        self._statvfs = os.statvfs
        self._write_file = _write_block_file
        self._probe = _probe_dir
        self._hits = metrics.tier_hits.labels(_TIER)          # bound once: read() is hot
        self._misses = metrics.tier_misses.labels(_TIER)
        self._hit_bytes = metrics.tier_hit_bytes.labels(_TIER)
        metrics.tier_capacity_bytes.labels(_TIER).set(capacity)
        metrics.disk_health.set(self._health.state)
        self._update_gauges()

    # -- lifecycle --

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            removed, found = await trio.to_thread.run_sync(_prepare_root, self.root, self._fsync)
        except OSError as exc:
            raise CacheDirError(f"cannot use cache dir {self.root}: {exc.strerror or exc}") from exc
        if removed:
            log.info("removed %d stale temp files from %s", removed, self._tmp_dir)
        pins = await trio.to_thread.run_sync(self.pins.load)
        for digests in pins.values():
            for digest in digests:
                self._index.hold(digest)
        for _, digest, size in found:
            self._index.add(digest, _Entry(size, None))
        log.info("disk tier %s: %d blocks, %d bytes", self.root, len(self._index), self._index.bytes)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._shrink_to_capacity()
                while self._unlinking:             # start within capacity
                    await trio.sleep(0.005)
                for _ in range(self._fill_workers):
                    nursery.start_soon(self._fill_worker, self._fill_recv.clone())
                nursery.start_soon(self._watch_health)
                task_status.started()
        finally:
            self._nursery = None
            while self._handles:
                os.close(self._handles.popitem()[1].fd)

    async def wait_idle(self) -> None:
        """Return once no fill is queued or running and no unlink is pending."""
        while self._inflight or self._unlinking:
            await trio.sleep(0.005)

    # -- reads --

    def read(self, key: BlockKey, offset: int, size: int) -> bytes | None:
        """Bytes [offset, min(offset+size, block length)) of a cached block, verified; None on a miss."""
        digest = key.digest()
        data = None
        if self._health.state != DiskHealth.DOWN and digest in self._index:
            data = self._checked_read(digest, offset, size)
        return self._counted(digest, data)

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

    def block_length(self, key: BlockKey) -> int | None:
        """Data length of a cached block (reads its header once after a restart); None if absent."""
        digest = key.digest()
        entry = self._index.get(digest)
        if entry is None or self._health.state == DiskHealth.DOWN:
            return None
        if entry.length is None and self._checked_read(digest, 0, 0) is None:
            return None
        return entry.length

    def filling(self, key: BlockKey) -> bool:
        """A fill of this block is queued or being written."""
        return key.digest() in self._inflight

    def contains(self, key: BlockKey) -> bool:
        return self._health.state != DiskHealth.DOWN and key.digest() in self._index

    def _checked_read(self, digest: str, offset: int, size: int) -> bytes | None:
        """``_read_verified``, with a bad block dropped and an I/O error counted: None then."""
        return self._guarded(digest, lambda: self._read_verified(digest, offset, size))

    def _guarded(self, digest: str, read: Callable[[], bytes]) -> bytes | None:
        """``read()``; a corrupt block is dropped and counted, an I/O error counted (health) and
        the block dropped: None then. _COLD when its pages are not resident (RWF_NOWAIT)."""
        try:
            return read()
        except BlockingIOError:
            return _COLD
        except CorruptBlock as exc:
            self._drop_corrupt(digest, str(exc))
        except OSError as exc:
            self._io_error("read", exc)
            self._drop(digest)
        return None

    def _read_verified(self, digest: str, offset: int, size: int) -> bytes:
        opened = self._handles.get(digest)
        prefix = None
        if opened is None:
            opened, prefix = self._open(digest, self._combined_want(digest, offset, size))
        else:
            self._handles.move_to_end(digest)
        return _read_range(opened.fd, opened.header, offset, size, prefix, self._pread)

    def _combined_want(self, digest: str, offset: int, size: int) -> int:
        """How much data to read together with the header on a first open (0: apart).

        A small range in chunk 0 comes with the header in one pread; a large one is read
        apart, so an aligned read returns pread's bytes without a copy."""
        want = min(_round_up(offset + size, self._chunk_size), self._index.get(digest).size)
        return 0 if offset >= self._chunk_size or want > _COMBINED_READ_MAX else want

    def _open(self, digest: str, want: int) -> tuple[_Open, bytes]:
        try:
            fd, header, buf = _open_block(self._block_file(digest), want, self._pread)
        except FileNotFoundError:
            raise CorruptBlock("file missing") from None
        return self._remember_open(digest, fd, header), buf

    def _remember_open(self, digest: str, fd: int, header: BlockHeader) -> _Open:
        opened = self._handles[digest] = _Open(fd, header)
        if len(self._handles) > self._max_open:
            os.close(self._handles.popitem(last=False)[1].fd)
        self._index.get(digest).length = header.data_len
        return opened

    # -- reads that may wait for the disk --

    async def read_async(self, key: BlockKey, offset: int, size: int) -> bytes | None:
        """Like ``read``, but never lets a slow disk stall the trio thread: a range whose pages
        are resident is read inline (``RWF_NOWAIT``); a cold small range is read ahead and then
        inline while the disk answers fast (``_read_cold``); anything else (large ranges, a
        slow disk) is read and verified in a worker thread, so cold reads proceed in parallel."""
        digest = key.digest()
        data = None
        if self._health.state != DiskHealth.DOWN and digest in self._index:
            opened = self._handles.get(digest)
            data = _COLD
            if opened is not None:
                self._handles.move_to_end(digest)
                data = self._guarded(digest, lambda: _read_resident(opened, offset, size))
            if data is _COLD:
                data = await self._read_cold(digest, offset, size)
        return self._counted(digest, data)

    def _inline_ok(self, size: int) -> bool:
        return (size <= _INLINE_MAX and self._health.state == DiskHealth.HEALTHY
                and time.monotonic() >= self._inline_off_until)

    async def _read_cold(self, digest: str, offset: int, size: int) -> bytes | None:
        """Read a range whose pages are not resident, on the trio thread or in a worker thread.

        Inline (small ranges, fast disk): ``POSIX_FADV_WILLNEED`` starts the block file's I/O
        and returns; a few checkpoints let the other requests that are ready start theirs; then
        the blocking read mostly waits for an I/O already under way. On a fast disk this beats
        a worker thread, whose hand-offs (GIL, futexes, wake-ups) cost more CPU than the read.
        A disk whose inline reads average over ``_INLINE_SLOW_S`` is read in threads for
        ``_INLINE_BACKOFF_S``, so a slow disk never serialises the mount behind it."""
        opened = self._handles.get(digest)
        inline = self._inline_ok(size)
        try:
            if opened is not None:
                # a dup shares the open file (and the kernel's readahead state for it) and stays
                # valid if the trio thread closes the cached fd meanwhile
                fd = os.dup(opened.fd)
                read, args = _read_dup, (fd, opened.header, offset, size)
            else:
                path, want = self._block_file(digest), self._combined_want(digest, offset, size)
                if inline:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    read, args = _read_opened, (fd, want, offset, size)
                else:
                    read, args = _open_and_read, (path, want, offset, size)
            if inline:
                result = await self._run_inline(fd, read, args)
            else:
                result = await trio.to_thread.run_sync(read, *args, limiter=self._read_limiter)
        except FileNotFoundError:
            return None                   # evicted meanwhile: a plain miss
        except CorruptBlock as exc:
            if digest in self._index:
                self._drop_corrupt(digest, str(exc))
            return None
        except OSError as exc:
            self._io_error("read", exc)
            if digest in self._index:
                self._drop(digest)
            return None
        if read is _read_dup:
            return result
        fd, header, data = result
        if digest in self._index and digest not in self._handles:
            self._remember_open(digest, fd, header)
        else:
            os.close(fd)
        return data

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
                self._inline_off_until = start + _INLINE_BACKOFF_S
                self._inline_avg = 0.0
                log.info("cache disk %s: inline reads average over %.0f ms; reading in threads for %.0f s",
                         self.root, _INLINE_SLOW_S * 1e3, _INLINE_BACKOFF_S)

    async def prefetch(self, key: BlockKey) -> None:
        """Have the kernel read a cached block's file ahead (a sequential reader will want it):
        open it in a worker thread with POSIX_FADV_WILLNEED and keep the fd."""
        digest = key.digest()
        if digest not in self._index or digest in self._handles or self._health.state == DiskHealth.DOWN:
            return
        try:
            fd, header, _ = await trio.to_thread.run_sync(
                _open_block, self._block_file(digest), 0, _pread_willneed, limiter=self._read_limiter)
        except (OSError, CorruptBlock):
            return                        # the read that follows will find and handle it
        if digest in self._index and digest not in self._handles:
            self._remember_open(digest, fd, header)
        else:
            os.close(fd)

    # -- fills --

    def start_fill(self, key: BlockKey, data: bytes) -> bool:
        """Queue ``data`` to be written; False (counted) when the fill is dropped instead."""
        digest = key.digest()
        if self._already_there(digest):
            return True
        reason = self._refusal(len(data))
        if reason is None and self._pending_bytes + len(data) > self._max_pending:
            reason = "queue_full"
        if reason is not None:
            self._metrics.dropped_fills.labels(_TIER, reason).inc()
            return False
        self._fill_send.send_nowait(self._register(digest, data))
        return True

    async def fill(self, key: BlockKey, data: bytes) -> bool:
        """Write ``data`` now and wait; True when the block is cached."""
        return await self._fill_now(key, data, low=False)

    async def _fill_now(self, key: BlockKey, data: bytes, *, low: bool) -> bool:
        digest = key.digest()
        if self._already_there(digest):
            job = self._inflight.get(digest)
            if job is not None:
                await job.done.wait()
                return job.ok
            return True
        reason = self._refusal(len(data))
        if reason is not None:
            self._metrics.dropped_fills.labels(_TIER, reason).inc()
            return False
        job = self._register(digest, data, low=low)
        await self._store(job)
        return job.ok

    def discard(self, key: BlockKey) -> None:
        digest = key.digest()
        job = self._inflight.get(digest)
        if job is not None:
            job.cancelled = True
        self._drop(digest)

    def _already_there(self, digest: str) -> bool:
        job = self._inflight.get(digest)
        if job is not None:
            job.cancelled = False      # same key, same bytes: a discarded fill is wanted again
            return True
        return digest in self._index

    def _refusal(self, data_len: int) -> str | None:
        if self._health.state != DiskHealth.HEALTHY:
            return "unhealthy"
        if BlockHeader.file_size(data_len, self._chunk_size) > self.capacity:
            return "no_space"
        return None

    def _register(self, digest: str, data: bytes, low: bool = False) -> _FillJob:
        job = self._inflight[digest] = _FillJob(digest, bytes(data), low=low)
        if not low:
            self._pending_bytes += len(job.data)
        return job

    async def _fill_worker(self, recv: trio.MemoryReceiveChannel[_FillJob]) -> None:
        async with recv:
            async for job in recv:
                await self._store(job)

    async def _store(self, job: _FillJob) -> None:
        try:
            job.ok = await self._write(job)
        finally:
            del self._inflight[job.digest]
            if not job.low:
                self._pending_bytes -= len(job.data)
            job.done.set()

    async def _write(self, job: _FillJob) -> bool:
        unlinking = self._unlinking.get(job.digest)
        if unlinking is not None:
            await unlinking.wait()
        if job.cancelled:
            return False
        room = self._room_for(len(job.data))
        if room is None:
            return False
        gone = trio.Event()
        for digest in room.doomed:
            self._unlinking[digest] = gone
        tmp = self._tmp_dir / f"{job.digest}.{secrets.token_hex(4)}.tmp"
        written = False
        try:
            errors = await trio.to_thread.run_sync(
                self._write_file, [self._block_path(d) for d in room.doomed], tmp,
                self._block_path(job.digest), job.data, self._chunk_size, self._fsync,
                limiter=self._warm_limiter if job.low else self._limiter)
            written = True
        except OSError as exc:
            self._write_failed(exc)
            return False
        finally:
            self._release(room, written)
            gone.set()
        for exc in errors:
            self._io_error("unlink", exc)
        if job.cancelled:
            self._schedule_unlink(job.digest, room.size)
            return False
        self._index.add(job.digest, _Entry(room.size, len(job.data)))
        self._update_gauges()
        return True

    def _room_for(self, data_len: int) -> _Room | None:
        """Reserve room for a block file, or count why the fill is dropped and return None."""
        reason = "unhealthy"
        if self._health.state == DiskHealth.HEALTHY:
            try:
                room = self._reserve(BlockHeader.file_size(data_len, self._chunk_size))
            except OSError as exc:
                self._io_error("statvfs", exc)
                room, reason = None, "error"
            else:
                reason = "no_space"
            if room is not None:
                return room
        self._metrics.dropped_fills.labels(_TIER, reason).inc()
        return None

    def _release(self, room: _Room, written: bool) -> None:
        """Return a reservation once its thread is done (evicted files unlinked by then)."""
        self._reserved -= room.hold
        self._growing -= room.grow
        self._fs_delta += room.grow + room.freed - (room.size if written else 0)
        for digest in room.doomed:
            del self._unlinking[digest]
        self._update_gauges()

    def _write_failed(self, exc: OSError) -> None:
        if exc.errno == errno.ENOSPC:
            self._metrics.disk_errors.labels("write").inc()
            self._metrics.dropped_fills.labels(_TIER, "no_space").inc()
            self._fs_checked = -math.inf
            log.info("cache disk %s is full: %s", self.root, exc)
            return
        self._io_error("write", exc)
        self._metrics.dropped_fills.labels(_TIER, "error").inc()

    # -- space --

    def _reserve(self, size: int) -> _Room | None:
        """Make room for a file of ``size`` bytes by evicting; None if room cannot be made.

        The evicted files stay on disk until the fill's thread unlinks them (just before it
        writes), so the fill holds ``max(size, freed)`` bytes of the capacity until it is done:
        the bytes on disk never exceed the index bytes plus ``_reserved``, which never exceed
        ``capacity``. For the free-space estimate the fill takes ``grow`` bytes at most.
        """
        free, want = self._fs_room()
        evictable = self._index.bytes - self._index.held_bytes
        if (self._index.held_bytes + self._reserved + size > self.capacity
                or free + evictable - size < want):
            return None
        room = _Room(size)
        while (self._index.bytes + self._reserved + size > self.capacity
               or free + room.freed - size < want):
            digest = self._index.victim()
            room.freed += self._evict(digest)
            room.doomed.append(digest)
        self._reserved += room.hold
        self._growing += room.grow
        self._fs_delta -= room.grow
        return room

    def _fs_room(self) -> tuple[int, float]:
        """(bytes free now, by our estimate; bytes that must stay free)."""
        now = time.monotonic()
        if now - self._fs_checked >= self._fs_ttl:
            st = self._statvfs(self.root)
            self._fs_free, self._fs_total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
            self._fs_checked = now
            self._fs_delta = -self._growing
        return self._fs_free + self._fs_delta, self._free_ratio * self._fs_total

    def _evict(self, digest: str) -> int:
        entry = self._forget(digest)
        self._metrics.evictions.labels(_TIER).inc()
        self._metrics.evicted_bytes.labels(_TIER).inc(entry.size)
        return entry.size

    def _shrink_to_capacity(self) -> None:
        while self._index.bytes > self.capacity:
            digest = self._index.victim()
            if digest is None:             # the rest is pinned: over capacity until unpinned
                break
            self._schedule_unlink(digest, self._evict(digest))
        self._update_gauges()

    # -- dropping blocks --

    def _forget(self, digest: str) -> _Entry | None:
        opened = self._handles.pop(digest, None)
        if opened is not None:
            os.close(opened.fd)
        return self._index.remove(digest)

    def _drop(self, digest: str) -> None:
        entry = self._forget(digest)
        if entry is not None:
            self._schedule_unlink(digest, entry.size)
            self._update_gauges()

    def _drop_corrupt(self, digest: str, reason: str) -> None:
        log.info("dropping corrupt disk block %s: %s", digest, reason)
        self._metrics.corrupt_blocks.inc()
        self._drop(digest)

    def _schedule_unlink(self, digest: str, size: int) -> None:
        """Unlink a block file that left the index; its bytes stay reserved until it is gone."""
        path = self._block_path(digest)
        if self._nursery is None:          # not running: nothing can race with us
            with suppress(OSError):
                path.unlink()
            return
        done = self._unlinking[digest] = trio.Event()
        self._reserved += size
        self._nursery.start_soon(self._unlink, digest, path, size, done)

    async def _unlink(self, digest: str, path: Path, size: int, done: trio.Event) -> None:
        try:
            errors = await trio.to_thread.run_sync(_unlink_paths, [path], limiter=self._limiter)
        finally:
            del self._unlinking[digest]
            self._reserved -= size
            self._fs_delta += size
            self._update_gauges()
            done.set()
        for exc in errors:
            self._io_error("unlink", exc)

    # -- health --

    def _io_error(self, op: str, exc: OSError) -> None:
        self._metrics.disk_errors.labels(op).inc()
        log.info("cache disk %s: %s failed: %s", self.root, op, exc)
        if self._health.record_error():
            self._metrics.disk_health.set(self._health.state)
            log.warning("cache disk %s is now %s after repeated I/O errors (last: %s)",
                        self.root, self._health.name, exc)

    async def _watch_health(self) -> None:
        while True:
            await trio.sleep(min(1.0, self._health.cooldown / 2))
            if not self._health.probe_due():
                continue
            try:
                await trio.to_thread.run_sync(self._probe, self._tmp_dir, self._fsync,
                                              limiter=self._limiter)
            except OSError as exc:
                self._io_error("probe", exc)
                continue
            self._health.recovered()
            self._metrics.disk_health.set(self._health.state)
            log.info("cache disk %s is healthy again", self.root)

    # -- warmup: low-priority fills, holds and pins (cachefs/prefetcher.py) --

    async def warm(self, key: BlockKey, data: bytes) -> bool:
        """Write a warmup's block and wait (back-pressure instead of a drop); True when cached.

        Uses its own writer threads, and stays out of the foreground fill queue's byte budget,
        so a warmup never makes a reader's fill be dropped as queue_full."""
        return await self._fill_now(key, data, low=True)

    def hold(self, digests: Iterable[str]) -> None:
        """Keep these blocks from eviction (a running warmup's own blocks) until ``release``."""
        for digest in digests:
            self._index.hold(digest)

    def release(self, digests: Iterable[str]) -> None:
        for digest in digests:
            self._index.release(digest)

    def pin(self, name: str, digests: set[str]) -> None:
        """Hold ``digests`` under ``name`` until ``unpin(name)``, across restarts."""
        self.unpin(name)
        self.pins.add(name, digests)
        self.hold(digests)

    def unpin(self, name: str) -> bool:
        if name not in self.pins.pins:
            return False
        self.release(self.pins.remove(name))
        return True

    def file_size(self, data_len: int) -> int:
        """Bytes a block of ``data_len`` bytes takes in the tier (header included)."""
        return BlockHeader.file_size(data_len, self._chunk_size)

    def contains_digest(self, digest: str) -> bool:
        return self._health.state != DiskHealth.DOWN and digest in self._index

    def room(self) -> dict:
        """What a warmup may fill: capacity minus held (pinned or warming) bytes, and the free
        bytes of the cache filesystem above the ``free_space_ratio`` watermark."""
        free, want = self._fs_room()
        held = self._index.held_bytes
        return {"capacity": self.capacity, "used": self._index.bytes + self._reserved, "held": held,
                "room": max(0, min(self.capacity - held - self._reserved,
                                   int(free - want) + self._index.bytes - held))}

    # -- small helpers --

    def _block_path(self, digest: str) -> Path:
        return self._blocks_dir / digest[:2] / digest

    def _block_file(self, digest: str) -> str:
        """``_block_path`` as a string, cheaply (the read path builds one per cold open)."""
        return f"{self._blocks_str}/{digest[:2]}/{digest}"

    def _update_gauges(self) -> None:
        self._metrics.tier_used_bytes.labels(_TIER).set(self._index.bytes + self._reserved)
        self._metrics.tier_blocks.labels(_TIER).set(len(self._index))

    def stats(self) -> dict:
        return {
            "used_bytes": self._index.bytes + self._reserved,
            "capacity": self.capacity,
            "blocks": len(self._index),
            "protected_bytes": self._index.protected_bytes,
            "held_bytes": self._index.held_bytes,
            "pending_fill_bytes": self._pending_bytes,
            "health": self._health.name,
        }


_scratch = bytearray(0)     # reused by _pread_nowait: only the trio thread calls it


def _pread_nowait(fd: int, size: int, offset: int) -> bytes:
    """pread that raises BlockingIOError unless every byte is in the page cache.

    Reads into a reused buffer (a fresh bytearray costs a zero-fill and page faults per call)
    and returns one copy."""
    global _scratch
    if len(_scratch) < size:
        _scratch = bytearray(size)
    view = memoryview(_scratch)[:size]
    if os.preadv(fd, [view], offset, os.RWF_NOWAIT) != size:
        raise BlockingIOError(errno.EAGAIN, "partly resident")   # or truncated: the thread decides
    return bytes(view)


def _open_block(path: str, want: int, pread: Callable[[int, int, int], bytes]
                ) -> tuple[int, BlockHeader, bytes]:
    """Open a block file and parse its header (reading ``want`` data bytes along with it)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)     # FileNotFoundError: the caller decides
    try:
        header, buf = _parse_block(fd, want, pread)
    except BaseException:
        os.close(fd)
        raise
    return fd, header, buf


def _parse_block(fd: int, want: int, pread: Callable[[int, int, int], bytes]) -> tuple[BlockHeader, bytes]:
    """The header of an open block file (and ``want`` data bytes read along with it)."""
    file_size = os.fstat(fd).st_size
    buf = pread(fd, _HEADER_ALIGN + want, 0)
    length = BlockHeader.peek_length(buf)
    if length > _HEADER_ALIGN:
        buf = pread(fd, length + want, 0)
    header = BlockHeader.parse(buf)
    if file_size != header.length + header.data_len:
        raise CorruptBlock(f"file has {file_size} bytes, header says {header.length + header.data_len}")
    return header, buf


def _read_range(fd: int, header: BlockHeader, offset: int, size: int, prefix: bytes | None,
                pread: Callable[[int, int, int], bytes]) -> bytes:
    """Bytes [offset, offset+size) of the block's data, every chunk they touch verified."""
    end = min(offset + size, header.data_len)
    if offset >= end:
        return b""
    first, cs = offset // header.chunk_size, header.chunk_size
    lo, hi = first * cs, min(_round_up(end, cs), header.data_len)
    if prefix is not None and len(prefix) >= header.length + hi:
        raw = memoryview(prefix)[header.length + lo:header.length + hi]
    else:
        raw = pread(fd, hi - lo, header.length + lo)
        if len(raw) != hi - lo:
            raise CorruptBlock(f"truncated: read {len(raw)} of {hi - lo} bytes at {lo}")
    header.verify(first, memoryview(raw))
    if lo == offset and hi == end and isinstance(raw, bytes):
        return raw
    return bytes(memoryview(raw)[offset - lo:end - lo])


def _pread_willneed(fd: int, size: int, offset: int) -> bytes:
    """pread for a first open: also asks the kernel to read the whole file ahead, so the rest
    of the block is resident (and served inline) when the reader gets there."""
    if offset == 0:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    return os.pread(fd, size, offset)


def _read_resident(opened: _Open, offset: int, size: int) -> bytes:
    """A range of an open block read inline, only if all its pages are in the page cache."""
    return _read_range(opened.fd, opened.header, offset, size, None, _pread_nowait)


def _read_dup(fd: int, header: BlockHeader, offset: int, size: int) -> bytes:
    """Worker thread: read a range through a dup of a cached fd, then close the dup."""
    try:
        return _read_range(fd, header, offset, size, None, os.pread)
    finally:
        os.close(fd)


def _open_and_read(path: str, want: int, offset: int, size: int) -> tuple[int, BlockHeader, bytes]:
    """Worker thread: open, parse and read a range of one block file (FileNotFoundError if gone)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    return _read_opened(fd, want, offset, size)


def _read_opened(fd: int, want: int, offset: int, size: int) -> tuple[int, BlockHeader, bytes]:
    """Parse a just-opened block file and read a range of it; ``fd`` is closed on failure."""
    try:
        header, prefix = _parse_block(fd, want, os.pread)
        return fd, header, _read_range(fd, header, offset, size, prefix, os.pread)
    except BaseException:
        os.close(fd)
        raise


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# --- blocking work, run in worker threads: paths and bytes in, no shared state -------------

def _prepare_root(root: Path, fsync: bool) -> tuple[int, list[tuple[int, str, int]]]:
    """Create the layout, prove it writable, remove stale temp files and list the blocks
    as (mtime_ns, digest, size), oldest first. Stat only: blocks are verified on read."""
    blocks, tmp = root / "blocks", root / "tmp"
    for path in (root, blocks, tmp):
        path.mkdir(parents=True, exist_ok=True)
    for i in range(256):
        (blocks / f"{i:02x}").mkdir(exist_ok=True)
    removed = 0
    with os.scandir(tmp) as entries:
        for entry in entries:
            os.unlink(entry.path)
            removed += 1
    _probe_dir(tmp, fsync)
    found = []
    for i in range(256):
        prefix = f"{i:02x}"
        with os.scandir(blocks / prefix) as entries:
            for entry in entries:
                if _DIGEST_NAME.fullmatch(entry.name) and entry.name.startswith(prefix) \
                        and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    found.append((st.st_mtime_ns, entry.name, st.st_size))
    found.sort()
    return removed, found


def _probe_dir(directory: Path, fsync: bool) -> None:
    """Write, fsync and delete a small file: raises OSError if the disk cannot take writes."""
    path = directory / f"probe.{secrets.token_hex(4)}.tmp"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        _write_all(fd, b"cachefs probe\n")
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
        with suppress(FileNotFoundError):
            os.unlink(path)


def _write_block_file(doomed: list[Path], tmp: Path, final: Path, data: bytes, chunk_size: int,
                      fsync: bool) -> list[OSError]:
    """Unlink the evicted files, then write ``data`` crash-safely as ``final``.

    Returns the unlink errors (missing files are not errors); raises OSError if the write fails.
    """
    errors = _unlink_paths(doomed)
    header = BlockHeader.encode(data, chunk_size)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            written = os.writev(fd, [header, data])
            if written < len(header) + len(data):    # a short writev (rare): finish the rest
                _write_all(fd, (header + data)[written:])
            if fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        # No directory fsync: a rename lost in a crash is only a cache miss. The data is durable
        # before the rename, so a block file that exists never holds unwritten bytes.
        os.rename(tmp, final)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    return errors


def _unlink_paths(paths: list[Path]) -> list[OSError]:
    errors = []
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            errors.append(exc)
    return errors


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
