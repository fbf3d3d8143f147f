"""The memory tier: whole blocks in an LRU bounded in bytes (docs/design.md, invariant 3).

Plain synchronous code: only the trio thread touches it (invariant 6).
"""

from collections import OrderedDict

from cachefs.metrics import Metrics
from cachefs.tiers.key import BlockKey
from cachefs.tiers.metrics import TierMetrics

_TIER = "memory"


class MemoryTier:
    """Blocks by key, least recently used evicted first; ``used`` never exceeds ``capacity``."""

    def __init__(self, capacity_bytes: int, metrics: Metrics) -> None:
        self.capacity = capacity_bytes
        self.used = 0
        self._blocks: OrderedDict[BlockKey, bytes] = OrderedDict()
        self._ahead: set[BlockKey] = set()      # fetched by readahead, not read yet
        m = metrics.group(TierMetrics)
        self._wasted = m.readahead_wasted_bytes
        # metric children bound once, as the disk tier does: get() runs on every read
        self._hits = m.tier_hits.labels(_TIER)
        self._misses = m.tier_misses.labels(_TIER)
        self._hit_bytes = m.tier_hit_bytes.labels(_TIER)
        self._evictions = m.evictions.labels(_TIER)
        self._evicted_bytes = m.evicted_bytes.labels(_TIER)
        self._used_gauge = m.tier_used_bytes.labels(_TIER)
        self._blocks_gauge = m.tier_blocks.labels(_TIER)
        m.tier_capacity_bytes.labels(_TIER).set(capacity_bytes)
        self._update_gauges()

    def __len__(self) -> int:
        return len(self._blocks)

    def contains(self, key: BlockKey) -> bool:
        return key in self._blocks

    def get(self, key: BlockKey) -> bytes | None:
        data = self._blocks.get(key)
        if data is None:
            self._misses.inc()
            return None
        self._blocks.move_to_end(key)
        if self._ahead:
            self._ahead.discard(key)
        self._hits.inc()
        self._hit_bytes.inc(len(data))
        return data

    def put(self, key: BlockKey, data: bytes, *, ahead: bool = False) -> None:
        """Store ``data``, evicting the least recently used blocks to make room; ``ahead``: a
        readahead's block, counted as wasted if it is evicted before any read.

        A block larger than the whole capacity is not stored (and evicts nothing).
        """
        self._remove(key)
        if len(data) > self.capacity:
            self._update_gauges()
            return
        while self.used + len(data) > self.capacity:
            victim_key, victim = self._blocks.popitem(last=False)
            self.used -= len(victim)
            self._evictions.inc()
            self._evicted_bytes.inc(len(victim))
            if victim_key in self._ahead:
                self._ahead.discard(victim_key)
                self._wasted.inc(len(victim))
        self._blocks[key] = data
        if ahead:
            self._ahead.add(key)
        self.used += len(data)
        self._update_gauges()

    def discard(self, key: BlockKey) -> None:
        self._remove(key)
        self._update_gauges()

    def read_ahead(self, key: BlockKey) -> None:
        """A reader got ``key`` another way (it joined the readahead's GET): not wasted."""
        self._ahead.discard(key)

    def _remove(self, key: BlockKey) -> None:
        old = self._blocks.pop(key, None)
        if old is not None:
            self.used -= len(old)
            self._ahead.discard(key)

    def _update_gauges(self) -> None:
        self._used_gauge.set(self.used)
        self._blocks_gauge.set(len(self._blocks))
