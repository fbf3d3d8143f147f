"""The disk tier: checksummed block files on the local NVMe, bounded in size.

The facade over the parts in this package (see ``cachefs/tiers/README.md`` for the concurrency
and crash protocol): ``format`` (one block file), ``index`` (which files exist: a segmented
LRU; the layout), ``space`` (capacity, watermark, eviction), ``health`` (fencing a failing
disk), ``reader`` (the read policy). This module owns the fill queue, unlinks, holds and pins.
"""

from __future__ import annotations

import errno
import functools
import logging
import math
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path

import trio

from cachefs.errors import CacheDirError, CorruptBlock
from cachefs.metrics import Metrics
from cachefs.sched import in_thread
from cachefs.tiers.disk import format as fmt
from cachefs.tiers.disk import index as layout
from cachefs.tiers.disk.direct import DirectWrites
from cachefs.tiers.disk.fills import FillBudget, FillJob
from cachefs.tiers.disk.format import BlockHeader
from cachefs.tiers.disk.health import DiskHealth, HealthWatch
from cachefs.tiers.disk.index import Entry, Layout, SegmentedLRU
from cachefs.tiers.disk.reader import BlockReader
from cachefs.tiers.disk.seals import Seals
from cachefs.tiers.disk.space import Room, Space
from cachefs.tiers.key import BlockKey
from cachefs.tiers.metrics import TierMetrics
from cachefs.tiers.pins import PinSet

log = logging.getLogger(__name__)

_TIER = "disk"


class DiskTier:
    """Block files under ``root``, at most ``capacity`` bytes (headers included)."""

    @classmethod
    def from_config(cls, cfg, metrics: Metrics, *, exact_files: bool) -> DiskTier:
        """The disk tier of a mount (``cfg``: its MountConfig) under its cache dir; queued fills
        bounded by a quarter of the memory tier, at most 256 MiB."""
        return cls(cfg.disk_path, capacity=cfg.cache_size,
                   free_space_ratio=cfg.free_space_ratio, metrics=metrics, fsync=cfg.fsync_cache_files,
                   fill_workers=cfg.fill_workers, direct_io=cfg.cache_direct_io, exact_files=exact_files,
                   max_pending_fill_bytes=min(cfg.mem_cache_size // 4, 256 << 20), seals=cfg.passthrough_seals)

    def __init__(self, root: Path, *, capacity: int, free_space_ratio: float, metrics: Metrics,
                 fsync: bool = True, fill_workers: int = 4, max_pending_fill_bytes: int = 256 << 20,
                 chunk_size: int = 128 << 10, health: DiskHealth | None = None,
                 warm_workers: int = 8, direct_io: bool = True, exact_files: bool = False,
                 seals: bool = True) -> None:
        self.layout = Layout(root)
        # single-block objects as exact files (format.XATTR): FUSE passthrough hands them to the kernel;
        # each read back as written and sealed (seals.py): handed over with no read first
        self.exact_files = exact_files
        self.root = self.layout.root
        self.seals = Seals(os.path.join(root, "seals"), live=self.contains_digest) if exact_files and seals else None
        self.metrics = metrics                        # the daemon's registry (counter_value)
        self._metrics = metrics.group(TierMetrics)
        self._fsync = fsync
        self._fill_workers = fill_workers
        self._chunk_size = chunk_size
        self._health = health or DiskHealth()
        self._index = SegmentedLRU(int(capacity * 0.8))
        self.space = Space(self._index, self.root, capacity=capacity, free_space_ratio=free_space_ratio,
                           evict=self._evict)
        self.reader = BlockReader(self._index, self.layout, self._health, metrics, chunk_size=chunk_size,
                                  drop=self._drop_bad)
        self._fills = FillBudget(max_pending_fill_bytes, fill_workers)    # the foreground fill queue
        self._inflight: dict[str, FillJob] = {}
        self._unlinking: dict[str, trio.Event] = {}
        self._assembling: dict[str, bool] = {}    # whole-object files being written -> discarded meanwhile
        self._limiter = self._fills.limiter       # reader fills' writers: 1 to fill_workers (fills.py)
        self._warm_limiter = trio.CapacityLimiter(max(warm_workers, fill_workers))   # warm writers
        self.watch = HealthWatch(self._health, metrics, self.root, self.layout.tmp, fsync=fsync,
                                 limiter=self._limiter)
        self.pins = PinSet(self.root / "pins")
        self._fill_send, self._fill_recv = trio.open_memory_channel[FillJob](math.inf)
        self._nursery: trio.Nursery | None = None
        # O_DIRECT writes (direct.py): no copy into the page cache for every cached byte.
        # The pool keeps a buffer for every writer the two limiters admit at once (reader fills
        # beside warm writers); a writer without one maps and faults in a fresh buffer per block.
        writers = fill_workers + self._warm_limiter.total_tokens
        self.direct = DirectWrites(keep=int(writers)) if direct_io else None
        # a seam for tests: a blocking call that can fail
        self._write_file = functools.partial(fmt.write_block_file, direct=self.direct)
        self._metrics.tier_capacity_bytes.labels(_TIER).set(capacity)
        self._update_gauges()

    @property
    def capacity(self) -> int:
        return self.space.capacity

    # -- lifecycle --

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await self._rebuild()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._shrink_to_capacity()
                while self._unlinking:             # start within capacity
                    await trio.sleep(0.005)
                for _ in range(self._fill_workers):
                    nursery.start_soon(self._fill_worker, self._fill_recv.clone())
                nursery.start_soon(self.watch.run)
                task_status.started()
        finally:
            self._nursery = None
            self.reader.close_all()

    async def _rebuild(self) -> None:
        """Index the block files found on disk (stat only) and the persisted pins."""
        try:
            removed, found = await trio.to_thread.run_sync(layout.prepare_root, self.root, self._fsync)
        except OSError as exc:
            raise CacheDirError(f"cannot use cache dir {self.root}: {exc.strerror or exc}") from exc
        if removed:
            log.info("removed %d stale temp files from %s", removed, self.layout.tmp)
        if self.exact_files and not await trio.to_thread.run_sync(fmt.keeps_xattrs, self.layout.tmp):
            self._no_xattrs()
        pins = await trio.to_thread.run_sync(self.pins.load)
        for digests in pins.values():
            for digest in digests:
                self._index.hold(digest)
        for _, digest, size in found:
            self._index.add(digest, Entry(size, None))
        log.info("disk tier %s: %d blocks, %d bytes", self.root, len(self._index), self._index.bytes)

    async def wait_idle(self) -> None:
        """Return once no fill is queued or running, no whole-object file is being written and no
        unlink is pending."""
        while self._inflight or self._unlinking or self._assembling:
            await trio.sleep(0.005)

    # -- reads (the policy lives in reader.py) --

    def read(self, key: BlockKey, offset: int, size: int) -> bytes | None:
        """Bytes [offset, min(offset+size, block length)) of a cached block, verified; None on a miss."""
        return self.reader.read(key.digest(), offset, size)

    async def read_async(self, key: BlockKey, offset: int, size: int) -> bytes | None:
        """``read`` that never lets a slow disk stall the trio thread (see ``BlockReader``)."""
        return await self.reader.read_async(key.digest(), offset, size)

    async def readahead(self, key: BlockKey) -> None:
        """Have the kernel read a cached block's file ahead (a sequential reader will want it)."""
        await self.reader.readahead(key.digest())

    def block_length(self, key: BlockKey) -> int | None:
        """Data length of a cached block (reads its header once after a restart); None if absent."""
        return self.reader.block_length(key.digest())

    def filling(self, key: BlockKey) -> bool:
        """A fill of this block is queued or being written."""
        return key.digest() in self._inflight

    def filling_data(self, key: BlockKey) -> bytes | None:
        """The bytes of this block's queued or running fill (a reader takes them from there
        instead of a second GET while they are written), or None."""
        job = self._inflight.get(key.digest())
        return job.data if job is not None and not job.cancelled else None

    async def wait_fill(self, key: BlockKey) -> bool | None:
        """Wait for this block's queued or running fill: whether it was written; None if none."""
        job = self._inflight.get(key.digest())
        if job is None:
            return None
        await job.done.wait()
        return job.ok

    def contains(self, key: BlockKey) -> bool:
        return self.contains_digest(key.digest())

    def contains_digest(self, digest: str) -> bool:
        return self._health.state != DiskHealth.DOWN and digest in self._index

    def exact_file(self, key: BlockKey, trusted: Callable[[os.stat_result], bool] | None = None
                   ) -> tuple[int, fmt.BlockHeader | None, os.stat_result] | None:
        """A read-only descriptor, the header and the ``fstat`` of the block's file if it is an
        exact file (the object's bytes from offset 0, header in its attribute); None otherwise.
        Not verified. The header is not read (None) where ``trusted(fstat)`` says the file is one
        already checked whole (a seal)."""
        fd = self.open_block_file(key)
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            if trusted is not None and trusted(st):
                return fd, None, st
            header = fmt.exact_header(fd)
            if header is not None and st.st_size == header.data_len:
                return fd, header, st
        except (OSError, CorruptBlock):
            pass
        os.close(fd)
        return None

    def open_data(self, key: BlockKey, data_len: int) -> tuple[int, int] | None:
        """A read-only descriptor of ``key``'s file and where its data starts (its header's
        length; 0 for an exact file), if the tier holds it and its header is sound and says
        ``data_len`` bytes; else None. Not verified: the reader checks what it reads."""
        fd = self.open_block_file(key)
        if fd is None:
            return None
        try:
            header, _ = fmt.parse_block(fd, 0, os.pread)
            if header.data_len == data_len:
                return fd, header.length
        except (OSError, CorruptBlock):
            pass
        os.close(fd)
        return None

    def open_block_file(self, key: BlockKey) -> int | None:
        """A read-only descriptor of the block's file, or None when the tier does not hold it.
        The file is never rewritten in place (temp + rename) and an evicted one stays readable
        through the descriptor: its reader sees the checked-in bytes."""
        if not self.contains(key):
            return None
        try:
            return os.open(self.layout.block_file(key.digest()), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None

    # -- fills --

    def start_fill(self, key: BlockKey, data: bytes) -> bool:
        """Queue ``data`` to be written; False (counted) when the fill is dropped instead."""
        digest = key.digest()
        if self._already_there(digest):
            return True
        reason = self._refusal(len(data))
        if reason is None and self._fills.full(len(data)):
            reason = "queue_full"
        if reason is not None:
            self._metrics.dropped_fills.labels(_TIER, reason).inc()
            return False
        self._fill_send.send_nowait(self._register(digest, data, exact=self._exact(key, data)))
        return True

    def _exact(self, key: BlockKey, data: bytes) -> bool:
        """Write this block as an exact file: it is a whole object (block 0, shorter than a block)."""
        return self.exact_files and key.index == 0 and 0 < len(data) < key.block_size

    async def fill(self, key: BlockKey, data: bytes) -> bool:
        """Write ``data`` now and wait; True when the block is cached."""
        return await self._fill_now(key, data, low=False)

    async def warm(self, key: BlockKey, data: bytes) -> bool:
        """Write a warmup's block and wait (back-pressure instead of a drop); True when cached.

        Uses its own writer threads, and stays out of the foreground fill queue's byte budget,
        so a warmup never makes a reader's fill be dropped as queue_full."""
        return await self._fill_now(key, data, low=True)

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
        job = self._register(digest, data, low=low, exact=self._exact(key, data))
        await self._store(job)
        return job.ok

    def discard(self, key: BlockKey) -> None:
        digest = key.digest()
        job = self._inflight.get(digest)
        if job is not None:
            job.cancelled = True
        if digest in self._assembling:
            self._assembling[digest] = True       # dropped once written
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
        if self.file_size(data_len) > self.capacity:
            return "no_space"
        return None

    def _register(self, digest: str, data: bytes, low: bool = False, exact: bool = False) -> FillJob:
        job = self._inflight[digest] = FillJob(digest, bytes(data), low=low, exact=exact)
        if not low:
            self._fills.add(len(job.data))
        return job

    async def _fill_worker(self, recv: trio.MemoryReceiveChannel[FillJob]) -> None:
        async with recv:
            async for job in recv:
                await self._store(job)

    async def _store(self, job: FillJob) -> None:
        try:
            job.ok = await self._write(job)
        finally:
            del self._inflight[job.digest]
            if not job.low:
                self._fills.done(len(job.data))
            job.done.set()

    async def _write(self, job: FillJob) -> bool:
        unlinking = self._unlinking.get(job.digest)
        if unlinking is not None:
            await unlinking.wait()
        if job.cancelled:
            return False
        stamp: list[os.stat_result] = []      # the exact file read back as written (seals.py)
        write = (functools.partial(self._write_file, exact=True, sealed=self._sealing(stamp))
                 if job.exact and self.exact_files else self._write_file)
        room = await self._write_new(
            job.digest, len(job.data), lambda doomed, tmp, final: write(
                doomed, tmp, final, job.data, self._chunk_size, self._fsync),
            self._warm_limiter if job.low else self._limiter)
        if room is None:
            return False
        if job.cancelled:
            self._schedule_unlink(job.digest, room.size)
            return False
        self._index.add(job.digest, Entry(room.size, len(job.data)))
        self._seal(job.digest, stamp)
        self._update_gauges()
        return True

    async def _write_new(self, digest: str, data_len: int, write: Callable[[list[Path], Path, Path], list[OSError]],
                         limiter: trio.CapacityLimiter) -> Room | None:
        """Reserve room for the new file ``digest`` of ``data_len`` data bytes (evicting what must
        go) and run ``write(doomed, tmp, final)`` in a worker thread: it unlinks the evicted
        files, writes ``tmp`` and renames it to ``final``. The reservation once written; None
        when it is not (the reason counted)."""
        room = self._room_for(data_len)
        if room is None:
            return None
        gone = trio.Event()
        for doomed in room.doomed:
            self._unlinking[doomed] = gone
        tmp = self.layout.tmp / f"{digest}.{secrets.token_hex(4)}.tmp"
        written = False
        try:
            errors = await in_thread(write, [self.layout.block_path(d) for d in room.doomed], tmp,
                                     self.layout.block_path(digest), limiter=limiter)
            written = True
        except fmt.NoXattrs:
            self._no_xattrs()
            return None
        except CorruptBlock as exc:          # a whole-object file's source block
            log.info("disk tier: not writing %s: %s", digest, exc)
            return None
        except OSError as exc:
            self._write_failed(exc)
            return None
        finally:
            self._release(room, written)
            gone.set()
        for exc in errors:
            self.watch.io_error("unlink", exc)
        return room

    # -- whole-object files (a large object handed to the kernel: FUSE passthrough) --

    def assembling(self, whole: BlockKey) -> bool:
        return whole.digest() in self._assembling

    async def assemble(self, whole: BlockKey, blocks: list[BlockKey], data_len: int) -> bool:
        """Write the object whose cached blocks are ``blocks`` as one exact file under the key
        ``whole`` (``format.write_whole_file``): True once it is in the tier. The blocks are held
        while they are copied, then dropped: the whole file holds their bytes (``Tiers`` reads a
        block from it). A block something else holds (a pin, a running warm) stays, at the cold
        end of the index, and the object takes its bytes twice until it goes (both counted)."""
        digest = whole.digest()
        chunk = fmt.whole_chunk_size(data_len, whole.block_size)
        if (not self.exact_files or chunk is None or digest in self._index or digest in self._assembling
                or not all(self.contains(key) for key in blocks)):
            return False
        sources = [key.digest() for key in blocks]
        self._assembling[digest] = False
        self.hold(sources)
        try:
            ok = await self._assemble(digest, sources, data_len, chunk, whole.block_size)
        finally:
            self.release(sources)
            cancelled = self._assembling.pop(digest)
        if ok and cancelled:
            self._drop(digest)
            return False
        if ok:
            for source in sources:
                if self._index.is_held(source):
                    self._index.demote(source)        # a pin or a warm still wants it: kept
                else:
                    self._drop(source)
        self._metrics.whole_files.labels("assembled" if ok else "failed").inc()
        return ok

    def _sealing(self, stamp: list[os.stat_result]) -> fmt.Sealed | None:
        """What a writer thread hands the ``fstat`` of an exact file it read back right to (the
        trio thread seals it, ``_seal``); None when nothing is sealed."""
        return stamp.append if self.seals is not None else None

    def _seal(self, digest: str, stamp: list[os.stat_result]) -> None:
        if stamp and self.seals is not None:
            self.seals.seal(digest, stamp[0])

    def _no_xattrs(self) -> None:
        """No user extended attributes on the cache filesystem: said and counted once; no exact files."""
        if not self.exact_files:
            return
        log.info("disk tier: %s keeps no user extended attributes: cache files keep their header "
                 "inside, and FUSE passthrough is off", self.root)
        self.exact_files = False
        self._metrics.passthrough_fallbacks.labels("no_xattr").inc()

    def no_exact_files(self) -> None:
        """The kernel takes no cache files (no FUSE passthrough): write no more exact files."""
        self.exact_files = False

    async def _assemble(self, digest: str, sources: list[str], data_len: int, chunk: int, block_size: int) -> bool:
        unlinking = self._unlinking.get(digest)       # a dropped (corrupt) earlier one: gone first
        if unlinking is not None:
            await unlinking.wait()
        blocks = [(self.layout.block_file(d), min(block_size, data_len - i * block_size))
                  for i, d in enumerate(sources)]
        stamp: list[os.stat_result] = []
        room = await self._write_new(digest, data_len, lambda doomed, tmp, final: fmt.write_whole_file(
            doomed, tmp, final, blocks, chunk, self._fsync, self.direct, self._sealing(stamp)), self._warm_limiter)
        if room is None:
            return False
        self._index.add(digest, Entry(room.size, data_len))
        self._seal(digest, stamp)
        self._update_gauges()
        return True

    def _room_for(self, data_len: int) -> Room | None:
        """Reserve room for a block file, or count why the fill is dropped and return None."""
        reason = "unhealthy"
        if self._health.state == DiskHealth.HEALTHY:
            try:
                room = self.space.reserve(self.file_size(data_len))
            except OSError as exc:
                self.watch.io_error("statvfs", exc)
                room, reason = None, "error"
            else:
                reason = "no_space"
            if room is not None:
                return room
        self._metrics.dropped_fills.labels(_TIER, reason).inc()
        return None

    def _release(self, room: Room, written: bool) -> None:
        """Return a reservation once its thread is done (evicted files unlinked by then)."""
        self.space.release(room, written)
        for digest in room.doomed:
            del self._unlinking[digest]
        self._update_gauges()

    def _write_failed(self, exc: OSError) -> None:
        if exc.errno == errno.ENOSPC:
            self._metrics.disk_errors.labels("write").inc()
            self._metrics.dropped_fills.labels(_TIER, "no_space").inc()
            self.space.disk_full()
            log.info("cache disk %s is full: %s", self.root, exc)
            return
        self.watch.io_error("write", exc)
        self._metrics.dropped_fills.labels(_TIER, "error").inc()

    # -- dropping blocks --

    def _evict(self, digest: str) -> int:
        entry = self._forget(digest)
        self._metrics.evictions.labels(_TIER).inc()
        self._metrics.evicted_bytes.labels(_TIER).inc(entry.size)
        return entry.size

    def _shrink_to_capacity(self) -> None:
        for digest, size in self.space.over_capacity():
            self._schedule_unlink(digest, size)
        self._update_gauges()

    def _forget(self, digest: str) -> Entry | None:
        self.reader.close(digest)
        return self._index.remove(digest)

    def _drop(self, digest: str) -> None:
        entry = self._forget(digest)
        if entry is not None:
            self._schedule_unlink(digest, entry.size)
            self._update_gauges()

    def drop_corrupt(self, digest: str, exc: Exception) -> None:
        """A check outside the tier found ``digest``'s file corrupt (or unreadable): drop it."""
        self._drop_bad(digest, exc)

    def _drop_bad(self, digest: str, exc: Exception) -> None:
        """A read found ``digest`` corrupt (CorruptBlock) or failing (OSError): drop it."""
        if isinstance(exc, CorruptBlock):
            if digest in self._index:
                log.info("dropping corrupt disk block %s: %s", digest, exc)
                self._metrics.corrupt_blocks.inc()
                self._drop(digest)
            return
        self.watch.io_error("read", exc)
        self._drop(digest)

    def _schedule_unlink(self, digest: str, size: int) -> None:
        """Unlink a block file that left the index; its bytes stay reserved until it is gone."""
        path = self.layout.block_path(digest)
        if self._nursery is None:          # not running: nothing can race with us
            fmt.unlink_paths([path])
            return
        done = self._unlinking[digest] = trio.Event()
        self.space.unlink_started(size)
        self._nursery.start_soon(self._unlink, digest, path, size, done)

    async def _unlink(self, digest: str, path: Path, size: int, done: trio.Event) -> None:
        try:
            errors = await trio.to_thread.run_sync(fmt.unlink_paths, [path], limiter=self._limiter)
        finally:
            del self._unlinking[digest]
            self.space.unlink_done(size)
            self._update_gauges()
            done.set()
        for exc in errors:
            self.watch.io_error("unlink", exc)

    # -- holds and pins (a running warm job's blocks; named datasets) --

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

    def pinned(self) -> dict[str, int]:
        """Blocks pinned per name."""
        return {name: len(digests) for name, digests in self.pins.pins.items()}

    # -- space and status --

    def file_size(self, data_len: int) -> int:
        """Bytes a block of ``data_len`` bytes takes in the tier (header included)."""
        return BlockHeader.file_size(data_len, self._chunk_size)

    def room(self) -> dict:
        """What a warmup may fill (see ``Space.room``)."""
        return self.space.room()

    def _update_gauges(self) -> None:
        self._metrics.tier_used_bytes.labels(_TIER).set(self.space.used)
        self._metrics.tier_blocks.labels(_TIER).set(len(self._index))

    def stats(self) -> dict:
        return {
            "used_bytes": self.space.used,
            "capacity": self.capacity,
            "blocks": len(self._index),
            "protected_bytes": self._index.protected_bytes,
            "held_bytes": self._index.held_bytes,
            "pending_fill_bytes": self._fills.bytes,
            "whole_files_writing": len(self._assembling),
            "health": self._health.name,
            "writes": "buffered" if self.direct is None else self.direct.mode(),
        }
