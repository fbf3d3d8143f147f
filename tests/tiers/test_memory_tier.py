from cachefs.metrics import Metrics
from cachefs.tiers.key import BlockKey
from cachefs.tiers.memory import MemoryTier


def key(i: int) -> BlockKey:
    return BlockKey("mem://", "obj", "etag", 100, i)


def sample(m: Metrics, name: str) -> float:
    return m.counter_value(name, tier="memory")


def test_get_put_counts_hits_and_misses():
    m = Metrics()
    tier = MemoryTier(1000, m)
    assert tier.get(key(0)) is None
    tier.put(key(0), b"x" * 100)
    assert tier.get(key(0)) == b"x" * 100
    assert sample(m, "cachefs_tier_misses_total") == 1
    assert sample(m, "cachefs_tier_hits_total") == 1
    assert sample(m, "cachefs_tier_hit_bytes_total") == 100
    assert sample(m, "cachefs_tier_used_bytes") == 100
    assert sample(m, "cachefs_tier_capacity_bytes") == 1000


def test_capacity_in_bytes_evicts_least_recently_used():
    m = Metrics()
    tier = MemoryTier(300, m)
    for i in range(3):
        tier.put(key(i), bytes([i]) * 100)
    tier.get(key(0))                       # 1 is now the least recently used
    tier.put(key(3), b"z" * 150)
    assert tier.used <= tier.capacity
    assert tier.get(key(1)) is None and tier.get(key(2)) is None
    assert tier.get(key(0)) == bytes([0]) * 100 and tier.get(key(3)) == b"z" * 150
    assert len(tier) == 2 and tier.used == 250
    assert sample(m, "cachefs_evictions_total") == 2
    assert sample(m, "cachefs_evicted_bytes_total") == 200


def test_used_never_exceeds_capacity():
    tier = MemoryTier(1000, Metrics())
    for i in range(200):
        tier.put(key(i % 37), b"a" * (i * 7 % 400))
        assert tier.used <= tier.capacity
        assert tier.used == sum(len(tier._blocks[k]) for k in tier._blocks)


def test_block_larger_than_capacity_is_not_stored_and_evicts_nothing():
    tier = MemoryTier(100, Metrics())
    tier.put(key(0), b"a" * 50)
    tier.put(key(1), b"b" * 101)
    assert tier.get(key(1)) is None
    assert tier.get(key(0)) == b"a" * 50


def test_replace_and_discard_adjust_used():
    m = Metrics()
    tier = MemoryTier(1000, m)
    tier.put(key(0), b"a" * 100)
    tier.put(key(0), b"b" * 40)
    assert tier.used == 40 and len(tier) == 1
    tier.discard(key(0))
    tier.discard(key(1))
    assert tier.used == 0 and len(tier) == 0 and tier.get(key(0)) is None
    assert sample(m, "cachefs_tier_blocks") == 0


def test_readahead_blocks_evicted_unread_count_as_wasted():
    m = Metrics()
    tier = MemoryTier(300, m)
    tier.put(key(0), b"a" * 100, ahead=True)       # read later: not wasted
    tier.put(key(1), b"b" * 100, ahead=True)       # joined in flight by a reader: not wasted
    tier.put(key(2), b"c" * 100, ahead=True)       # never read: wasted
    assert tier.get(key(0)) == b"a" * 100
    tier.read_ahead(key(1))
    tier.put(key(3), b"d" * 100)                   # evicts key(1) (LRU after key(0) was read)
    tier.put(key(4), b"e" * 100)                   # evicts key(2)
    assert m.counter_value("cachefs_readahead_wasted_bytes_total") == 100
    tier.put(key(5), b"f" * 100, ahead=True)
    tier.discard(key(5))                           # dropped on purpose (a newer version): not counted
    tier.put(key(6), b"g" * 100)
    tier.put(key(7), b"h" * 100)
    tier.put(key(8), b"i" * 100)
    assert m.counter_value("cachefs_readahead_wasted_bytes_total") == 100
