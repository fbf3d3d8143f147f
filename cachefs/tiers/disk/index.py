"""The disk tier's index and layout: which block files exist, where they live, which to evict.

Layout under the tier's ``root``::

    blocks/<digest[:2]>/<digest>     one file per block, in the format of ``format.BlockHeader``
    tmp/<digest>.<random>.tmp        fills being written; whatever is left here at start is removed

The index is a scan-resistant segmented LRU of block files, with held entries. Plain
synchronous code owned by the trio thread (docs/design.md, invariant 6). Keys are block digests.
``prepare_root`` (blocking, a worker thread at start) lists what a rebuild indexes.
"""

from __future__ import annotations

import errno
import os
import re
from collections import OrderedDict
from pathlib import Path

from cachefs.tiers.disk import health

_DIGEST_NAME = re.compile(r"[0-9a-f]{40}")


class Layout:
    """The paths of one tier's files (the one place they are derived)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.blocks = self.root / "blocks"
        self.tmp = self.root / "tmp"
        self._blocks_str = str(self.blocks)

    def block_path(self, digest: str) -> Path:
        return self.blocks / digest[:2] / digest

    def block_file(self, digest: str) -> str:
        """``block_path`` as a string, cheaply (the read path builds one per cold open)."""
        return f"{self._blocks_str}/{digest[:2]}/{digest}"


class Entry:
    __slots__ = ("length", "size")

    def __init__(self, size: int, length: int | None) -> None:
        self.size = size          # file size, header included: what counts against capacity
        self.length = length      # data length; None until the header was read (after a rebuild)


class SegmentedLRU:
    """Scan-resistant index (SLRU). New entries enter probation; a hit there promotes the
    entry to protected, which holds at most ``protected_cap`` bytes (its LRU entries are demoted
    back to the probation MRU end). Victims come from probation first, so a one-pass scan
    (every block filled once, never hit) only churns probation.

    A *held* digest (``hold`` counted once per holder: a running warmup, each pin) sits in a
    third segment that ``victim`` never returns; a hold may precede the entry (it is placed
    there when added) and outlive it."""

    def __init__(self, protected_cap: int) -> None:
        self.protected_cap = protected_cap
        self.bytes = 0
        self.protected_bytes = 0
        self.held_bytes = 0
        self._probation: OrderedDict[str, Entry] = OrderedDict()
        self._protected: OrderedDict[str, Entry] = OrderedDict()
        self._held: dict[str, Entry] = {}
        self._holds: dict[str, int] = {}
        self._demoted: set[str] = set()           # held entries demoted: to the cold end on release

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected) + len(self._held)

    def __contains__(self, digest: str) -> bool:
        return digest in self._probation or digest in self._protected or digest in self._held

    def get(self, digest: str) -> Entry | None:
        return self._protected.get(digest) or self._probation.get(digest) or self._held.get(digest)

    def add(self, digest: str, entry: Entry) -> None:
        if digest in self._holds:
            self._held[digest] = entry
            self.held_bytes += entry.size
        else:
            self._probation[digest] = entry
        self.bytes += entry.size

    def touch(self, digest: str) -> None:
        if digest in self._protected:
            self._protected.move_to_end(digest)
            return
        if digest in self._held:
            return
        entry = self._probation.pop(digest)
        self._protected[digest] = entry
        self.protected_bytes += entry.size
        while self.protected_bytes > self.protected_cap and len(self._protected) > 1:
            old, demoted = self._protected.popitem(last=False)
            self.protected_bytes -= demoted.size
            self._probation[old] = demoted

    def demote(self, digest: str) -> None:
        """Move an entry to the cold end of probation: the next victim (a held one goes there
        when its last hold is released)."""
        entry = self._protected.pop(digest, None)
        if entry is not None:
            self.protected_bytes -= entry.size
            self._probation[digest] = entry
        if digest in self._probation:
            self._probation.move_to_end(digest, last=False)
        elif digest in self._held:
            self._demoted.add(digest)             # on release

    def remove(self, digest: str) -> Entry | None:
        self._demoted.discard(digest)
        entry = self._probation.pop(digest, None)
        if entry is None:
            entry = self._protected.pop(digest, None)
            if entry is not None:
                self.protected_bytes -= entry.size
            else:
                entry = self._held.pop(digest, None)
                if entry is None:
                    return None
                self.held_bytes -= entry.size
        self.bytes -= entry.size
        return entry

    def victim(self) -> str | None:
        segment = self._probation or self._protected
        return next(iter(segment), None)

    def hold(self, digest: str) -> None:
        """Keep ``digest`` from eviction until as many ``release`` calls as ``hold`` calls."""
        self._holds[digest] = self._holds.get(digest, 0) + 1
        if self._holds[digest] == 1:
            entry = self._probation.pop(digest, None)
            if entry is None:
                entry = self._protected.pop(digest, None)
                if entry is not None:
                    self.protected_bytes -= entry.size
            if entry is not None:
                self._held[digest] = entry
                self.held_bytes += entry.size

    def release(self, digest: str) -> None:
        count = self._holds.get(digest, 0) - 1
        if count > 0:
            self._holds[digest] = count
            return
        self._holds.pop(digest, None)
        entry = self._held.pop(digest, None)
        if entry is not None:
            self.held_bytes -= entry.size
            self._probation[digest] = entry
            if digest in self._demoted:
                self._demoted.discard(digest)
                self._probation.move_to_end(digest, last=False)

    def is_held(self, digest: str) -> bool:
        return digest in self._holds


def prepare_root(root: Path, fsync: bool) -> tuple[int, list[tuple[int, str, int]]]:
    """Create the layout, prove it writable, remove stale temp files and list the blocks
    as (mtime_ns, digest, size), oldest first. Stat only: blocks are verified on read. A full
    filesystem passes the proof (ENOSPC is no fault of the disk: fills evict to make room)."""
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
    try:
        health.probe_dir_writable(tmp, fsync)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
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
