"""Handing cache files to the kernel (FUSE passthrough): which, verified, held while handed over.

A whole object of less than one block is cached as an *exact* file (``disk.format``: the object's
bytes from offset 0, header in an extended attribute). The kernel can read such a file itself, with
no READ request to the daemon, once the daemon hands it over at OPEN. The promise of the cache
(docs/design.md, invariant 8) holds:

- a file is verified, every chunk against its header, before its first hand-over in this boot,
  by the disk tier's own verified read (``read_async``: inline when its pages are resident, read
  ahead then inline on a fast disk, in a worker thread on a slow one); a corrupt one is dropped,
  counted, and the open falls back to the normal path (which fetches it again). The disk tier
  reads each exact file back as it writes it and *seals* it (disk/seals.py: its inode, ctime and
  size in this boot), and a file verified here is sealed too: this daemon and later ones hand a
  sealed file over unread while the seal matches (a later one queues it for the scrub);
- a background scrub (``scrub``) re-verifies handed-over files at a bounded rate, small files a
  batch per worker-thread call; a corrupt one is dropped and named on the ``corrupted`` port (the
  FUSE layer stops handing its backing out);
- a handed-over block is held: eviction skips it until the kernel's last user releases it, so
  the capacity rule counts what the kernel still reads.
"""

import itertools
import logging
import os
import time
from dataclasses import dataclass

import trio

from cachefs.errors import CorruptBlock, NeedsWait
from cachefs.metrics import Metrics
from cachefs.ports import Port
from cachefs.sched import in_thread
from cachefs.tiers.disk import DiskTier
from cachefs.tiers.disk import format as fmt
from cachefs.tiers.key import WHOLE, BlockKey
from cachefs.tiers.metrics import TierMetrics

log = logging.getLogger(__name__)

SCRUB_AGE = float(os.environ.get("CACHEFS_TEST_SCRUB_AGE", 600.0))   # seconds before the scrub verifies a file again
GONE, SKIP, LARGE = "gone", "skip", "large"    # what the scrub's batch found, besides right (None) and corrupt


@dataclass(slots=True)
class ExactFile:
    """A verified exact cache file, open, held in the disk tier until ``HandOver.release``."""

    fd: int
    key: BlockKey
    size: int


class HandOver:
    def __init__(self, disk: DiskTier | None, metrics: Metrics, scrub_bytes_s: float = 16 << 20,
                 corrupted: Port | None = None) -> None:
        self.disk = disk
        self.corrupted = corrupted if corrupted is not None else Port("corrupted")     # digest of a corrupt file
        self.metrics = metrics.group(TierMetrics)
        self.scrub_bytes_s = scrub_bytes_s
        self._verified: dict[str, float] = {}     # digest -> when it was last verified (monotonic)
        self._held: dict[str, int] = {}           # digest -> hand-overs not yet released
        self._limiter = trio.CapacityLimiter(16)
        self.seals = disk.seals if disk is not None else None       # kept by the disk tier (seals.py)
        self._sealed_files = self.metrics.scrub_files.labels("sealed")     # once: labels() is not free
        self._scrubbed_ok = self.metrics.scrub_files.labels("ok")

    @property
    def enabled(self) -> bool:
        return self.disk is not None and self.disk.exact_files

    def now(self, key: BlockKey, size: int) -> ExactFile | None:
        """The exact file of ``key`` if it was verified in this daemon's life or its seal matches;
        None if there is none; NeedsWait if it needs verifying first (a disk read: ``get``)."""
        if not self.enabled or not self.disk.contains(key):
            return None
        digest = key.digest()
        if digest not in self._verified:
            got = self._open(key, size, unread_if_sealed=True)
            if got is None:
                return None
            if not self._sealed(digest, got):
                os.close(got[0])
                raise NeedsWait
            return self._hold(got[0], key, size)
        got = self._open(key, size, unread_if_sealed=True)
        return self._hold(got[0], key, size) if got is not None else None

    async def get(self, key: BlockKey, size: int) -> ExactFile | None:
        """``now``, verifying the file first when needed: the disk tier's verified read of all of it
        (a corrupt file is dropped there, and counted)."""
        if not self.enabled or not self.disk.contains(key):
            return None
        digest = key.digest()
        checked_here = digest not in self._verified
        if checked_here:
            got = self._open(key, size, unread_if_sealed=True)
            if got is None:
                return None
            if self._sealed(digest, got):
                return self._hold(got[0], key, size)
            os.close(got[0])
            if key.index != WHOLE:
                data = await self.disk.read_async(key, 0, size)
                if data is None or len(data) != size:
                    self.metrics.scrub_files.labels("corrupt" if not self.disk.contains(key) else "ok").inc()
                    return None
                self.metrics.scrub_files.labels("ok").inc()
                self._verified[digest] = time.monotonic()
        got = self._open(key, size)
        if got is None:
            return None
        if digest not in self._verified:
            # a whole-object file: checked chunk by chunk through the descriptor handed over (a
            # large one is never read into memory at once)
            if not await self._checked(digest, got[0], got[1]):
                os.close(got[0])
                return None
            self._verified[digest] = time.monotonic()
        if checked_here and self.seals is not None:
            self.seals.seal(digest, got[2])
        return self._hold(got[0], key, size)

    def _sealed(self, digest: str, got: tuple[int, fmt.BlockHeader | None, os.stat_result]) -> bool:
        """Whether the open file ``got`` (from ``_open``) is the one checked and sealed in this
        boot (disk/seals.py; no header read: ``_open`` matched the seal already): then it counts as
        verified, and is queued for the scrub."""
        if got[1] is not None and (self.seals is None or not self.seals.matches(digest, got[2])):
            return False
        # checked as it was written by this daemon: scrubbed in its turn; else at once
        self._verified[digest] = time.monotonic() - (SCRUB_AGE if self.seals.inherited(digest) else 0)
        self._sealed_files.inc()
        return True

    async def _checked(self, digest: str, fd: int, header: fmt.BlockHeader, rate: float | None = None) -> bool:
        """``_verify``; a corrupt (or unreadable) file is counted and dropped from the disk tier."""
        try:
            await self._verify(fd, header, rate)
            return True
        except (CorruptBlock, OSError) as exc:
            self._corrupt(digest, exc)
            return False

    def _corrupt(self, digest: str, exc: Exception) -> None:
        self._verified.pop(digest, None)
        if self.seals is not None:
            self.seals.forget(digest)
        self.metrics.scrub_files.labels("corrupt").inc()
        self.disk.drop_corrupt(digest, exc if isinstance(exc, CorruptBlock) else CorruptBlock(str(exc)))
        self.corrupted(digest)

    def release(self, exact: ExactFile) -> None:
        """The kernel no longer reads ``exact``: it may be evicted again."""
        digest = exact.key.digest()
        left = self._held.get(digest, 0) - 1
        if left > 0:
            self._held[digest] = left
        else:
            self._held.pop(digest, None)
            self.disk.release([digest])

    async def scrub(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Re-verify handed-over files forever, each at most once every SCRUB_AGE seconds, at most
        ``scrub_bytes_s`` bytes a second (paced as it reads); a corrupt one is counted and dropped
        from the disk tier (open files keep reading the bytes they had; new opens fetch it
        again). Small files are checked many to a worker-thread call (``_check_small``): a file at
        a time cost ~0.8 ms of the daemon's CPU per 110 KiB file in thread hand-offs and timers,
        12% of a core at 16 MB/s; a large one step by step (``_scrub_one``)."""
        task_status.started()
        buf = b""                       # the batches' reads (VERIFY_STEP bytes, made at the first)
        while True:
            await trio.sleep(1.0)
            due = time.monotonic() - SCRUB_AGE
            todo = [digest for digest, when in self._verified.items() if when <= due]
            if todo and not buf:
                buf = bytearray(fmt.VERIFY_STEP)
            at = 0
            while at < len(todo):
                results, spent = await in_thread(self._check_small, todo, at, buf, limiter=self._limiter)
                at += len(results)
                large = self._scrubbed(results)
                if large is not None:
                    await self._scrub_one(large)
                if spent:
                    await trio.sleep(spent / self.scrub_bytes_s)

    def _scrubbed(self, results: list) -> str | None:
        """What a batch of ``_check_small`` found, taken in: right files verified now, corrupt ones
        dropped. The file too large for a batch that ended it, if any (checked step by step)."""
        now, ok, large = time.monotonic(), 0, None
        for digest, outcome in results:
            if digest not in self._verified:            # evicted (or found corrupt) meanwhile
                continue
            if outcome is None:
                self._verified[digest] = now
                ok += 1
            elif outcome is GONE:
                self._verified.pop(digest, None)
            elif outcome is LARGE:
                large = digest
            elif isinstance(outcome, Exception):
                self._corrupt(digest, outcome)
        if ok:
            self._scrubbed_ok.inc(ok)
        return large

    def _check_small(self, digests: list[str], start: int, buf: bytearray) -> tuple[list, int]:
        """(In a worker thread) check whole exact files of ``digests`` from ``start`` on, in turn,
        until ``len(buf)`` bytes are read: each ``(digest, outcome)``, outcome None (right), GONE
        (no such file), SKIP (not an exact file), LARGE (larger than ``buf``: ends the batch) or
        the error (corrupt); and the bytes read. Reads only files, never the scrub's state."""
        results, spent = [], 0
        block_file = self.disk.layout.block_file
        for digest in itertools.islice(digests, start, None):
            if spent >= len(buf):
                break
            try:
                fd = os.open(block_file(digest), os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                results.append((digest, GONE))
                continue
            try:
                header = fmt.exact_header(fd)
                if header is None:
                    results.append((digest, SKIP))
                elif header.data_len > len(buf):
                    results.append((digest, LARGE))
                    break
                else:
                    size = os.fstat(fd).st_size
                    if size != header.data_len:
                        raise CorruptBlock(f"file has {size} bytes, header says {header.data_len}")
                    with memoryview(buf) as view:
                        fmt.verify_range(fd, header, 0, view[:size])
                    spent += size
                    results.append((digest, None))
            except (CorruptBlock, OSError) as exc:
                results.append((digest, exc))
            finally:
                os.close(fd)
        return results, spent

    async def _scrub_one(self, digest: str) -> None:
        path = self.disk.layout.block_file(digest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._verified.pop(digest, None)        # evicted meanwhile
            return
        try:
            header = fmt.exact_header(fd)
            if header is not None and await self._checked(digest, fd, header, self.scrub_bytes_s):
                self._verified[digest] = time.monotonic()
        except (CorruptBlock, OSError) as exc:      # the header itself
            self._corrupt(digest, exc)
        finally:
            os.close(fd)

    # -- plumbing --

    def _open(self, key: BlockKey, size: int, *, unread_if_sealed: bool = False
              ) -> tuple[int, fmt.BlockHeader | None, os.stat_result] | None:
        """The exact file of ``key`` if it holds ``size`` bytes; its header is left unread (None)
        when ``unread_if_sealed`` and its seal matches (checked whole, ``size`` bytes, as written)."""
        if not self.enabled:
            return None
        seals = self.seals if unread_if_sealed else None
        trusted = None if seals is None else (lambda st: st.st_size == size and seals.matches(key.digest(), st))
        got = self.disk.exact_file(key, trusted)
        if got is not None and got[1] is not None and got[1].data_len != size:
            os.close(got[0])
            return None
        return got

    async def _verify(self, fd: int, header: fmt.BlockHeader, rate: float | None = None) -> None:
        """Check every chunk of an exact file, a step of a few MiB per worker-thread call. At once
        (``rate`` None: a first hand-over waits for it), the kernel reading the whole file
        ahead; or paced at ``rate`` bytes a second (the scrub)."""
        size = os.fstat(fd).st_size
        if size != header.data_len:
            raise CorruptBlock(f"file has {size} bytes, header says {header.data_len}")
        if rate is None:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        buf = bytearray(min(fmt.verify_step(header), size))
        for first, length in fmt.verify_steps(header):
            if length < len(buf):
                buf = bytearray(length)
            await in_thread(fmt.verify_range, fd, header, first, buf, limiter=self._limiter)
            if rate:
                await trio.sleep(len(buf) / rate)
        self.metrics.scrub_files.labels("ok").inc()

    def _hold(self, fd: int, key: BlockKey, size: int) -> ExactFile:
        digest = key.digest()
        if digest not in self._held:
            self.disk.hold([digest])
        self._held[digest] = self._held.get(digest, 0) + 1
        return ExactFile(fd, key, size)
