import errno
import fcntl
import os
import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import xxhash

from cachefs.errors import CacheDirError
from cachefs.metrics import Metrics
from cachefs.tiers.disk import BlockHeader, DiskHealth, DiskTier
from cachefs.tiers.disk import format as block_format
from cachefs.tiers.disk import reader as disk_reader
from cachefs.tiers.disk.direct import DirectWrites
from cachefs.tiers.key import BlockKey

BS = 64 << 10          # block size used by most tests
CS = 4096              # chunk size used by most tests
FILE = BlockHeader.file_size(BS, CS)


def key(i: int, etag: str = "v1") -> BlockKey:
    return BlockKey("s3://bucket", f"data/{i // 100}.bin", etag, BS, i)


def blob(i: int, n: int = BS) -> bytes:
    return random.Random(i).randbytes(n)


def make_tier(root: Path, **kw) -> DiskTier:
    opts = {"capacity": 16 << 20, "free_space_ratio": 0.0, "metrics": Metrics(), "fsync": False,
            "chunk_size": CS}
    opts.update(kw)
    return DiskTier(root, **opts)


def serve(tier: DiskTier, body) -> None:
    """Run ``tier`` in a fresh trio loop around ``await body()``."""
    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(tier.run)
            await body()
            await tier.wait_idle()
            nursery.cancel_scope.cancel()
    trio.run(main)


def metric(t: DiskTier, name: str, **labels) -> float:
    return t.metrics.counter_value(name, **labels)


def block_file(root: Path, k: BlockKey) -> Path:
    d = k.digest()
    return root / "blocks" / d[:2] / d


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for sub in ("blocks", "tmp") for p in (root / sub).rglob("*") if p.is_file())


def close_handles(tier: DiskTier) -> None:
    while tier.reader.handles:
        os.close(tier.reader.handles.popitem()[1].fd)


def patch_file(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# --- format and reads ---------------------------------------------------------------------

def test_round_trip_writes_the_documented_format(tmp_path):
    tier = make_tier(tmp_path, fsync=True)
    data = blob(1, 5 * CS + 100)

    async def body():
        assert await tier.fill(key(1), data)
        assert tier.contains(key(1)) and tier.block_length(key(1)) == len(data)
        assert tier.read(key(1), 0, len(data)) == data
        assert tier.read(key(2), 0, 10) is None
    serve(tier, body)

    raw = block_file(tmp_path, key(1)).read_bytes()
    assert len(raw) == 4096 + len(data) and raw[4096:] == data
    header = BlockHeader.parse(raw)
    assert (header.length, header.data_len, header.chunk_size) == (4096, len(data), CS)
    assert header.digests == tuple(xxhash.xxh3_64_intdigest(data[i:i + CS]) for i in range(0, len(data), CS))
    assert list((tmp_path / "tmp").iterdir()) == []
    assert metric(tier, "cachefs_tier_hits_total", tier="disk") == 1
    assert metric(tier, "cachefs_tier_misses_total", tier="disk") == 1
    assert metric(tier, "cachefs_tier_hit_bytes_total", tier="disk") == len(data)


@pytest.mark.parametrize("fsync", [True, False])
def test_fill_makes_data_durable_before_the_rename_that_indexes_it(tmp_path, monkeypatch, fsync):
    tier = make_tier(tmp_path, fsync=fsync)
    events = []
    real_fdatasync, real_fsync, real_rename = os.fdatasync, os.fsync, os.rename
    monkeypatch.setattr(os, "fdatasync", lambda fd: events.append("fdatasync") or real_fdatasync(fd))
    monkeypatch.setattr(os, "fsync", lambda fd: events.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(os, "rename", lambda a, b: events.append(("rename", Path(a).parent.name,
                                                                  Path(b).parent.parent.name))
                        or real_rename(a, b))

    async def body():
        events.clear()                      # forget the start-up probe
        assert await tier.fill(key(1), blob(1))
    serve(tier, body)
    rename = ("rename", "tmp", "blocks")
    # no directory fsync: a rename lost in a crash is only a cache miss
    assert events == (["fdatasync", rename] if fsync else [rename])


def test_partial_reads_at_chunk_boundaries_and_last_partial_chunk(tmp_path):
    tier = make_tier(tmp_path)
    data = blob(2, 5 * CS + 100)
    n = len(data)
    offsets = [0, 1, CS - 1, CS, CS + 1, 2 * CS - 1, 4 * CS, 5 * CS - 1, 5 * CS, n - 1, n, n + 7]
    sizes = [0, 1, 99, 100, CS - 1, CS, CS + 1, 3 * CS, n, 1 << 30]

    async def body():
        assert await tier.fill(key(2), data)
        for offset in offsets:
            for size in sizes:
                close_handles(tier)
                assert tier.read(key(2), offset, size) == data[offset:offset + size], (offset, size)
                assert tier.read(key(2), offset, size) == data[offset:offset + size], (offset, size)
    serve(tier, body)
    assert metric(tier, "cachefs_corrupt_blocks_total") == 0


def test_read_preads_only_the_chunks_it_covers(tmp_path):
    tier = make_tier(tmp_path)
    data = blob(3, 8 * CS)
    calls = []

    def pread(fd, n, offset):
        calls.append((n, offset))
        return os.pread(fd, n, offset)
    tier.reader.pread = pread

    async def body():
        assert await tier.fill(key(3), data)
        assert tier.read(key(3), 10, 100) == data[10:110]                    # cold, chunk 0
        assert calls == [(4096 + CS, 0)]                                      # header + data, one call
        calls.clear()
        assert tier.read(key(3), 2 * CS + 5, CS) == data[2 * CS + 5:3 * CS + 5]   # warm: chunks 2-3
        assert calls == [(2 * CS, 4096 + 2 * CS)]
        close_handles(tier)
        calls.clear()
        assert tier.read(key(3), 6 * CS, CS) == data[6 * CS:7 * CS]           # cold, later chunk
        assert calls == [(4096, 0), (CS, 4096 + 6 * CS)]
        big = blob(4, 80 * CS)                                                # 320 KiB
        assert await tier.fill(key(4), big)
        calls.clear()
        assert tier.read(key(4), 0, len(big)) == big                          # cold, large: no copy
        assert calls == [(4096, 0), (len(big), 4096)]
    serve(tier, body)


def test_hot_block_keeps_its_file_open(tmp_path, monkeypatch):
    tier = make_tier(tmp_path)
    tier.reader.max_open = 4
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **kw: opened.append(str(p)) or real_open(p, *a, **kw))

    async def body():
        for i in range(10):
            assert await tier.fill(key(i), blob(i))
        opened.clear()
        for _ in range(5):
            assert tier.read(key(0), 0, 100) == blob(0)[:100]
        assert len(opened) == 1
        for i in range(10):
            tier.read(key(i), 0, 100)
        assert len(tier.reader.handles) == 4
        fds = [h.fd for h in tier.reader.handles.values()]
        tier.discard(key(9))
        with pytest.raises(OSError):
            os.fstat(fds[-1])
    serve(tier, body)
    assert tier.reader.handles == {}


# --- corruption ---------------------------------------------------------------------------

@pytest.mark.parametrize("warm", [False, True])
def test_corrupt_data_byte_is_dropped_counted_and_refilled(tmp_path, warm):
    tier = make_tier(tmp_path)
    data = blob(4, 6 * CS)
    path = block_file(tmp_path, key(4))

    async def body():
        assert await tier.fill(key(4), data)
        if warm:
            assert tier.read(key(4), 0, CS) == data[:CS]
        flip_byte(path, 4096 + 3 * CS + 7)
        assert tier.read(key(4), 0, CS) == data[:CS]          # chunk 3 is not touched: served
        assert tier.read(key(4), 2 * CS, 2 * CS) is None      # chunk 3 is: dropped, never served
        assert metric(tier, "cachefs_corrupt_blocks_total") == 1
        assert not tier.contains(key(4))
        await tier.wait_idle()
        assert not path.exists()
        assert tier.read(key(4), 0, 10) is None
        assert await tier.fill(key(4), data)
        assert tier.read(key(4), 0, len(data)) == data
    serve(tier, body)
    assert tier.stats()["used_bytes"] == disk_bytes(tmp_path)


@pytest.mark.parametrize("warm", [False, True])
def test_truncated_block_is_dropped(tmp_path, warm):
    tier = make_tier(tmp_path)
    data = blob(5, 6 * CS)
    path = block_file(tmp_path, key(5))

    async def body():
        assert await tier.fill(key(5), data)
        if warm:
            assert tier.read(key(5), 0, 10) == data[:10]
        os.truncate(path, 4096 + 3 * CS + 100)
        if warm:       # the open file's chunks 0-2 are intact; the short pread of chunk 3 is caught
            assert tier.read(key(5), 3 * CS, 2 * CS) is None
        else:          # the file size no longer matches its header: dropped before any chunk
            assert tier.read(key(5), 0, 10) is None
        assert metric(tier, "cachefs_corrupt_blocks_total") == 1
        await tier.wait_idle()
        assert not path.exists() and not tier.contains(key(5))
    serve(tier, body)


@pytest.mark.parametrize("where", ["magic", "length", "chunk digest", "header digest", "garbage", "empty"])
def test_bad_header_is_dropped(tmp_path, where):
    tier = make_tier(tmp_path)
    data = blob(6, 6 * CS)
    path = block_file(tmp_path, key(6))

    async def body():
        assert await tier.fill(key(6), data)
        if where == "garbage":
            patch_file(path, 0, random.Random(0).randbytes(4096))
        elif where == "empty":
            os.truncate(path, 0)
        else:
            flip_byte(path, {"magic": 0, "length": 8, "chunk digest": 24 + 8 * 2,
                             "header digest": 24 + 8 * 6}[where])
        assert tier.block_length(key(6)) == len(data)         # known from the fill, no I/O
        assert tier.read(key(6), 0, 10) is None
        assert metric(tier, "cachefs_corrupt_blocks_total") == 1
        await tier.wait_idle()
        assert not path.exists()
    serve(tier, body)


def test_missing_file_is_a_miss(tmp_path):
    tier = make_tier(tmp_path)

    async def body():
        assert await tier.fill(key(7), blob(7))
        block_file(tmp_path, key(7)).unlink()
        assert tier.read(key(7), 0, 10) is None
        assert not tier.contains(key(7))
    serve(tier, body)


# --- cold reads: inline with a read-ahead hint, or in worker threads ------------------------

def force_cold(monkeypatch) -> list[str]:
    """Make every read_async take the cold path, and record where each cold read ran."""
    where: list[str] = []
    main = threading.get_ident()
    depth = threading.local()

    def not_resident(*args):
        raise BlockingIOError(errno.EAGAIN, "not resident")

    def recording(name):
        real = getattr(block_format, name)

        def read(*args):                  # open_and_read calls read_opened: count the outer one
            if not getattr(depth, "n", 0):
                where.append("trio" if threading.get_ident() == main else "thread")
            depth.n = getattr(depth, "n", 0) + 1
            try:
                return real(*args)
            finally:
                depth.n -= 1
        monkeypatch.setattr(block_format, name, read)

    monkeypatch.setattr(block_format, "read_resident", not_resident)
    for name in ("read_dup", "read_opened", "open_and_read"):
        recording(name)
    return where


def test_small_cold_reads_run_on_the_trio_thread_large_ones_in_threads(tmp_path, monkeypatch):
    tier = make_tier(tmp_path)
    small, large = blob(1, 6 * CS), blob(2, disk_reader.INLINE_MAX + 2 * CS)
    where = force_cold(monkeypatch)

    async def body():
        assert await tier.fill(key(1), small) and await tier.fill(key(2), large)
        close_handles(tier)
        assert await tier.read_async(key(1), 5, 3 * CS) == small[5:5 + 3 * CS]    # first open
        assert await tier.read_async(key(1), 4 * CS, 2 * CS) == small[4 * CS:]    # cached fd (a dup)
        assert await tier.read_async(key(2), 0, len(large)) == large               # too large: thread
        assert where == ["trio", "trio", "thread"]
        assert key(1).digest() in tier.reader.handles and key(2).digest() in tier.reader.handles
    serve(tier, body)
    assert tier.reader.handles == {}


@pytest.mark.parametrize("warm", [False, True])
def test_inline_cold_read_of_a_corrupt_block_drops_it(tmp_path, monkeypatch, warm):
    tier = make_tier(tmp_path)
    data = blob(4, 6 * CS)
    where = force_cold(monkeypatch)

    async def body():
        assert await tier.fill(key(4), data)
        close_handles(tier)
        if warm:
            assert await tier.read_async(key(4), 0, 10) == data[:10]
        flip_byte(block_file(tmp_path, key(4)), 4096 + 2 * CS + 1)
        assert await tier.read_async(key(4), 0, 4 * CS) is None
        assert metric(tier, "cachefs_corrupt_blocks_total") == 1
        assert not tier.contains(key(4))
        assert set(where) == {"trio"}
    serve(tier, body)


def test_slow_inline_reads_move_cold_reads_to_threads(tmp_path, monkeypatch, caplog):
    tier = make_tier(tmp_path)
    where = force_cold(monkeypatch)
    recorded = block_format.read_opened

    def slow(*args):
        time.sleep(0.01)               # a disk that takes 10 ms per small read
        return recorded(*args)
    monkeypatch.setattr(block_format, "read_opened", slow)

    async def body():
        for i in range(8):
            assert await tier.fill(key(i), blob(i))
        close_handles(tier)
        for i in range(8):
            assert await tier.read_async(key(i), 0, 100) == blob(i)[:100]
    caplog.set_level("INFO", logger="cachefs.tiers.disk")
    serve(tier, body)
    # the moving average crosses 2 ms on the 3rd 10 ms read (sooner when a busy box oversleeps);
    # the rest wait in threads
    inline = where.count("trio")
    assert 1 <= inline <= 3 and where == ["trio"] * inline + ["thread"] * (8 - inline)
    assert "reading in threads" in caplog.text
    assert tier.reader.inline_off_until > time.monotonic()


# --- capacity and eviction ----------------------------------------------------------------

def test_capacity_never_exceeded_under_many_fills(tmp_path):
    capacity = 10 * FILE + 12345
    tier = make_tier(tmp_path, capacity=capacity, fill_workers=4)
    real_write = tier._write_file
    lock = threading.Lock()
    ledger = {"now": 0, "peak": 0}          # bytes on disk, an upper bound at every instant

    def write_with_ledger(doomed, tmp, final, data, chunk_size, fsync):
        with lock:                           # unlink the evicted files, then count the new one
            for path in doomed:
                if path.exists():
                    ledger["now"] -= path.stat().st_size
                    path.unlink()
            ledger["now"] += BlockHeader.file_size(len(data), chunk_size)
            ledger["peak"] = max(ledger["peak"], ledger["now"])
        return real_write([], tmp, final, data, chunk_size, fsync)
    tier._write_file = write_with_ledger
    rng = random.Random(8)

    async def body():
        for i in range(60):                       # one at a time, mixed sizes
            assert await tier.fill(key(i), blob(i, rng.randrange(1, BS + 1)))
            assert tier.stats()["used_bytes"] <= capacity
            assert disk_bytes(tmp_path) <= capacity
        for i in range(60, 200):                  # many at once
            tier.start_fill(key(i), blob(i, rng.randrange(1, BS + 1)))
            assert tier.stats()["used_bytes"] <= capacity
            if i % 10 == 0:
                await trio.sleep(0.001)
        while tier._inflight:
            assert tier.stats()["used_bytes"] <= capacity
            await trio.sleep(0.001)
        await tier.wait_idle()
        stats = tier.stats()
        assert stats["used_bytes"] == disk_bytes(tmp_path) <= capacity
        assert metric(tier, "cachefs_tier_used_bytes", tier="disk") == stats["used_bytes"]
        assert metric(tier, "cachefs_tier_blocks", tier="disk") == stats["blocks"]
        assert metric(tier, "cachefs_tier_capacity_bytes", tier="disk") == capacity
        assert metric(tier, "cachefs_evictions_total", tier="disk") >= 150
    serve(tier, body)
    assert 9 * FILE < ledger["peak"] <= capacity


def test_block_that_can_never_fit_is_dropped(tmp_path):
    tier = make_tier(tmp_path, capacity=FILE - 1)

    async def body():
        assert not tier.start_fill(key(1), blob(1))
        assert not await tier.fill(key(1), blob(1))
        assert tier.start_fill(key(2), blob(2, 100))
    serve(tier, body)
    assert metric(tier, "cachefs_dropped_fills_total", tier="disk", reason="no_space") == 2
    assert tier.stats()["blocks"] == 1


def test_free_space_watermark(tmp_path):
    mib = 1 << 20
    tier = make_tier(tmp_path, capacity=1 << 30, free_space_ratio=0.25, chunk_size=128 << 10)
    fs = {"base": 30 * mib}                       # free bytes when the cache is empty

    def statvfs(path):
        free = fs["base"] - disk_bytes(tmp_path)
        return SimpleNamespace(f_frsize=4096, f_blocks=100 * mib // 4096, f_bavail=free // 4096)
    tier.space.statvfs = statvfs
    tier.space.fs_ttl = 0.0
    block = 1 << 20

    async def body():
        for i in range(10):
            assert await tier.fill(key(i), blob(i, block))
            assert fs["base"] - disk_bytes(tmp_path) >= 25 * mib
        assert tier.stats()["blocks"] == 4
        fs["base"] = 27 * mib                     # another process took 3 MiB
        assert await tier.fill(key(10), blob(10, block))
        assert fs["base"] - disk_bytes(tmp_path) >= 25 * mib
        assert tier.stats()["blocks"] == 1
        fs["base"] = 20 * mib                     # cannot be met even by evicting everything
        evicted = metric(tier, "cachefs_evictions_total", tier="disk")
        assert not await tier.fill(key(11), blob(11, block))
        assert metric(tier, "cachefs_dropped_fills_total", tier="disk", reason="no_space") == 1
        assert metric(tier, "cachefs_evictions_total", tier="disk") == evicted
        assert tier.contains(key(10))
    serve(tier, body)


def test_free_space_is_sampled_at_most_once_per_ttl(tmp_path):
    tier = make_tier(tmp_path)
    calls = []
    tier.space.statvfs = lambda p: calls.append(p) or os.statvfs(p)

    async def body():
        for i in range(20):
            assert await tier.fill(key(i), blob(i, 100))
    serve(tier, body)
    assert len(calls) == 1


def _hot_set_after_scan(tmp_path, hits: int) -> list[bool]:
    tier = make_tier(tmp_path, capacity=10 * FILE)
    hot = [key(1000 + i) for i in range(4)]

    async def body():
        for k in hot:
            assert await tier.fill(k, blob(k.index))
            for _ in range(hits):
                assert tier.read(k, 0, BS) == blob(k.index)
        for i in range(30):                       # one pass over 3x the capacity
            assert await tier.fill(key(i), blob(i))
            assert tier.stats()["protected_bytes"] <= 0.8 * tier.capacity
    serve(tier, body)
    return [tier.contains(k) for k in hot]


def test_hot_set_survives_a_scan(tmp_path):
    assert _hot_set_after_scan(tmp_path / "hot", hits=1) == [True] * 4
    assert _hot_set_after_scan(tmp_path / "cold", hits=0) == [False] * 4


def test_protected_segment_is_capped(tmp_path):
    tier = make_tier(tmp_path, capacity=10 * FILE)

    async def body():
        for i in range(10):
            assert await tier.fill(key(i), blob(i))
            assert tier.read(key(i), 0, 1) is not None
            assert tier.stats()["protected_bytes"] <= 0.8 * tier.capacity
        assert await tier.fill(key(10), blob(10))      # evicts from probation: a demoted block
        assert all(tier.contains(key(i)) for i in range(9, 11))
    serve(tier, body)


# --- restart ------------------------------------------------------------------------------

def test_restart_rebuilds_index_and_evicts_oldest_mtime_first(tmp_path):
    first = make_tier(tmp_path, capacity=5 * FILE)

    async def fill_five():
        for i in range(5):
            assert await first.fill(key(i), blob(i))
    serve(first, fill_five)
    now = time.time()
    for i in range(5):                            # block 4 is the oldest, block 0 the newest
        os.utime(block_file(tmp_path, key(i)), (now - 100 * i, now - 100 * i))

    second = make_tier(tmp_path, capacity=5 * FILE)

    async def body():
        assert second.stats()["blocks"] == 5 and second.stats()["used_bytes"] == 5 * FILE
        assert all(second.contains(key(i)) for i in range(5))
        assert second.block_length(key(3)) == BS
        assert second.read(key(2), 100, 1000) == blob(2)[100:1100]
        assert await second.fill(key(5), blob(5))
        assert not second.contains(key(4))
        assert all(second.contains(key(i)) for i in (0, 1, 2, 3, 5))
    serve(second, body)


def test_restart_with_smaller_capacity_shrinks(tmp_path):
    first = make_tier(tmp_path)

    async def fill_six():
        for i in range(6):
            assert await first.fill(key(i), blob(i))
    serve(first, fill_six)
    now = time.time()
    for i in range(6):                            # block 0 is the oldest
        os.utime(block_file(tmp_path, key(i)), (now - 100 + i, now - 100 + i))
    second = make_tier(tmp_path, capacity=3 * FILE)

    async def body():
        assert second.stats()["used_bytes"] <= 3 * FILE
    serve(second, body)
    assert disk_bytes(tmp_path) <= 3 * FILE
    assert [second.contains(key(i)) for i in range(6)] == [False] * 3 + [True] * 3


def test_stale_temp_files_removed_and_strangers_ignored(tmp_path):
    (tmp_path / "tmp").mkdir(parents=True)
    (tmp_path / "blocks" / "ab").mkdir(parents=True)
    for name in ("x.1234.tmp", "probe.tmp", "y"):
        (tmp_path / "tmp" / name).write_bytes(b"half a block")
    (tmp_path / "blocks" / "ab" / "not-a-digest").write_bytes(b"x")
    (tmp_path / "blocks" / "ab" / ("cd" * 20)).write_bytes(b"x")    # wrong fan-out directory
    tier = make_tier(tmp_path)

    async def body():
        assert list((tmp_path / "tmp").iterdir()) == []
        assert tier.stats()["blocks"] == 0
    serve(tier, body)


def test_temp_file_is_removed_when_a_write_fails(tmp_path, monkeypatch):
    tier = make_tier(tmp_path)

    async def body():
        monkeypatch.setattr(os, "rename", _failing)
        assert not await tier.fill(key(1), blob(1))
        monkeypatch.undo()
        assert not tier.contains(key(1)) and tier.read(key(1), 0, 1) is None
        assert list((tmp_path / "tmp").iterdir()) == []
        assert tier.stats()["used_bytes"] == 0
    serve(tier, body)
    assert metric(tier, "cachefs_disk_errors_total", op="write") == 1
    assert metric(tier, "cachefs_dropped_fills_total", tier="disk", reason="error") == 1


# --- fill queue ---------------------------------------------------------------------------

def test_queue_full_drop_counted(tmp_path):
    tier = make_tier(tmp_path, max_pending_fill_bytes=2 * BS + BS // 2)

    async def body():
        results = [tier.start_fill(key(i), blob(i)) for i in range(5)]
        assert results == [True, True, False, False, False]
        assert tier.start_fill(key(0), blob(0))               # in flight: no new job
        assert tier.stats()["pending_fill_bytes"] == 2 * BS
        await tier.wait_idle()
        assert tier.stats()["pending_fill_bytes"] == 0
        assert tier.start_fill(key(1), blob(1))               # cached: nothing queued
        assert tier.stats()["pending_fill_bytes"] == 0
        assert tier.read(key(1), 0, BS) == blob(1)
    serve(tier, body)
    assert metric(tier, "cachefs_dropped_fills_total", tier="disk", reason="queue_full") == 3


def test_discard_removes_block_and_cancels_inflight_fill(tmp_path):
    tier = make_tier(tmp_path)

    async def body():
        assert await tier.fill(key(1), blob(1))
        assert tier.read(key(1), 0, 10) is not None
        tier.discard(key(1))
        assert not tier.contains(key(1)) and tier.read(key(1), 0, 10) is None
        tier.start_fill(key(2), blob(2))
        tier.discard(key(2))                                   # queued, then discarded
        await tier.wait_idle()
        assert not tier.contains(key(2))
        assert disk_bytes(tmp_path) == 0 and tier.stats()["used_bytes"] == 0
        assert await tier.fill(key(1), blob(1))                # refill after a discard
        assert tier.read(key(1), 0, BS) == blob(1)
    serve(tier, body)


def test_fill_workers_run_in_threads_and_wait_for_old_unlinks(tmp_path, monkeypatch):
    tier = make_tier(tmp_path, fill_workers=2)
    threads = set()
    real_write, real_unlink = tier._write_file, block_format.unlink_paths

    def write(*args):
        threads.add(threading.get_ident())
        return real_write(*args)
    tier._write_file = write

    def slow_unlink(paths):
        if paths:
            time.sleep(0.2)
        return real_unlink(paths)
    monkeypatch.setattr(block_format, "unlink_paths", slow_unlink)

    async def body():
        for i in range(8):
            tier.start_fill(key(i), blob(i))
        await tier.wait_idle()
        tier.discard(key(3))
        assert tier.start_fill(key(3), blob(3))        # must not be removed by the slow unlink
        await tier.wait_idle()
        assert tier.read(key(3), 0, BS) == blob(3)
    serve(tier, body)
    assert threads and threading.get_ident() not in threads
    assert block_file(tmp_path, key(3)).exists()


def test_one_writer_while_fills_are_few_more_as_the_queue_grows(tmp_path):
    """Reader fills take one writer thread while little is queued (small files), and up to
    fill_workers when the queued bytes grow (a large file read cold): writers beside each other
    cost the trio thread CPU and GIL time for nothing when one keeps up."""
    from cachefs.tiers.disk.fills import WRITER_SCALE
    big = 2 * WRITER_SCALE // 5                     # five of them: two writers' worth queued
    tier = make_tier(tmp_path, capacity=256 << 20, fill_workers=3)
    running, most = [0], []
    lock = threading.Lock()
    real_write = tier._write_file

    def write(*args):
        with lock:
            running[0] += 1
            most.append(running[0])
        try:
            time.sleep(0.02)
            return real_write(*args)
        finally:
            with lock:
                running[0] -= 1
    tier._write_file = write

    async def body():
        for i in range(20):                          # 20 small fills queued at once
            assert tier.start_fill(key(i), blob(i))
        await tier.wait_idle()
        small = max(most)
        most.clear()
        for i in range(20, 32):                      # 12 large ones
            assert tier.start_fill(key(i), random.Random(i).randbytes(big))
        await tier.wait_idle()
        large = max(most)
        most.clear()
        assert tier.start_fill(key(40), blob(40))    # back to one writer
        await tier.wait_idle()
        return small, large, max(most)
    got = []
    serve(tier, lambda: _keep(got, body()))
    assert got == [(1, 3, 1)]
    assert all(tier.contains(key(i)) for i in [*range(32), 40])


async def _keep(out: list, coro) -> None:
    out.append(await coro)


# --- health -------------------------------------------------------------------------------

def _failing(*args, **kwargs):
    raise OSError(errno.EIO, "injected I/O error")


@pytest.mark.allow_warnings
def test_disk_errors_make_the_tier_unstable_then_down_then_it_recovers(tmp_path):
    tier = make_tier(tmp_path, health=DiskHealth(cooldown=0.3))
    calls = []

    def counting_failure(*args):
        calls.append(args)
        _failing()

    async def body():
        for i in range(12):
            assert await tier.fill(key(i), blob(i))
        real_pread = tier.reader.pread
        tier.reader.pread = counting_failure
        for i in range(3):
            assert tier.read(key(i), 0, 10) is None
        assert tier.stats()["health"] == "unstable"
        assert metric(tier, "cachefs_disk_health") == 1
        assert not tier.start_fill(key(50), blob(50))                  # no new fills
        assert metric(tier, "cachefs_dropped_fills_total", tier="disk", reason="unhealthy") == 1
        tier.reader.pread = real_pread
        assert tier.read(key(3), 0, 10) == blob(3)[:10]               # reads still served
        close_handles(tier)
        tier.reader.pread = counting_failure
        for i in range(4, 11):
            assert tier.read(key(i), 0, 10) is None
        assert tier.stats()["health"] == "down"
        assert metric(tier, "cachefs_disk_health") == 2
        calls.clear()
        assert tier.read(key(11), 0, 10) is None                      # bypassed: no I/O at all
        assert calls == [] and not tier.contains(key(11)) and tier.block_length(key(11)) is None
        tier.reader.pread = real_pread
        with trio.fail_after(5):
            while tier.stats()["health"] != "healthy":
                await trio.sleep(0.05)
        assert metric(tier, "cachefs_disk_health") == 0
        assert tier.read(key(11), 0, 10) == blob(11)[:10]
        assert await tier.fill(key(50), blob(50))
    serve(tier, body)
    assert metric(tier, "cachefs_disk_errors_total", op="read") == 10


@pytest.mark.allow_warnings
def test_failed_probe_keeps_the_tier_down(tmp_path):
    tier = make_tier(tmp_path, health=DiskHealth(unstable_errors=2, down_errors=2, cooldown=0.1))
    tier._write_file = _failing

    async def body():
        assert not await tier.fill(key(1), blob(1))
        assert not await tier.fill(key(2), blob(2))
        assert tier.stats()["health"] == "down"
        tier.watch.probe = _failing
        await trio.sleep(0.5)
        assert tier.stats()["health"] == "down"
        assert metric(tier, "cachefs_disk_errors_total", op="probe") >= 1
        tier.watch.probe = lambda *a: None
        with trio.fail_after(5):
            while tier.stats()["health"] != "healthy":
                await trio.sleep(0.05)
    serve(tier, body)
    assert metric(tier, "cachefs_disk_errors_total", op="write") == 2
    assert metric(tier, "cachefs_dropped_fills_total", tier="disk", reason="error") == 2


def test_disk_full_on_write_is_a_no_space_drop_not_a_health_error(tmp_path):
    tier = make_tier(tmp_path, health=DiskHealth(unstable_errors=1))

    def enospc(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
    tier._write_file = enospc

    async def body():
        assert not await tier.fill(key(1), blob(1))
        assert tier.stats()["health"] == "healthy" and tier.stats()["used_bytes"] == 0
    serve(tier, body)
    assert metric(tier, "cachefs_dropped_fills_total", tier="disk", reason="no_space") == 1


def test_health_window_forgets_old_errors():
    now = [0.0]
    health = DiskHealth(unstable_errors=3, down_errors=5, window=10.0, cooldown=5.0, clock=lambda: now[0])
    for t in (0, 1, 12, 13):
        now[0] = t
        health.record_error()
    assert health.name == "healthy"
    now[0] = 14
    assert health.record_error() and health.name == "unstable"
    now[0] = 18
    assert not health.probe_due()
    now[0] = 19
    assert health.probe_due()
    health.recovered()
    assert health.name == "healthy" and not health.probe_due()


# --- the cache root -----------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["under a file", "is a file"])
def test_unusable_cache_root_raises_cache_dir_error(tmp_path, layout):
    (tmp_path / "afile").write_bytes(b"x")
    root = tmp_path / "afile" / "cache" if layout == "under a file" else tmp_path / "afile"
    tier = make_tier(root)
    with pytest.raises(CacheDirError) as info:
        trio.run(tier.run)
    assert str(root) in str(info.value) and "\n" not in str(info.value)
    assert info.value.exit_code == 8


def test_unwritable_cache_dir_raises_cache_dir_error(tmp_path, monkeypatch):
    def read_only(*args):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr("cachefs.tiers.disk.health.probe_dir_writable", read_only)
    tier = make_tier(tmp_path)
    with pytest.raises(CacheDirError, match="Read-only file system"):
        trio.run(tier.run)


# ---- O_DIRECT writes (--cache-direct-io) ----------------------------------------------------------
def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache (mincore over a private mapping that touches no page)."""
    import ctypes
    import mmap
    size = path.stat().st_size
    page = mmap.PAGESIZE
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        pages = -(-size // page)
        vec = (ctypes.c_ubyte * pages)()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        return sum(page for v in vec if v & 1)
    finally:
        mapped.close()


@pytest.mark.parametrize("size", [1, 4095, 4096, 3 * 4096 + 17, 4 << 20])
def test_direct_writes_skip_the_page_cache_and_read_back_exactly(tmp_path, size):
    """A block file written with O_DIRECT (the tail padded, then truncated) has its exact size,
    parses and holds the bytes, like a buffered one."""
    direct = DirectWrites()
    data = random.Random(size).randbytes(size)
    (tmp_path / "tmp").mkdir()
    for name, how in (("direct", direct), ("buffered", None)):
        final = tmp_path / name
        block_format.write_block_file([], tmp_path / "tmp" / f"{name}.tmp", final, data, CS, True, direct=how)
        fd = os.open(final, os.O_RDONLY)
        try:
            header, _ = block_format.parse_block(fd, 0, os.pread)
            assert os.fstat(fd).st_size == header.length + size
            assert os.pread(fd, size + 1, header.length) == data
        finally:
            os.close(fd)
    assert direct.refused == set()
    assert list((tmp_path / "tmp").iterdir()) == []


def test_direct_writes_leave_no_page_behind(tmp_path):
    """What O_DIRECT is for: no copy in the page cache (a buffered write leaves it all there)."""
    direct = DirectWrites()
    data = random.Random(3).randbytes(1 << 20)
    (tmp_path / "tmp").mkdir()
    for name, how in (("direct", direct), ("buffered", None)):
        block_format.write_block_file([], tmp_path / "tmp" / f"{name}.tmp", tmp_path / name, data, CS, False,
                                      direct=how)
    assert resident_bytes(tmp_path / "direct") == 0
    assert resident_bytes(tmp_path / "buffered") >= len(data)


@pytest.mark.parametrize("where", ["open", "write"])
def test_a_file_system_that_refuses_o_direct_gets_buffered_writes(tmp_path, monkeypatch, caplog, where):
    """EINVAL for O_DIRECT (at open, or at the first write: an alignment the device refuses): the
    block is written buffered, right, with no temp file left, and that file system is not asked
    again."""
    direct = DirectWrites()
    tries = []
    real_open, real_pwritev = os.open, os.pwritev

    def open_(path, flags, mode=0o777):
        if flags & os.O_DIRECT:
            tries.append(path)
            if where == "open":
                raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    def pwritev(fd, buffers, offset):
        if where == "write":
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwritev(fd, buffers, offset)
    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "pwritev", pwritev)
    caplog.set_level("INFO", logger="cachefs.tiers.disk.format")
    (tmp_path / "tmp").mkdir()
    for i in range(3):
        data = random.Random(i).randbytes(10_000 + i)
        block_format.write_block_file([], tmp_path / "tmp" / f"{i}.tmp", tmp_path / f"b{i}", data, CS, True,
                                      direct=direct)
        monkeypatch.setattr(os, "open", real_open)
        fd = os.open(tmp_path / f"b{i}", os.O_RDONLY)
        header, _ = block_format.parse_block(fd, 0, os.pread)
        assert os.pread(fd, len(data) + 1, header.length) == data
        os.close(fd)
        monkeypatch.setattr(os, "open", open_)
    assert len(tries) == 1 and direct.refused == {os.stat(tmp_path / "tmp").st_dev}
    assert list((tmp_path / "tmp").iterdir()) == []
    assert sum("refuses O_DIRECT" in r.getMessage() for r in caplog.records) == 1
    assert direct.mode() == "buffered (O_DIRECT refused)"


def test_a_failed_direct_write_leaves_no_temp_file_and_raises(tmp_path, monkeypatch):
    direct = DirectWrites()

    def pwritev(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "pwritev", pwritev)
    (tmp_path / "tmp").mkdir()
    with pytest.raises(OSError) as info:
        block_format.write_block_file([], tmp_path / "tmp" / "x.tmp", tmp_path / "x", b"y" * 5000, CS, True,
                                      direct=direct)
    assert info.value.errno == errno.ENOSPC
    assert list((tmp_path / "tmp").iterdir()) == [] and not (tmp_path / "x").exists()
    assert direct.refused == set()


def test_direct_write_buffers_are_reused_and_bounded():
    direct = DirectWrites(keep=2)
    bufs = [direct.take(5000) for _ in range(3)]
    assert all(len(b) >= 5000 and len(b) % (1 << 20) == 0 for b in bufs)
    for b in bufs:
        direct.give(b)
    assert len(direct._free) == 2 and bufs[2].closed
    again = direct.take(4096)
    assert again is bufs[0]
    bigger = direct.take(3 << 20)
    assert bigger not in bufs and len(bigger) >= 3 << 20


def test_small_buffers_do_not_hold_the_pool():
    """A full pool hands its smallest buffer back to the kernel, not the large one just returned:
    otherwise a few small writes (a shard's tail block) would make every later large write map,
    fault in and unmap a buffer of its own."""
    direct = DirectWrites(keep=2)
    small = [direct.take(5000) for _ in range(2)]
    big = direct.take(3 << 20)
    for b in small + [big]:
        direct.give(b)
    assert big in direct._free and len(direct._free) == 2
    assert sum(b.closed for b in small) == 1
    assert direct.take(3 << 20) is big            # the next large write reuses it


def test_the_pool_keeps_a_bounded_number_of_bytes():
    direct = DirectWrites(keep=8, keep_bytes=3 << 20)
    small = [direct.take(5000) for _ in range(3)]         # 1 MiB each
    for b in small:
        direct.give(b)
    assert len(direct._free) == 3
    big = direct.take(3 << 20)
    assert big not in small
    direct.give(big)
    assert direct._free == [big] and all(b.closed for b in small)
    huge = direct.take(5 << 20)                           # past keep_bytes alone: still one is kept
    direct.give(huge)
    assert direct._free == [huge] and big.closed


def test_the_tier_pools_a_buffer_per_concurrent_writer(tmp_path):
    tier = make_tier(tmp_path, fill_workers=3, warm_workers=5)
    assert tier.direct.keep == 3 + 5


def test_the_tier_writes_with_o_direct_by_default(tmp_path, monkeypatch):
    seen = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, flags, mode=0o777: seen.append(bool(flags & os.O_DIRECT))
                        or real_open(path, flags, mode))
    for direct_io in (True, False):
        tier = make_tier(tmp_path / str(direct_io), direct_io=direct_io)

        async def body(tier=tier):
            seen.clear()
            assert await tier.fill(key(1), blob(1))
            assert tier.read(key(1), 0, len(blob(1))) == blob(1)
        serve(tier, body)
        assert (True in seen) is direct_io
        assert tier.stats()["writes"] == ("O_DIRECT" if direct_io else "buffered")


def test_open_data_gives_a_descriptor_and_where_the_data_starts(tmp_path):
    """The loader channel's entry: a block file's data starts after its header, an exact file's
    at 0; a length its header does not say, or a block the tier lacks, gives None."""
    for exact in (False, True):
        t = make_tier(tmp_path / str(exact), exact_files=exact)
        small = BlockKey("s3://bucket", "s.bin", "v1", BS, 0)

        async def body(t=t, small=small):
            assert await t.fill(key(1), blob(1))
            assert await t.fill(small, blob(7, 1000))
        serve(t, body)
        for k, data in ((key(1), blob(1)), (small, blob(7, 1000))):
            fd, offset = t.open_data(k, len(data))
            try:
                assert os.pread(fd, len(data) + 1, offset) == data
                assert offset == (0 if exact and k is small else block_format.HEADER_ALIGN)
            finally:
                os.close(fd)
        assert t.open_data(key(1), BS - 1) is None and t.open_data(key(2), BS) is None


# ---- whole-object files (FUSE passthrough of a large object) --------------------------------

def large_keys(n: int) -> list[BlockKey]:
    return [BlockKey("s3://bucket", "ckpt/model.bin", "v1", BS, i) for i in range(n)]


@pytest.mark.parametrize("direct", [True, False])
def test_a_cached_object_is_assembled_into_one_exact_file_verified(tmp_path, direct):
    keys, tail = large_keys(5), 1234
    parts = [blob(100 + i) for i in range(4)] + [blob(104, tail)]
    whole = BlockKey("s3://bucket", "ckpt/model.bin", "v1", BS, -1)
    t = make_tier(tmp_path, exact_files=True, direct_io=direct)

    async def body():
        for k, data in zip(keys, parts, strict=True):
            assert await t.fill(k, data)
        assert await t.assemble(whole, keys, 4 * BS + tail)
        assert not await t.assemble(whole, keys, 4 * BS + tail)      # there already
    serve(t, body)
    path = block_file(tmp_path, whole)
    assert path.read_bytes() == b"".join(parts)
    header = block_format.exact_header(os.open(path, os.O_RDONLY))
    assert (header.data_len, header.chunk_size, header.length) == (4 * BS + tail, BS, 0)
    header.verify(0, memoryview(path.read_bytes()))                 # the chunk digests are of the whole
    assert t.stats()["used_bytes"] == t.file_size(4 * BS + tail)    # the blocks went: its bytes once
    assert not any(t.contains(k) or block_file(tmp_path, k).exists() for k in keys)
    assert metric(t, "cachefs_whole_files_total", result="assembled") == 1


def test_a_whole_file_the_device_refuses_to_write_direct_is_written_buffered(tmp_path, monkeypatch):
    """EINVAL at the first O_DIRECT write of a whole file: it is written again buffered, right,
    no temp file left, and the device is not asked for O_DIRECT again (as for block files)."""
    keys, tail = large_keys(3), 999
    parts = [blob(200 + i) for i in range(2)] + [blob(202, tail)]
    whole = BlockKey("s3://bucket", "ckpt/model.bin", "v1", BS, -1)
    t = make_tier(tmp_path, exact_files=True, direct_io=True)

    async def fill():
        for k, data in zip(keys, parts, strict=True):
            assert await t.fill(k, data)
    serve(t, fill)
    real_pwritev, refused = os.pwritev, []

    def pwritev(fd, buffers, offset):
        if os.get_blocking(fd) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwritev(fd, buffers, offset)
    monkeypatch.setattr(os, "pwritev", pwritev)

    async def assemble():
        assert await t.assemble(whole, keys, 2 * BS + tail)
    serve(t, assemble)
    assert refused == [0]
    assert block_file(tmp_path, whole).read_bytes() == b"".join(parts)
    assert t.stats()["writes"] == "buffered (O_DIRECT refused)"
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_held_blocks_stay_beside_the_whole_file_and_go_first(tmp_path):
    keys = large_keys(3)
    whole = BlockKey("s3://bucket", "ckpt/model.bin", "v1", BS, -1)
    t = make_tier(tmp_path, exact_files=True)

    async def body():
        for i, k in enumerate(keys):
            assert await t.fill(k, blob(300 + i))
        t.pin("ds", {keys[1].digest()})
        assert await t.assemble(whole, keys, 3 * BS)
    serve(t, body)
    assert [t.contains(k) for k in keys] == [False, True, False]       # the pinned one stays
    assert t.stats()["used_bytes"] == FILE + t.file_size(3 * BS)
    t.unpin("ds")
    assert t._index.victim() == keys[1].digest()                      # and is the first to go


def test_a_corrupt_or_missing_block_means_no_whole_file(tmp_path):
    keys = large_keys(3)
    whole = BlockKey("s3://bucket", "ckpt/model.bin", "v1", BS, -1)
    t = make_tier(tmp_path, exact_files=True)

    async def body():
        for i, k in enumerate(keys[:2]):
            assert await t.fill(k, blob(200 + i))
        assert not await t.assemble(whole, keys, 3 * BS)             # block 2 not cached: nothing to do
        assert await t.fill(keys[2], blob(202))
        data = bytearray(block_file(tmp_path, keys[1]).read_bytes())
        data[-1] ^= 1
        block_file(tmp_path, keys[1]).write_bytes(bytes(data))
        assert not await t.assemble(whole, keys, 3 * BS)
    serve(t, body)
    assert not block_file(tmp_path, whole).exists()
    assert not list((tmp_path / "tmp").iterdir())                    # no temp file left behind
    assert metric(t, "cachefs_whole_files_total", result="failed") == 1


def test_whole_files_of_huge_objects_keep_their_header_small():
    assert block_format.whole_chunk_size(1 << 30, 4 << 20) == 4 << 20                  # 256 chunks
    assert block_format.whole_chunk_size(10 << 30, 4 << 20) == 32 << 20               # 320 chunks
    for size in (1, 5 << 30, 100 << 30, 800 << 30):
        chunk = block_format.whole_chunk_size(size, 4 << 20)
        header = BlockHeader.encode_digests(size, chunk, [0] * -(-size // chunk))
        assert len(header) <= 3616 and chunk % (4 << 20) == 0
    assert block_format.whole_chunk_size(1 << 40, 4 << 20) is None                    # > 896 GiB: no whole file


def test_demote_makes_an_entry_the_next_victim():
    from cachefs.tiers.disk.index import Entry, SegmentedLRU
    lru = SegmentedLRU(1 << 30)
    for d in "abcd":
        lru.add(d, Entry(10, 10))
    lru.touch("c")                                                  # protected
    lru.demote("c")
    assert lru.victim() == "c" and lru.protected_bytes == 0
    lru.demote("d")
    assert lru.victim() == "d"
