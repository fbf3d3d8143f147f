"""The tiers composed behind one narrow interface (``Tiers``): the only entry point to the cache.

Read path: kernel page cache aside, a block is served by the memory tier, then the disk tier,
then one (single-flight) ranged GET from the object store. The vfs, the warm engine and the
daemon's status use only ``Tiers``:

=================  ===========================================================================
read, preload      bytes of a pinned file version (``read`` drives the readahead of a stream)
stop               a reader closed its file: cancel the readahead GETs its stream started
readahead_file     start a looked-up small file's GET, for the open that follows to join
warm               put one block of a file in the disk tier (back-pressure, no drop)
check              which blocks of a file each tier holds
evict              drop a file's blocks from every tier
hold, release      keep a running warm job's blocks from eviction
pin, unpin         keep a named dataset's blocks across restarts; ``pinned`` lists them
exact_file(_now)   the verified cache file an open hands to the kernel (FUSE passthrough): a
                   small object's one block, or a large object's whole-object file, written
                   from its cached blocks at an open, at the close of a read to its end or
                   at the end of a warm (``write_whole_soon``); it then holds their bytes
room, stats        what a warm may fill; per-tier numbers for ``cachefs status``
=================  ===========================================================================

All state lives in the trio thread; the GET runs as a trio task (S3) or in a worker thread
(other stores) under a CapacityLimiter (foreground reads, readahead and each warm job have their
own, so readahead never queues a reader). A disk-tier hit whose pages are resident is served
inline (``RWF_NOWAIT``), a cold one in a worker thread (see ``disk/reader.py``). Sequential
readers get a readahead window that doubles while they stay sequential; a readahead that cannot
start at once is dropped and counted, never queued; a reader that closes its file or moves away
cancels its readahead GETs; blocks it has read all of leave the memory tier (drop-behind).
"""

import logging
import math
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import trio

from cachefs.errors import NeedsWait, StoreError
from cachefs.metrics import Metrics
from cachefs.ports import Port
from cachefs.singleflight import SingleFlight
from cachefs.store import ObjectStore
from cachefs.tiers.disk import DiskTier
from cachefs.tiers.handover import ExactFile, HandOver
from cachefs.tiers.hedge import HedgePolicy, Hedger, cancellable_gets
from cachefs.tiers.key import WHOLE, BlockKey, Keys
from cachefs.tiers.memory import MemoryTier
from cachefs.tiers.metrics import TierMetrics
from cachefs.tiers.stream import Stream
from cachefs.tiers.whole import WholeFiles

log = logging.getLogger(__name__)

PRELOAD_MAX = 1 << 20     # largest file pushed into the kernel page cache at open
_CONSUMED_MAX = 4096      # blocks a stream counts the bytes read of (drop-behind)


@dataclass(frozen=True, slots=True)
class FileVersion:
    """One object version as a handle pinned it at open (docs/design.md, invariant 1)."""

    path: str
    etag: str
    size: int


class BlockState(NamedTuple):
    """Where one block of a file is cached (``Tiers.check``)."""

    index: int
    length: int           # data bytes of the block
    memory: bool
    disk: bool
    cost: int             # bytes it takes in the disk tier (header included)


class Tiers:
    @classmethod
    def from_config(cls, cfg, store: ObjectStore, memory: MemoryTier, disk: DiskTier | None, metrics: Metrics, *,
                    packed: bool, first_read: Port | None = None, fetched: Port | None = None,
                    corrupted: Port | None = None) -> "Tiers":
        """The tiers of a mount (``cfg``: its MountConfig; ``packed``: a packed dataset's mount,
        whose blocks default to the packer's part size). ``max_prefetches`` keeps the option's
        old name; it bounds readahead GETs."""
        policy = HedgePolicy(cfg.hedge_percentile, cfg.hedge_budget, cfg.hedge_min_delay)
        return cls(store, memory, disk, metrics, block_size=cfg.block_size_for(packed),
                   readahead_size=cfg.readahead_size, max_fetches=cfg.max_fetches,
                   max_readaheads=cfg.max_prefetches, hedger=Hedger(policy, metrics),
                   readahead_at_lookup=cfg.readahead_at_lookup, first_read=first_read, fetched=fetched,
                   corrupted=corrupted)

    def __init__(self, store: ObjectStore, memory: MemoryTier, disk: DiskTier | None, metrics: Metrics, *,
                 block_size: int, readahead_size: int, max_fetches: int, max_readaheads: int,
                 hedger: Hedger | None = None, readahead_at_lookup: bool = False, first_read: Port | None = None,
                 fetched: Port | None = None, corrupted: Port | None = None) -> None:
        self.store = store
        self.memory = memory
        self.disk = disk
        self.metrics = metrics
        self._m = metrics.group(TierMetrics)
        self.block_size = block_size
        self._keys = Keys(store.identity, block_size)
        self.readahead_size = readahead_size
        self._fetch_limiter = trio.CapacityLimiter(max_fetches)
        self._readahead_limiter = trio.CapacityLimiter(max_readaheads)   # never queues a reader
        self._readahead_slots = max_readaheads
        self.readahead_at_lookup = readahead_at_lookup
        self._readaheads = 0
        self._flights = SingleFlight(on_join=self._m.singleflight_joins.inc)
        self._nursery: trio.Nursery | None = None
        # ports (cachefs/ports.py): a file read from its start (the dataset watch), every block that
        # comes from the store, in the trio thread (a packed view checks its records)
        self.first_read = first_read if first_read is not None else Port("first_read")
        self.fetched = fetched if fetched is not None else Port("fetched")
        # Hedged GETs (hedge.py) take their limiter slots themselves: the store gets an unbounded one.
        self._hedger = hedger if hedger is not None and hedger.policy.enabled and cancellable_gets(store) else None
        self._no_limit = trio.CapacityLimiter(math.inf)
        self.handover = HandOver(disk, metrics, corrupted=corrupted)    # exact cache files handed to the kernel
        self.whole = WholeFiles(disk, memory)       # large objects in one file, for passthrough (whole.py)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the disk tier and the hedge clock, and own the nursery in which readahead runs,
        until cancelled."""
        async with trio.open_nursery() as nursery:
            if self.disk is not None:
                await nursery.start(self.disk.run)
            if self._hedger is not None:
                await nursery.start(self._hedger.run)
            if self.handover.enabled:
                await nursery.start(self.handover.scrub)
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def wait_idle(self) -> None:
        """Return once the disk tier has written (or dropped) every queued fill."""
        if self.disk is not None:
            await self.disk.wait_idle()

    def key(self, f: FileVersion, index: int) -> BlockKey:
        return self._keys.get(f.path, f.etag, index)

    def block_count(self, f: FileVersion) -> int:
        return -(-f.size // self.block_size)

    def keys(self, f: FileVersion) -> Iterator[BlockKey]:
        return (self.key(f, i) for i in range(self.block_count(f)))

    def block_len(self, f: FileVersion, index: int) -> int:
        return min(self.block_size, f.size - index * self.block_size)

    def open_cache_file(self, f: FileVersion, index: int) -> tuple[int, int] | None:
        """A read-only descriptor of the disk-tier file of block ``index`` of ``f`` and where the
        block's bytes start in it (the loader channel hands both to a local loader); None when
        the disk tier does not hold it, or the file's header does not match."""
        if self.disk is None:
            return None
        return self.disk.open_data(self.key(f, index), self.block_len(f, index))

    # ---- the read path ---------------------------------------------------------------------

    async def read(self, f: FileVersion, offset: int, size: int,
                   stream: Stream | None = None) -> bytes | memoryview:
        """Bytes [offset, offset+size) of ``f``, clipped at its end: a ``memoryview`` of the block
        when they are a part of one block held by the memory tier (no copy)."""
        end = min(offset + size, f.size)
        if offset >= end:
            return b""
        bs = self.block_size
        parts = []
        for index in range(offset // bs, (end - 1) // bs + 1):
            base = index * bs
            lo, hi = max(offset, base) - base, min(end, base + bs) - base
            parts.append(await self._read_block(f, index, lo, hi))
        return self._served(f, offset, end, stream, parts)

    def read_now(self, f: FileVersion, offset: int, size: int, stream: Stream | None = None) -> bytes | memoryview:
        """``read`` when every block asked for is in the memory tier, with no wait; NeedsWait
        otherwise (nothing is counted then: the async ``read`` that follows counts it)."""
        end = min(offset + size, f.size)
        if offset >= end:
            return b""
        bs = self.block_size
        first, last = offset // bs, (end - 1) // bs
        if any(not self.memory.contains(self.key(f, i)) for i in range(first, last + 1)):
            raise NeedsWait
        parts = []
        for index in range(first, last + 1):
            base = index * bs
            lo, hi = max(offset, base) - base, min(end, base + bs) - base
            data = self.memory.get(self.key(f, index))
            parts.append(memoryview(data)[lo:hi] if (lo, hi) != (0, len(data)) else data)
        return self._served(f, offset, end, stream, parts)

    def _served(self, f: FileVersion, offset: int, end: int, stream: Stream | None, parts: list):
        """What every read does once it has its bytes: the first-read hook, readahead, the count."""
        if offset == 0 and self.first_read:
            self.first_read(f)
        if stream is not None:
            if stream.ahead and offset != stream.next_offset:
                self._cancel_ahead(stream, offset)
            window = stream.advance(offset, end, self.block_size, self.readahead_size)
            if window:
                self._m.readahead_window.observe(window)
                self._readahead(f, end, window, stream)
            if stream.drop_behind:
                self._drop_behind(f, offset, end, stream)
            if end == f.size and f.size >= self.block_size:
                stream.read_to_end = f          # at close, maybe all cached: write it whole (stop)
        self._m.read_bytes.inc(end - offset)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _drop_behind(self, f: FileVersion, offset: int, end: int, stream: Stream) -> None:
        """Count the bytes of each block this reader has read; a block read whole (in any order:
        READs that waited for a GET complete out of order) is in the kernel page cache, the disk
        tier has it or is writing it, and the memory tier lets it go. A cold 1 GiB checkpoint then
        leaves the daemon's memory at the readahead window instead of 1 GiB, and a new block
        reuses the memory of one just read instead of memory the kernel must fault in page by
        page. (A range read twice counts twice: the block may go a little early, and is then
        read from the disk tier.)"""
        bs, consumed = self.block_size, stream.consumed
        for index in range(offset // bs, (end - 1) // bs + 1):
            base = index * bs
            got = consumed.get(index, 0) + min(end, base + bs) - max(offset, base)
            if got >= min(bs, f.size - base):
                consumed.pop(index, None)
                self.memory.discard(self.key(f, index))
            else:
                consumed[index] = got
        if len(consumed) > _CONSUMED_MAX:     # a random reader touching many blocks: start again
            consumed.clear()

    # ---- a stream several readers share (a packed shard's) -----------------------------------
    def blocks_ahead(self, stream: Stream, f: FileVersion, stop: int) -> range:
        """The blocks of ``f`` the next readahead of ``stream`` after ``stop`` would fetch."""
        return stream.blocks_ahead(stop, f.size, self.block_size, self.readahead_size)

    def continue_stream(self, stream: Stream, offset: int) -> None:
        """A read at ``offset`` continues ``stream`` (its window grows, its readahead follows),
        wherever the reader sharing it read last."""
        stream.next_offset = offset

    # ---- handing cache files to the kernel (FUSE passthrough: handover.py) ----------------------
    def exact_file_now(self, f: FileVersion) -> ExactFile | None:
        """The verified exact cache file of ``f`` (a small object's one block, or a large object's
        whole-object file), held until ``release_exact``; None if there is none (a large object
        whose blocks are all cached is then written as one, in the background); NeedsWait if
        verifying it needs a disk read."""
        key = self._exact_key(f)
        if key is None:
            return None
        exact = self.handover.now(key, f.size)
        if exact is None and key.index == WHOLE:
            self._assemble_soon(f, key)
        return exact

    async def exact_file(self, f: FileVersion) -> ExactFile | None:
        """``exact_file_now``, verifying in a worker thread when needed."""
        key = self._exact_key(f)
        if key is None:
            return None
        exact = await self.handover.get(key, f.size)
        if exact is None and key.index == WHOLE:
            self._assemble_soon(f, key)
        return exact

    def release_exact(self, exact: ExactFile) -> None:
        self.handover.release(exact)

    def passthrough_off(self) -> None:
        """The kernel takes no cache files (INIT without FUSE passthrough, or a hand-over refused
        for good): no more exact files, and no large object written whole for nothing."""
        if self.disk is not None:
            self.disk.no_exact_files()

    def write_whole_soon(self, f: FileVersion) -> None:
        """``f`` may be all in the disk tier (a warm of it ended, a reader that read its end
        closed it): a large object is then written as one whole-object file in the background,
        so the next open hands it to the kernel."""
        if (whole := self._whole_key(f)) is not None:
            self._assemble_soon(f, whole)

    def _exact_key(self, f: FileVersion) -> BlockKey | None:
        if not self.handover.enabled or f.size <= 0:
            return None
        return self.key(f, 0) if f.size < self.block_size else self._whole_key(f)

    def _whole_key(self, f: FileVersion) -> BlockKey | None:
        """The key of ``f``'s whole-object file where it has one (a large object, on a mount whose
        kernel takes cache files), else None."""
        return self.key(f, WHOLE) if self.handover.enabled and f.size >= self.block_size else None

    def _assemble_soon(self, f: FileVersion, whole: BlockKey) -> None:
        if self._nursery is not None:
            self.whole.soon(self._nursery, whole, f.size)

    def preload_needed(self, f: FileVersion) -> bool:
        """Whether an open of ``f`` would push it into the page cache (``preload``): a small
        file the memory tier does not hold (the disk tier has it, or it must be fetched)."""
        return self._small(f) and not self.memory.contains(self.key(f, 0))

    async def preload(self, f: FileVersion, stream: Stream | None = None) -> bytes | None:
        """The whole content of a small file (one block, at most PRELOAD_MAX), for the FUSE adapter
        to hand to the kernel at open: the READ request that would follow never happens. From the
        disk tier (a worker thread reads a cold cache file), or fetched when no tier holds it (the
        GET a READ would have sent, one FUSE round trip sooner). None when the memory tier holds it
        (a READ is served from memory at once), or when the GET fails: the READ then fetches again
        and its error is the reader's."""
        if not self._small(f):
            return None
        key = self.key(f, 0)
        if self.memory.contains(key):
            return None
        if self.disk is not None and self.disk.contains(key):
            data = await self.disk.read_async(key, 0, f.size)
            if data is None or len(data) != f.size:
                return None
            self._m.read_bytes.inc(f.size)      # served to the reader through the page cache
            return data
        try:
            data = await self.read(f, 0, f.size, stream)
        except StoreError as exc:
            log.debug("fetching %s at open failed (the read will try again): %s", f.path, exc)
            return None
        return data if len(data) == f.size else None

    def _small(self, f: FileVersion) -> bool:
        """One block, at most PRELOAD_MAX: the files an open hands to the kernel whole."""
        return 0 < f.size <= min(self.block_size, PRELOAD_MAX)

    async def _read_block(self, f: FileVersion, index: int, lo: int, hi: int) -> bytes | memoryview:
        key = self.key(f, index)
        data = self.memory.get(key)
        if data is not None:        # a part is a view, not a copy: FUSE and the crc32c take any buffer
            return memoryview(data)[lo:hi] if (lo, hi) != (0, len(data)) else data
        if self.disk is not None:
            got = await self.disk.read_async(key, lo, hi - lo)
            if got is not None and len(got) == hi - lo:
                return got
            data = self.disk.filling_data(key)     # fetched (e.g. by a warm) and being written
            if data is None and (whole := self.whole.of(key)) is not None:
                data = await self.whole.read_block(key, self.block_len(f, index), whole)
            if data is not None and len(data) == self.block_len(f, index):
                return data if (lo, hi) == (0, len(data)) else data[lo:hi]
        whole = (lo, hi) == (0, min(self.block_size, f.size - key.offset))
        data = await self._flights.do(key, lambda: self._fetch(f, key, keep=not whole))
        self.memory.read_ahead(key)
        return data if whole else data[lo:hi]

    async def _fetch(self, f: FileVersion, key: BlockKey, keep: bool = True,
                     limiter: trio.CapacityLimiter | None = None, ahead: bool = False) -> bytes:
        """GET one block; fill the disk tier, and the memory tier when ``keep`` (a block read
        whole by one request is in the kernel page cache already: no second copy in memory)."""
        # Errors propagate to the one choke point in fuse_ops, which logs them once.
        data = await self._get(f, key, limiter or self._fetch_limiter)
        if keep:
            self.memory.put(key, data, ahead=ahead)
        if self.disk is not None:
            self.disk.start_fill(key, data)
        return data

    async def _get(self, f: FileVersion, key: BlockKey, limiter: trio.CapacityLimiter) -> bytes:
        """The one GET of a block (its version pinned with If-Match), under ``limiter``; hedged
        by a second GET if it straggles (``hedge.py``)."""
        end = min(key.offset + self.block_size, f.size)
        if self._hedger is None:
            data = await self.store.get_async(f.path, key.offset, end, f.etag, f.size, limiter=limiter)
        else:
            def call() -> Awaitable[bytes]:
                return self.store.get_async(f.path, key.offset, end, f.etag, f.size, limiter=self._no_limit)
            data = await self._hedger.get(call, end - key.offset, limiter, busy=self.foreground_waiting)
        if self.fetched:
            self.fetched(f, key.offset, data)
        return data

    def stop(self, stream: Stream) -> None:
        """The reader of ``stream`` closed its file: cancel the readahead GETs it started (a
        reader waiting on one of them starts its own GET instead)."""
        self._cancel_ahead(stream, None)
        if stream.read_to_end is not None:
            self.write_whole_soon(stream.read_to_end)

    def _cancel_ahead(self, stream: Stream, offset: int | None) -> None:
        """Cancel ``stream``'s readahead GETs of blocks more than a full window away from a reader
        now at ``offset`` (all of them when None). A reader that moved less keeps its readahead:
        the kernel's own readahead sends READs up to ``read_ahead_kb`` ahead of the reader, and
        READs that waited complete out of order (a first version that also cancelled the blocks
        just behind such a READ sent a second GET for some blocks of a sequential read)."""
        if offset is None:
            doomed = list(stream.ahead)
        else:
            window = self.readahead_size
            first, last = max(0, offset - window) // self.block_size, (offset + window) // self.block_size
            doomed = [index for index in stream.ahead if not first <= index <= last]
        for index in doomed:
            stream.ahead.pop(index).cancel()
            self._m.readahead_cancelled.inc()

    def _readahead(self, f: FileVersion, start: int, window: int, stream: Stream) -> None:
        """Start background fetches for the blocks in [start, start+window); drop when busy."""
        if self._nursery is None or start >= f.size:
            return
        bs = self.block_size
        last = (min(start + window, f.size) - 1) // bs
        for index in range(start // bs, last + 1):
            key = self.key(f, index)
            if (self.memory.contains(key) or self._flights.in_flight(key)
                    or (self.disk is not None and self.disk.filling(key))):
                continue
            if self._readaheads >= self._readahead_slots:
                self._m.dropped_fills.labels("readahead", "queue_full").inc()
                return
            self._readaheads += 1
            scope = stream.ahead[index] = trio.CancelScope()     # cancelled by its reader moving away or closing
            self._nursery.start_soon(self._readahead_block, f, key, scope, stream)

    def readahead_file(self, f: FileVersion) -> None:
        """A small file (``_small``) was looked up and no tier holds it: start its GET now, as
        the foreground fetch it is about to be, so the open that follows (and fetches it, see
        ``preload``) joins a GET already under way instead of sending one a FUSE round trip
        later. Not started when every foreground fetch slot is taken; the block is not kept in
        memory (the open hands it to the kernel)."""
        if not self.readahead_at_lookup or self._nursery is None or not self._small(f):
            return
        key = self.key(f, 0)
        if self.is_cached(key) or (self.disk is not None and self.disk.filling(key)):
            return
        if self._fetch_limiter.available_tokens < 1:
            return
        # In flight from now on, not from when the task first runs: an open sent at once joins
        # this GET (measured: with a fast store, 18% of the files were fetched twice when the
        # open's own GET had ended before the readahead's task started).
        if self._flights.start_soon(self._nursery, key, lambda: self._fetch_ahead(f, key)):
            self._m.lookup_readaheads.inc()
            # The task runs on a later scheduler pass (0.6 ms on, mean, with 8 cold readers): the
            # store may send its GET now and let the task read the answer.
            self.store.start_get(f.path, 0, f.size, f.etag, f.size)     # a small file is its one block

    async def _fetch_ahead(self, f: FileVersion, key: BlockKey) -> bytes:
        try:
            return await self._fetch(f, key, keep=False)
        except StoreError as exc:
            log.info("fetching %s at its lookup failed (its open will retry): %s", f.path, exc)
            raise
        except Exception:          # a joining open gets it too; logged here in case none joins
            log.exception("fetching %s at its lookup failed", f.path)
            raise

    async def _readahead_block(self, f: FileVersion, key: BlockKey, scope: trio.CancelScope, stream: Stream) -> None:
        with scope:
            try:
                if self.disk is not None and self.disk.contains(key):
                    await self.disk.readahead(key)     # the kernel reads the cache file ahead
                    return
                whole = self.whole.of(key)
                if whole is not None:                  # the block is in a whole-object file
                    await self.whole.read_block(key, self.block_len(f, key.index), whole)
                    return
                await self._flights.do(key, lambda: self._fetch(f, key, limiter=self._readahead_limiter, ahead=True))
                self._m.readahead_blocks.inc()
            except StoreError as exc:
                log.info("readahead of %s block %d failed (a reader will retry): %s", f.path, key.index, exc)
            finally:
                self._readaheads -= 1
                if stream.ahead.get(key.index) is scope:
                    del stream.ahead[key.index]

    # ---- warm, check, evict (cachefs/warm/engine.py) ---------------------------------------

    def foreground_waiting(self) -> bool:
        """Readers are queued for a fetch slot: a warm job should step back."""
        return self._fetch_limiter.statistics().tasks_waiting > 0

    def is_cached(self, key: BlockKey) -> bool:
        return self.memory.contains(key) or self.whole.has(key) or self._flights.in_flight(key)

    def check(self, f: FileVersion) -> list[BlockState]:
        """Where each block of ``f`` is cached (no fetching)."""
        out = []
        for key in self.keys(f):
            length = self.block_len(f, key.index)
            on_disk = self.whole.has(key)
            cost = self.disk.file_size(length) if self.disk is not None else length
            out.append(BlockState(key.index, length, self.memory.contains(key), on_disk, cost))
        return out

    async def warm(self, f: FileVersion, index: int, limiter: trio.CapacityLimiter,
                   keep: bool = False) -> tuple[int, bool]:
        """Put block ``index`` of ``f`` in the disk tier: (bytes fetched, cached now).

        The GET runs under the warm job's ``limiter`` and joins (or leads) the block's single
        flight, so a reader wanting it meanwhile waits for this GET instead of issuing a second;
        the write goes to the disk tier and is awaited: back-pressure instead of a dropped fill.
        A block fetched goes to the memory tier too only when ``keep`` (a shard warm: readers are
        reading that shard now, and serve its files from memory instead of reading back the
        cache file just written); a `cachefs warmup` ahead of a run leaves the memory tier to
        what readers use. A changed object raises VersionChanged (If-Match)."""
        key = self.key(f, index)
        if self.disk is None:
            return 0, False
        if self.whole.has(key):
            return 0, True
        if await self.disk.wait_fill(key):        # a reader's fill of it was queued: no second GET
            return 0, True
        data = self.memory.get(key) if self.memory.contains(key) else None
        fetched = 0
        if data is None:
            data = await self._flights.do(key, lambda: self._get(f, key, limiter))
            fetched = len(data)
            if keep:
                self.memory.put(key, data)
        return fetched, await self.disk.warm(key, data)

    def evict_range(self, f: FileVersion, offset: int, length: int) -> None:
        """Drop the blocks holding bytes [offset, offset+length) of ``f`` from the memory and disk
        tiers (a packed record that failed its check: the next read fetches them again)."""
        bs = self.block_size
        for index in range(offset // bs, (offset + max(length, 1) - 1) // bs + 1):
            key = self.key(f, index)
            self.memory.discard(key)
            if self.disk is not None:
                self.disk.discard(key)

    def evict(self, f: FileVersion) -> tuple[int, int]:
        """Drop every block of ``f`` from every tier (a queued fill is cancelled):
        (blocks that were cached, their data bytes)."""
        blocks = size = 0
        for state in self.check(f):
            key = self.key(f, state.index)
            if state.memory or state.disk:
                blocks += 1
                size += state.length
            self.memory.discard(key)
            if self.disk is not None:
                self.disk.discard(key)
        if self.disk is not None:
            self.disk.discard(self.key(f, WHOLE))     # a large object's whole-object file, if any
        return blocks, size

    # ---- holds and pins --------------------------------------------------------------------

    def hold(self, f: FileVersion, held: set[str]) -> None:
        """Keep the blocks of ``f`` in the disk tier from eviction until ``release(held)``;
        ``held`` records them (a block already in it is not held twice)."""
        keys = list(self.keys(f))
        if (whole := self._whole_key(f)) is not None:
            keys.append(whole)                       # its whole-object file, there or to come
        for key in keys:
            digest = key.digest()
            if digest not in held:
                held.add(digest)
                if self.disk is not None:
                    self.disk.hold((digest,))

    def release(self, held: set[str]) -> None:
        if self.disk is not None:
            self.disk.release(held)

    def pin(self, name: str, held: set[str]) -> None:
        """Keep ``held`` (from ``hold``) under ``name`` until ``unpin(name)``, across restarts."""
        if self.disk is not None:
            self.disk.pin(name, set(held))

    def unpin(self, name: str) -> bool:
        return self.disk is not None and self.disk.unpin(name)

    def pinned(self) -> dict[str, int]:
        """Blocks pinned per dataset name."""
        return self.disk.pinned() if self.disk is not None else {}

    # ---- room and status -------------------------------------------------------------------

    @property
    def disk_capacity(self) -> int:
        return self.disk.capacity if self.disk is not None else 0

    def room(self) -> dict:
        """What a warm job may fill: capacity, used, held (pins and running warm jobs) and room."""
        if self.disk is None:
            return {"capacity": 0, "used": 0, "held": 0, "room": 0}
        return self.disk.room()

    def stats(self) -> dict:
        """Per tier: hits, misses, hit ratio and bytes (from the metrics), and what it holds."""
        out = {}
        for tier in ("memory", "disk"):
            hits = self.metrics.counter_value("cachefs_tier_hits_total", tier=tier)
            misses = self.metrics.counter_value("cachefs_tier_misses_total", tier=tier)
            out[tier] = {"hits": int(hits), "misses": int(misses),
                         "hit_ratio": round(hits / (hits + misses), 4) if hits + misses else None,
                         "hit_bytes": int(self.metrics.counter_value("cachefs_tier_hit_bytes_total", tier=tier))}
        out["memory"].update(used_bytes=self.memory.used, capacity_bytes=self.memory.capacity,
                             blocks=len(self.memory))
        if self.disk is not None:
            out["disk"].update(self.disk.stats())
        if self._hedger is not None:
            out["hedge"] = self._hedger.stats()
        return out
