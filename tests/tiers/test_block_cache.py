"""The read path without a kernel (docs/design.md, tests: layer 3): Tiers over MemoryTier and DiskTier,
driven inside ``trio.run`` over an in-memory store whose calls are counted, failed or held."""

import random
import threading

import pytest
import trio
import trio.testing
from memory_stores import BS, blob, bucket_mem, count, make_cache, make_disk, serving, until  # noqa: F401  (fixture)

from cachefs.errors import Unreachable, VersionChanged
from cachefs.metrics import Metrics
from cachefs.tiers.cache import Stream
from cachefs.tiers.key import BlockKey, Keys

# --- single flight ------------------------------------------------------------------------------

def test_concurrent_misses_of_one_block_share_one_get(bucket_mem):
    data, store, f = bucket_mem.one_file(blob(1, 2 * BS))
    cache = make_cache(store, Metrics())
    got = []

    async def reader(i):
        got.append(await cache.read(f, i * 10, BS - i * 10))

    async def main():
        gate = store.hold("get")
        try:
            async with trio.open_nursery() as nursery:
                for i in range(10):
                    nursery.start_soon(reader, i)
                await gate.wait_reached()
                await trio.testing.wait_all_tasks_blocked()
                gate.open()
        finally:
            gate.open()
    trio.run(main)
    assert store.calls["get"] == 1
    assert sorted(got, key=len, reverse=True) == [data[i * 10:BS] for i in range(10)]
    assert cache._flights.joins == 9


def test_singleflight_joins_are_exported_as_a_metric(bucket_mem):
    _, store, f = bucket_mem.one_file(blob(1, BS))
    metrics = Metrics()
    cache = make_cache(store, metrics)

    async def main():
        gate = store.hold("get")
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(cache.read, f, 0, BS)
            await gate.wait_reached()
            await trio.testing.wait_all_tasks_blocked()
            gate.open()
    trio.run(main)
    assert count(metrics, "singleflight_joins") == 3


def test_a_failing_leader_fails_every_follower_and_a_later_read_retries(bucket_mem):
    data, store, f = bucket_mem.one_file(blob(2, BS))
    cache = make_cache(store, Metrics())
    errors = []

    async def reader():
        try:
            await cache.read(f, 0, BS)
        except Unreachable as exc:
            errors.append(exc)

    async def main():
        store.failures["get"] = Unreachable("store down")
        gate = store.hold("get")
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(10):
                    nursery.start_soon(reader)
                await gate.wait_reached()
                await trio.testing.wait_all_tasks_blocked()
                gate.open()
        finally:
            gate.open()
        assert len(errors) == 10 and store.calls["get"] == 1
        assert not cache.is_cached(cache.key(f, 0))        # a failed fetch caches nothing
        store.failures.clear()
        assert await cache.read(f, 0, BS) == data
        assert store.calls["get"] == 2
    trio.run(main)


def test_a_lookup_readahead_is_in_flight_at_once_and_the_open_joins_it(bucket_mem):
    """The open right after a lookup joins the lookup's GET even when the readahead's task has
    not run yet: the flight exists when ``readahead_file`` returns (before, an open whose own GET
    ended first left the readahead to fetch the file a second time)."""
    data, store, f = bucket_mem.one_file(blob(4, BS // 2))
    metrics = Metrics()
    cache = make_cache(store, metrics, readahead_at_lookup=True)

    async def scenario():
        async with serving(cache):
            gate = store.hold("get")
            try:
                cache.readahead_file(f)
                assert cache._flights.in_flight(cache.key(f, 0))      # no checkpoint in between
                assert store.started == [("f", 0, f.size)]             # the store may send the GET now
                cache.readahead_file(f)                                # a second lookup: nothing new
                assert store.started == [("f", 0, f.size)]
                results = []

                async def opener():
                    results.append(await cache.preload(f))
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(opener)
                    await gate.wait_reached()
                    await trio.testing.wait_all_tasks_blocked()
                    gate.open()
            finally:
                gate.open()
            assert results == [data]
            assert not cache._flights.in_flight(cache.key(f, 0))
    trio.run(scenario)
    assert store.calls["get"] == 1
    assert count(metrics, "lookup_readaheads") == 1
    assert count(metrics, "singleflight_joins") == 1


def test_a_failed_lookup_readahead_fails_its_joiners_once_and_the_read_retries(bucket_mem):
    data, store, f = bucket_mem.one_file(blob(5, BS // 2))
    metrics = Metrics()
    cache = make_cache(store, metrics, readahead_at_lookup=True)

    async def scenario():
        async with serving(cache):
            store.failures["get"] = Unreachable("store down")
            cache.readahead_file(f)
            assert await cache.preload(f) is None          # joined the failed GET: the read will retry
            assert store.calls["get"] == 1
            assert not cache._flights.in_flight(cache.key(f, 0))
            store.failures.clear()
            assert await cache.read(f, 0, f.size) == data
            assert store.calls["get"] == 2
    trio.run(scenario)


@pytest.mark.allow_warnings
def test_an_unexpected_error_in_a_lookup_readahead_is_logged_and_stops_nothing(bucket_mem, caplog):
    data, store, f = bucket_mem.one_file(blob(6, BS // 2))
    metrics = Metrics()
    cache = make_cache(store, metrics, readahead_at_lookup=True)

    async def scenario():
        async with serving(cache):
            store.failures["get"] = ValueError("a bug")
            cache.readahead_file(f)
            await until(lambda: not cache._flights.in_flight(cache.key(f, 0)))   # failed, no one joined
            assert store.calls["get"] == 1
            store.failures.clear()
            assert await cache.read(f, 0, f.size) == data     # the tiers' tasks still serve
    with caplog.at_level("ERROR", logger="cachefs"):
        trio.run(scenario)
    assert any("fetching f at its lookup failed" in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_started_call_cancelled_before_it_ends_hands_the_lead_to_a_joiner():
    from cachefs.singleflight import SingleFlight
    flights = SingleFlight()
    calls = []

    async def slow():
        calls.append("slow")
        await trio.sleep_forever()

    async def fast():
        calls.append("fast")
        return b"x"

    async def scenario():
        async with trio.open_nursery() as outer:
            inner_scope = trio.CancelScope()

            async def host(task_status=trio.TASK_STATUS_IGNORED):
                with inner_scope:
                    async with trio.open_nursery() as nursery:
                        assert flights.start_soon(nursery, "k", slow)
                        assert not flights.start_soon(nursery, "k", fast)   # in flight: not started twice
                        task_status.started()
                        await trio.sleep_forever()
            await outer.start(host)
            results = []

            async def joiner():
                results.append(await flights.do("k", fast))
            outer.start_soon(joiner)
            await trio.testing.wait_all_tasks_blocked()
            assert results == [] and flights.joins == 1
            inner_scope.cancel()          # the started call is cancelled: the joiner leads anew
            await trio.testing.wait_all_tasks_blocked()
            assert results == [b"x"]
    trio.run(scenario)
    assert calls == ["slow", "fast"]
    assert not flights.in_flight("k")


# --- the tiers ----------------------------------------------------------------------------------

def test_read_spanning_three_blocks_then_memory_then_disk_tier(bucket_mem, tmp_path):
    data, store, f = bucket_mem.one_file(blob(3, 3 * BS))
    metrics = Metrics()
    disk = make_disk(tmp_path / "disk", metrics)

    async def main():
        async with serving(disk):
            cache = make_cache(store, metrics, disk)
            assert await cache.read(f, BS // 2, 2 * BS) == data[BS // 2:BS // 2 + 2 * BS]
            assert store.gets == [("f", 0, BS), ("f", BS, 2 * BS), ("f", 2 * BS, 3 * BS)]
            await disk.wait_idle()
            # blocks 0 and 2 were read in part: kept in memory; block 1 was read whole by one
            # request: the kernel's page cache has it, so memory keeps no second copy
            assert [cache.memory.contains(cache.key(f, i)) for i in range(3)] == [True, False, True]
            assert await cache.read(f, 10, 100) == data[10:110]
            assert await cache.read(f, 2 * BS + 10, 100) == data[2 * BS + 10:2 * BS + 110]
            assert count(metrics, "tier_hits", tier="memory") == 2
            assert await cache.read(f, BS, BS) == data[BS:2 * BS]
            assert count(metrics, "tier_hits", tier="disk") == 1
            assert store.calls["get"] == 3
            fresh = make_cache(store, metrics, disk)          # a new memory tier, the same disk tier
            assert await fresh.read(f, 0, 3 * BS) == data
            assert store.calls["get"] == 3
            assert count(metrics, "tier_hits", tier="disk") == 4
    trio.run(main)


def test_every_block_from_the_store_is_shown_to_the_fetched_port_and_memory_parts_are_views(bucket_mem, tmp_path):
    """The ``fetched`` port sees each block a GET brings (a read's, a warm's), once, at its offset:
    the packed view checks its records there. A part of a memory-tier block is a view of it."""
    data, store, f = bucket_mem.one_file(blob(5, 3 * BS))
    metrics = Metrics()
    disk = make_disk(tmp_path / "disk", metrics)
    seen = []

    async def main():
        async with serving(disk):
            cache = make_cache(store, metrics, disk)
            cache.fetched.connect(lambda fv, offset, got: seen.append((fv, offset, bytes(got))))
            assert await cache.read(f, 10, 100) == data[10:110]
            assert await cache.warm(f, 2, trio.CapacityLimiter(1)) == (BS, True)
            part = await cache.read(f, 20, 30)                           # a memory hit: no GET
            assert part == data[20:50] and isinstance(part, memoryview)
            assert seen == [(f, 0, data[:BS]), (f, 2 * BS, data[2 * BS:])]
            assert store.calls["get"] == 2
    trio.run(main)


def test_reads_clip_at_the_end_of_the_object(bucket_mem):
    data, store, f = bucket_mem.one_file(blob(4, 2 * BS + 100))
    cache = make_cache(store, Metrics())

    async def main():
        assert await cache.read(f, len(data), 10) == b""
        assert await cache.read(f, len(data) + 5, 10) == b""
        assert store.calls["get"] == 0
        assert await cache.read(f, len(data) - 50, 1000) == data[-50:]
        assert store.gets == [("f", 2 * BS, len(data))]
    trio.run(main)


def test_block_key_pins_the_version(bucket_mem):
    old, new = blob(5, 2 * BS), blob(6, 2 * BS + 1)
    bucket_mem.put("f", old)
    store = bucket_mem.store()
    f_old = bucket_mem.version(store, "f")
    cache = make_cache(store, Metrics())

    async def main():
        assert await cache.read(f_old, 0, 100) == old[:100]
        bucket_mem.put("f", new)
        f_new = bucket_mem.version(store, "f")
        assert f_new.etag != f_old.etag
        assert await cache.read(f_old, 50, 100) == old[50:150]  # cached block of the pinned version
        with pytest.raises(VersionChanged):
            await cache.read(f_old, BS, 100)                     # uncached: never the new bytes
        assert not cache.is_cached(cache.key(f_old, 1))
        assert await cache.read(f_new, 0, 100) == new[:100]      # not served from the old block
        assert store.calls["get"] == 3
    trio.run(main)


def test_keys_are_made_once_while_recent_and_stay_what_a_new_key_would_be():
    keys = Keys("s3://b/p", BS, limit=4)
    a = keys.get("f", "e1", 0)
    assert keys.get("f", "e1", 0) is a and a == BlockKey("s3://b/p", "f", "e1", BS, 0)
    assert a.digest() == BlockKey("s3://b/p", "f", "e1", BS, 0).digest()
    others = [keys.get("f", "e2", 0), keys.get("f", "e1", 1), keys.get("g", "e1", 0)]
    assert len({a, *others}) == 4 and len({k.digest() for k in (a, *others)}) == 4
    fifth = keys.get("h", "e1", 0)                    # past the limit: the memo starts again
    assert keys.get("f", "e1", 0) is not a and keys.get("f", "e1", 0) == a and fifth == keys.get("h", "e1", 0)


# --- readahead ----------------------------------------------------------------------------------

def test_sequential_reads_trigger_readahead(bucket_mem):
    data, store, f = bucket_mem.one_file(blob(7, 3 * BS))
    metrics = Metrics()
    cache = make_cache(store, metrics)
    stream = Stream()

    async def main():
        async with serving(cache):
            assert await cache.read(f, 0, BS, stream) == data[:BS]
            assert await cache.read(f, BS, BS, stream) == data[BS:2 * BS]
            await until(lambda: count(metrics, "readahead_blocks") == 1)
            assert store.calls["get"] == 3                       # block 2 was read ahead
            assert await cache.read(f, 2 * BS, BS, stream) == data[2 * BS:]
            await trio.testing.wait_all_tasks_blocked()
            assert store.calls["get"] == 3                       # ... and served with no new get
    trio.run(main)
    assert metrics.counter_value("cachefs_readahead_window_bytes_count") == 2     # each sequential read
    assert metrics.counter_value("cachefs_readahead_window_bytes_sum") == BS + 2 * BS   # a doubling window
    assert metrics.counter_value("cachefs_readahead_wasted_bytes_total") == 0


def _read_in_quarters(cache, f, stream):
    """Read ``f`` from start to end in quarter-block reads (as a reader's 1 MiB reads of 4 MiB
    blocks); after each read, which of its blocks the memory tier holds."""
    async def run():
        held, out = [], []
        for offset in range(0, f.size, BS // 4):
            out.append(bytes(await cache.read(f, offset, BS // 4, stream)))
            held.append([i for i in range(cache.block_count(f)) if cache.memory.contains(cache.key(f, i))])
        return b"".join(out), held
    return run()


def test_a_sequential_reader_lets_go_of_the_blocks_it_has_read(bucket_mem, tmp_path):
    data, store, f = bucket_mem.one_file(blob(17, 6 * BS))
    metrics = Metrics()
    disk = make_disk(tmp_path, metrics)
    cache = make_cache(store, metrics, disk, readahead=2 * BS)

    async def main():
        async with serving(disk, cache):
            got, held = await _read_in_quarters(cache, f, Stream())
            assert got == data
            # a block leaves the memory tier once read to its end: never more than the block
            # being read and the readahead window, where without the drop all six stay
            assert all(i >= n * 4 // 16 for n, blocks in enumerate(held) for i in blocks)
            assert held[-1] == []
            await disk.wait_idle()
            assert store.calls["get"] == 6
            # the disk tier has what the memory tier let go: a second reader sends no GET
            assert await cache.read(f, 0, 6 * BS, Stream()) == data
            assert store.calls["get"] == 6
    trio.run(main)
    assert metrics.counter_value("cachefs_readahead_wasted_bytes_total") == 0


def test_blocks_read_whole_out_of_order_leave_the_memory_tier_too(bucket_mem):
    """READs that waited for a GET complete in any order: a block goes once all its bytes are read."""
    data, store, f = bucket_mem.one_file(blob(20, 3 * BS))
    cache = make_cache(store, Metrics(), mem=64 << 20)
    pieces = [(o, min(o + BS // 3, f.size)) for o in range(BS // 8, f.size, BS // 3)] + [(0, BS // 8)]
    random.Random(3).shuffle(pieces)

    async def main():
        async with serving(cache):
            stream = Stream()
            for start, end in pieces:
                assert bytes(await cache.read(f, start, end - start, stream)) == data[start:end]
            assert [i for i in range(3) if cache.memory.contains(cache.key(f, i))] == []
            assert stream.consumed == {}
    trio.run(main)


def test_a_shared_stream_keeps_the_blocks_it_has_read(bucket_mem):
    """A packed shard's stream serves every member's reader: a member read to the end of a block
    must not drop the block the next member reads."""
    data, store, f = bucket_mem.one_file(blob(18, 4 * BS))
    cache = make_cache(store, Metrics(), mem=64 << 20, readahead=2 * BS)

    async def main():
        async with serving(cache):
            got, held = await _read_in_quarters(cache, f, Stream(drop_behind=False))
            assert got == data
            assert held[-1] == [0, 1, 2, 3]
    trio.run(main)


def test_a_reader_that_moves_away_or_closes_cancels_its_readahead(bucket_mem):
    data, store, f = bucket_mem.one_file(blob(19, 12 * BS))
    metrics = Metrics()
    cache = make_cache(store, metrics, readahead=2 * BS)
    cancelled = lambda: count(metrics, "readahead_cancelled")      # noqa: E731

    async def main():
        gate = store.hold("get", lambda path, start, end: start in (2 * BS, 6 * BS))
        async with serving(cache) as nursery:
            try:
                away, closing = Stream(), Stream()
                await cache.read(f, 0, BS, away)
                await cache.read(f, BS, BS, away)                  # block 2 read ahead: held
                await gate.wait_reached()
                assert list(away.ahead) == [2]
                joined = []

                async def join() -> None:                           # a reader waiting on block 2
                    joined.append(await cache.read(f, 2 * BS, BS))
                nursery.start_soon(join)
                await until(lambda: count(metrics, "singleflight_joins") == 1)
                await cache.read(f, BS + 100, 10, away)            # moved a little: kept
                assert list(away.ahead) == [2] and cancelled() == 0
                await cache.read(f, 3 * BS, 10, away)              # past it, as the kernel's readahead
                assert list(away.ahead) == [2] and cancelled() == 0   # READs go: kept too
                assert await cache.read(f, 9 * BS, BS, away) == data[9 * BS:10 * BS]   # moved away
                assert away.ahead == {} and cancelled() == 1
                await cache.read(f, 4 * BS, BS, closing)
                await cache.read(f, 5 * BS, BS, closing)           # block 6 read ahead: held
                assert list(closing.ahead) == [6]
                cache.stop(closing)                                # its file closed
                assert closing.ahead == {} and cancelled() == 2
            finally:
                gate.open()
            await until(lambda: joined)
            # the waiting reader has its bytes (from a GET of its own, or, with a store whose GETs
            # run in worker threads as this one's, from the GET that ended before it was stopped)
            assert joined == [data[2 * BS:3 * BS]]
    trio.run(main)


def test_random_reads_do_not_trigger_readahead(bucket_mem):
    data, store, f = bucket_mem.one_file(blob(8, 4 * BS))
    metrics = Metrics()
    cache = make_cache(store, metrics)
    stream = Stream()

    async def main():
        async with serving(cache):
            for index in (2, 0, 3, 1):
                assert await cache.read(f, index * BS, BS, stream) == data[index * BS:(index + 1) * BS]
            await trio.testing.wait_all_tasks_blocked()
    trio.run(main)
    assert store.calls["get"] == 4
    assert count(metrics, "readahead_blocks") == 0


def test_readahead_is_dropped_not_queued_when_readahead_slots_are_busy(bucket_mem):
    data, store, f = bucket_mem.one_file(blob(9, 6 * BS))
    metrics = Metrics()
    cache = make_cache(store, metrics, max_readaheads=1)

    async def main():
        gate = store.hold("get", lambda path, start, end: start == 2 * BS)
        async with serving(cache):
            try:
                first, second = Stream(), Stream()
                await cache.read(f, 0, BS, first)
                await cache.read(f, BS, BS, first)             # reads block 2 ahead: held at the gate
                await gate.wait_reached()
                await cache.read(f, 3 * BS, BS, second)
                await cache.read(f, 4 * BS, BS, second)        # wants block 5: the one slot is busy
                assert count(metrics, "dropped_fills", tier="readahead", reason="queue_full") == 1
                gate.open()
                await until(lambda: count(metrics, "readahead_blocks") == 1)
                await trio.testing.wait_all_tasks_blocked()
                assert sorted(start // BS for _, start, _ in store.gets) == [0, 1, 2, 3, 4]
                assert not cache.is_cached(cache.key(f, 5))    # dropped, never fetched later
            finally:
                gate.open()        # before the nursery waits for the held thread
    trio.run(main)


def test_a_window_wider_than_the_free_slots_reads_ahead_what_fits(bucket_mem):
    data, store, f = bucket_mem.one_file(blob(10, 5 * BS))
    metrics = Metrics()
    cache = make_cache(store, metrics, max_readaheads=1)
    stream = Stream()

    async def main():
        async with serving(cache):
            await cache.read(f, 0, BS, stream)
            await cache.read(f, BS, BS, stream)                # window 1 block: read block 2 ahead
            await until(lambda: count(metrics, "readahead_blocks") == 1)
            await cache.read(f, 2 * BS, BS, stream)            # window 2 blocks: 3 fits, 4 is dropped
            await until(lambda: count(metrics, "readahead_blocks") == 2)
            await trio.testing.wait_all_tasks_blocked()
    trio.run(main)
    assert store.calls["get"] == 4
    assert count(metrics, "dropped_fills", tier="readahead", reason="queue_full") == 1


def test_a_stalled_readahead_never_queues_a_foreground_read(bucket_mem):
    data, store, f = bucket_mem.one_file(blob(11, 6 * BS))
    cache = make_cache(store, Metrics(), max_fetches=1, max_readaheads=1)

    async def main():
        gate = store.hold("get", lambda path, start, end: start == 2 * BS)
        async with serving(cache):
            try:
                stream = Stream()
                await cache.read(f, 0, BS, stream)
                await cache.read(f, BS, BS, stream)            # readahead of block 2 stalls
                await gate.wait_reached()
                with trio.fail_after(1):
                    assert await cache.read(f, 4 * BS, BS) == data[4 * BS:5 * BS]
            finally:
                gate.open()
    trio.run(main)


def test_a_block_being_written_to_disk_is_read_and_warmed_without_a_second_get(bucket_mem, tmp_path):
    """A block fetched whole (so not kept in memory) whose disk fill is still being written: a
    reader takes the fill's bytes, and a warm of it waits for the fill; neither GETs it again."""
    data, store, f = bucket_mem.one_file(blob(9, 2 * BS))
    metrics = Metrics()
    disk = make_disk(tmp_path / "disk", metrics)
    entered, release = threading.Event(), threading.Event()
    write_file = disk._write_file

    def held(*args):
        entered.set()
        assert release.wait(10)
        return write_file(*args)
    disk._write_file = held

    async def main():
        async with serving(disk):
            cache = make_cache(store, metrics, disk)
            key = cache.key(f, 0)
            assert await cache.read(f, 0, BS) == data[:BS]
            assert await trio.to_thread.run_sync(entered.wait, 5)
            assert disk.filling(key) and not cache.memory.contains(key) and not disk.contains(key)
            assert await cache.read(f, 10, 100) == data[10:110]          # the fill's bytes
            results = []

            async def warm():
                results.append(await cache.warm(f, 0, trio.CapacityLimiter(2)))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(warm)
                await trio.sleep(0.05)
                assert results == []                                     # waiting for the fill
                release.set()
            assert results == [(0, True)] and disk.contains(key)
            assert store.calls["get"] == 1
    trio.run(main)
