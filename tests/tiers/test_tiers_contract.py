"""The contract of the one tier interface (``Tiers``, cachefs/tiers/cache.py) that the vfs, the warm
engine and status use: warm a file, check it per tier, evict it, hold and pin it, room and stats.
In-memory store (memory://, counted), a real disk tier in a temp dir, no kernel."""

import trio
from memory_stores import BS, blob, bucket_mem, make_cache  # noqa: F401  (fixture)

from cachefs.metrics import Metrics
from cachefs.tiers.cache import FileVersion, Tiers
from cachefs.tiers.disk import DiskTier

FILE_COST = BS + 4096          # a full block's file in the disk tier: data plus a 4 KiB header


def run_tiers(bucket, tmp_path, body, *, capacity: int = 64 << 20) -> None:
    async def main():
        metrics = Metrics()
        store = bucket.store()
        disk = DiskTier(tmp_path / "blocks", capacity=capacity, free_space_ratio=0.0, metrics=metrics,
                        fsync=False, chunk_size=4096)
        tiers = make_cache(store, metrics, disk)
        async with trio.open_nursery() as nursery:
            await nursery.start(tiers.run)               # runs the disk tier too
            await body(store, tiers)
            await tiers.wait_idle()
            nursery.cancel_scope.cancel()
    trio.run(main)


async def warm_file(tiers: Tiers, f: FileVersion) -> tuple[int, bool]:
    limiter = trio.CapacityLimiter(4)
    fetched, cached = 0, True
    for index in range(-(-f.size // BS)):
        got, ok = await tiers.warm(f, index, limiter)
        fetched, cached = fetched + got, cached and ok
    return fetched, cached


def where(tiers: Tiers, f: FileVersion) -> list[tuple[bool, bool]]:
    return [(block.memory, block.disk) for block in tiers.check(f)]


def test_warm_check_evict(bucket_mem, tmp_path):
    data = blob(1, 3 * BS + 5)
    bucket_mem.put("ds/a.bin", data)

    async def body(store, tiers):
        f = bucket_mem.version(store, "ds/a.bin")
        assert where(tiers, f) == [(False, False)] * 4
        assert [b.length for b in tiers.check(f)] == [BS, BS, BS, 5]
        assert await warm_file(tiers, f) == (len(data), True)
        assert where(tiers, f) == [(False, True)] * 4            # a warm goes to the disk tier only
        assert [b.cost for b in tiers.check(f)] == [FILE_COST] * 3 + [4096 + 5]
        assert await warm_file(tiers, f) == (0, True)            # a second warm fetches nothing
        gets = len(store.gets)
        assert await tiers.read(f, 0, len(data)) == data
        assert len(store.gets) == gets                           # served by the disk tier
        assert tiers.evict(f) == (4, len(data))
        assert where(tiers, f) == [(False, False)] * 4
        assert tiers.evict(f) == (0, 0)
        assert await tiers.read(f, BS, 10) == data[BS:BS + 10]  # fetched again after the eviction
        assert len(store.gets) == gets + 1

    run_tiers(bucket_mem, tmp_path, body)


def test_check_reports_the_memory_tier_and_evict_drops_it_there_too(bucket_mem, tmp_path):
    data = blob(2, 2 * BS)
    bucket_mem.put("ds/b.bin", data)

    async def body(store, tiers):
        f = bucket_mem.version(store, "ds/b.bin")
        assert await tiers.read(f, 0, 100) == data[:100]        # part of block 0: kept in memory too
        await tiers.wait_idle()
        assert where(tiers, f) == [(True, True), (False, False)]
        assert tiers.stats()["memory"]["blocks"] == 1 and tiers.stats()["disk"]["blocks"] == 1
        assert tiers.evict(f) == (1, BS)
        assert where(tiers, f) == [(False, False), (False, False)]
        assert tiers.stats()["memory"]["blocks"] == 0

    run_tiers(bucket_mem, tmp_path, body)


def test_evict_range_drops_exactly_the_blocks_holding_the_range(bucket_mem, tmp_path):
    """A packed record that failed its check: the blocks holding it leave both tiers, the others
    stay, and the next read fetches them again."""
    data = blob(3, 4 * BS)
    bucket_mem.put("ds/shard.bin", data)

    async def body(store, tiers):
        f = bucket_mem.version(store, "ds/shard.bin")
        assert await warm_file(tiers, f) == (len(data), True)
        assert await tiers.read(f, BS + 10, 10) == data[BS + 10:BS + 20]      # block 1 in memory too
        tiers.evict_range(f, BS + 5, BS)                         # the bytes straddle blocks 1 and 2
        assert where(tiers, f) == [(False, True), (False, False), (False, False), (False, True)]
        tiers.evict_range(f, 0, 0)                               # an empty record: its one block
        assert where(tiers, f)[0] == (False, False)
        gets = len(store.gets)
        assert await tiers.read(f, BS, 2 * BS) == data[BS:3 * BS]
        assert len(store.gets) == gets + 2

    run_tiers(bucket_mem, tmp_path, body)


def test_a_shared_stream_reads_ahead_of_whichever_reader_read_last(bucket_mem, tmp_path):
    """``blocks_ahead`` / ``continue_stream``: the entry a packed shard's readers share."""
    from cachefs.tiers.cache import Stream
    bucket_mem.put("ds/s.bin", blob(4, 8 * BS))

    async def body(store, tiers):
        f = bucket_mem.version(store, "ds/s.bin")
        stream = Stream(drop_behind=False)
        assert tiers.blocks_ahead(stream, f, 100) == range(0, 2)                 # a block's bytes at first
        stream.window = BS
        assert tiers.blocks_ahead(stream, f, BS) == range(1, 3)                  # the window doubles
        stream.window = 64 * BS
        assert tiers.blocks_ahead(stream, f, 6 * BS) == range(6, 8)              # never past the end
        tiers.continue_stream(stream, 3 * BS)
        assert stream.advance(3 * BS, 4 * BS, BS, tiers.readahead_size) > 0      # read there: continued

    run_tiers(bucket_mem, tmp_path, body)


def test_room_shrinks_as_a_held_dataset_fills_and_comes_back_on_release(bucket_mem, tmp_path):
    for i in range(3):
        bucket_mem.put(f"ds/f{i}.bin", blob(10 + i, BS))
    capacity = 10 * FILE_COST

    async def body(store, tiers):
        files = [bucket_mem.version(store, f"ds/f{i}.bin") for i in range(3)]
        held: set[str] = set()
        room = tiers.room()
        assert (room["capacity"], room["held"], room["room"]) == (capacity, 0, capacity)
        for n, f in enumerate(files, 1):
            tiers.hold(f, held)
            tiers.hold(f, held)                                  # counted once per held set
            assert await warm_file(tiers, f) == (BS, True)
            assert tiers.room()["room"] == capacity - n * FILE_COST
            assert tiers.stats()["disk"]["used_bytes"] == n * FILE_COST
        tiers.release(held)
        assert tiers.room()["room"] == capacity and tiers.stats()["disk"]["held_bytes"] == 0

    run_tiers(bucket_mem, tmp_path, body, capacity=capacity)


def test_a_pin_survives_an_eviction_pass_until_unpinned(bucket_mem, tmp_path):
    for i in range(2):
        bucket_mem.put(f"ds/f{i}.bin", blob(20 + i, BS))
    for i in range(8):
        bucket_mem.put(f"other/f{i}.bin", blob(30 + i, BS))
    capacity = 5 * FILE_COST

    async def body(store, tiers):
        pinned = [bucket_mem.version(store, f"ds/f{i}.bin") for i in range(2)]
        held: set[str] = set()
        for f in pinned:
            tiers.hold(f, held)
            assert await warm_file(tiers, f) == (BS, True)
        tiers.pin("ds", held)
        tiers.release(held)                                      # the pin holds them now
        assert tiers.pinned() == {"ds": 2}
        others = [bucket_mem.version(store, f"other/f{i}.bin") for i in range(8)]
        for f in others:                                         # 8 more blocks through a 5-block cache
            assert await tiers.read(f, 0, BS) == blob(30 + others.index(f), BS)
            await tiers.wait_idle()
        assert all(disk for f in pinned for _, disk in where(tiers, f))
        assert sum(disk for f in others for _, disk in where(tiers, f)) == 3
        assert tiers.stats()["disk"]["used_bytes"] <= capacity
        assert tiers.unpin("ds") and not tiers.unpin("ds")
        assert tiers.pinned() == {} and tiers.room()["held"] == 0

    run_tiers(bucket_mem, tmp_path, body, capacity=capacity)
