"""The disk tier's space: capacity, the free-space watermark, reservations and eviction (invariant 3).

Plain synchronous code owned by the trio thread. ``Space`` only counts and chooses victims;
the tier unlinks their files (in worker threads) and tells ``Space`` when they are gone.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cachefs.tiers.disk.index import SegmentedLRU


@dataclass(slots=True)
class Room:
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


class Space:
    """At most ``capacity`` bytes of block files, and ``free_space_ratio`` of the filesystem free.

    ``used`` (index bytes + ``reserved``: files being written or waiting to be unlinked) is an
    upper bound of the bytes on disk at every instant. ``evict(digest)`` takes a victim out of
    the index and returns its size; ``statvfs`` is a seam for tests.
    """

    def __init__(self, index: SegmentedLRU, root: Path, *, capacity: int, free_space_ratio: float,
                 evict: Callable[[str], int]) -> None:
        self.index = index
        self.root = root
        self.capacity = capacity
        self._free_ratio = free_space_ratio
        self._evict = evict
        self.reserved = 0                         # bytes being written or waiting to be unlinked
        self._growing = 0                         # bytes running fills will add to the filesystem
        self._fs_free = 0                         # statvfs snapshot (bytes available, total)
        self._fs_total = 0
        self._fs_checked = -math.inf
        self._fs_delta = 0                        # our writes/evictions since the snapshot
        self.fs_ttl = 1.0
        self.statvfs = os.statvfs

    @property
    def used(self) -> int:
        return self.index.bytes + self.reserved

    def reserve(self, size: int) -> Room | None:
        """Make room for a file of ``size`` bytes by evicting; None if room cannot be made.

        The evicted files stay on disk until the fill's thread unlinks them (just before it
        writes), so the fill holds ``max(size, freed)`` bytes of the capacity until it is done:
        the bytes on disk never exceed the index bytes plus ``reserved``, which never exceed
        ``capacity``. For the free-space estimate the fill takes ``grow`` bytes at most.
        Raises OSError when the filesystem cannot be asked.
        """
        free, want = self.fs_room()
        evictable = self.index.bytes - self.index.held_bytes
        if (self.index.held_bytes + self.reserved + size > self.capacity
                or free + evictable - size < want):
            return None
        room = Room(size)
        while (self.index.bytes + self.reserved + size > self.capacity
               or free + room.freed - size < want):
            digest = self.index.victim()
            room.freed += self._evict(digest)
            room.doomed.append(digest)
        self.reserved += room.hold
        self._growing += room.grow
        self._fs_delta -= room.grow
        return room

    def release(self, room: Room, written: bool) -> None:
        """Return a reservation once its thread is done (evicted files unlinked by then)."""
        self.reserved -= room.hold
        self._growing -= room.grow
        self._fs_delta += room.grow + room.freed - (room.size if written else 0)

    def unlink_started(self, size: int) -> None:
        """A file left the index; its bytes count until ``unlink_done``."""
        self.reserved += size

    def unlink_done(self, size: int) -> None:
        self.reserved -= size
        self._fs_delta += size

    def disk_full(self) -> None:
        """A write hit ENOSPC: ask the filesystem again before the next fill."""
        self._fs_checked = -math.inf

    def fs_room(self) -> tuple[int, float]:
        """(bytes free now, by our estimate; bytes that must stay free)."""
        now = time.monotonic()
        if now - self._fs_checked >= self.fs_ttl:
            st = self.statvfs(self.root)
            self._fs_free, self._fs_total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
            self._fs_checked = now
            self._fs_delta = -self._growing
        return self._fs_free + self._fs_delta, self._free_ratio * self._fs_total

    def over_capacity(self) -> Iterator[tuple[str, int]]:
        """Evict (digest, size) victims until the index fits the capacity; pinned bytes stay."""
        while self.index.bytes > self.capacity:
            digest = self.index.victim()
            if digest is None:             # the rest is pinned: over capacity until unpinned
                return
            yield digest, self._evict(digest)

    def room(self) -> dict:
        """What a warmup may fill: capacity minus held (pinned or warming) bytes, and the free
        bytes of the cache filesystem above the ``free_space_ratio`` watermark."""
        free, want = self.fs_room()
        held = self.index.held_bytes
        return {"capacity": self.capacity, "used": self.used, "held": held,
                "room": max(0, min(self.capacity - held - self.reserved,
                                   int(free - want) + self.index.bytes - held))}
