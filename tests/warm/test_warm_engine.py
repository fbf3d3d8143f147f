"""The warm engine without a kernel: Warmer over a Vfs and the Tiers (memory and disk) on a
memory:// store; plus the disk tier's holds and pins and the glob matcher."""

import time

import pytest
import trio
from kernel_free import build_vfs
from memory_stores import BS, blob, bucket_mem, make_cache  # noqa: F401  (fixture)

from cachefs.metrics import Metrics
from cachefs.tiers.cache import FileVersion
from cachefs.tiers.disk import DiskTier
from cachefs.tiers.disk.index import Entry, SegmentedLRU
from cachefs.warm.engine import Warmer
from cachefs.warm.globs import glob_regex, static_dir
from cachefs.warm.job import WarmSpec


def run_with(bucket, tmp_path, body, *, capacity: int = 64 << 20):
    async def main():
        metrics = Metrics()
        store = bucket.store()
        disk = DiskTier(tmp_path / "blocks", capacity=capacity, free_space_ratio=0.0, metrics=metrics, fsync=False)
        blocks = make_cache(store, metrics, disk)
        pre = Warmer(build_vfs(store, blocks, ttl=3600).catalog, blocks, store, metrics, max_concurrency=8)
        async with trio.open_nursery() as nursery:
            await nursery.start(blocks.run)                 # runs the disk tier too
            await nursery.start(pre.run)
            await body(store, blocks, disk, pre)
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_an_object_changed_during_warmup_is_cached_at_its_new_version(bucket_mem, tmp_path):
    old, new = blob(1, 3 * BS + 5), blob(2, 2 * BS + 9)
    bucket_mem.put("ds/a.bin", old)
    bucket_mem.put("ds/b.bin", blob(3, 100))

    async def body(store, blocks, disk, pre):
        first = store.hold("get", lambda path, start, end: path == "ds/a.bin" and start == BS)
        job = pre.start(WarmSpec(paths=("ds",)), concurrency=1)
        await first.wait_reached()
        bucket_mem.put("ds/a.bin", new)            # changes while block 1 of the old version is in flight
        time.sleep(0.01)
        first.open()
        await job.done.wait()
        assert job.state == "done" and not job.failures
        version = bucket_mem.version(store, "ds/a.bin")
        assert version.size == len(new)
        for index in range(3):
            assert disk.contains(blocks.key(version, index))
        gets = len(store.gets)
        assert await blocks.read(version, 0, len(new)) == new
        assert len(store.gets) == gets                  # served from the disk tier
        old_version = FileVersion("ds/a.bin", "", len(old))
        assert not any(block.disk for block in blocks.check(old_version))
        assert pre.catalog.cached("ds").files["a.bin"].etag == version.etag     # the listing shows the new one

    run_with(bucket_mem, tmp_path, body)


def test_check_counts_per_tier_and_evict_drops(bucket_mem, tmp_path):
    for i in range(3):
        bucket_mem.put(f"ds/f{i}.bin", blob(i, 2 * BS))

    async def body(store, blocks, disk, pre):
        version = bucket_mem.version(store, "ds/f0.bin")
        await blocks.read(version, 0, 100)              # part of block 0 of f0: memory + disk
        await disk.wait_idle()
        files, missing = await pre.resolve(WarmSpec(paths=("ds",)))
        check = pre.check(files, missing)
        assert (check["files"], check["cached_files"], check["cached_bytes"]) == (3, 0, BS)
        assert check["memory"]["blocks"] == check["disk"]["blocks"] == 1
        job = pre.start(WarmSpec(paths=("ds",)))
        await job.done.wait()
        assert (job.fetched_files, job.fetched_bytes, job.done_bytes) == (3, 5 * BS, 6 * BS)
        check = pre.check(*await pre.resolve(WarmSpec(paths=("ds",))))
        assert check["disk"] == {"files": 3, "blocks": 6, "bytes": 6 * BS}
        async for reply in pre._evict_command({"paths": ["ds"]}):
            assert reply["blocks"] == 6
        check = pre.check(*await pre.resolve(WarmSpec(paths=("ds",))))
        assert check["cached_bytes"] == 0

    run_with(bucket_mem, tmp_path, body)


def test_a_pinned_dataset_is_never_evicted(bucket_mem, tmp_path):
    for i in range(4):
        bucket_mem.put(f"ds/f{i}.bin", blob(i, BS))
        bucket_mem.put(f"other/f{i}.bin", blob(10 + i, BS))

    async def body(store, blocks, disk, pre):
        job = pre.start(WarmSpec(paths=("ds",)), pin=True)
        await job.done.wait()
        assert job.state == "done" and disk.stats()["held_bytes"] == 4 * disk.file_size(BS)
        for i in range(4):                               # other traffic fills the rest, and more
            await blocks.read(bucket_mem.version(store, f"other/f{i}.bin"), 0, BS)
            await disk.wait_idle()
        check = pre.check(*await pre.resolve(WarmSpec(paths=("ds",))))
        assert check["disk"]["files"] == 4
        assert disk.unpin(WarmSpec(paths=("ds",)).name)
        assert disk.stats()["held_bytes"] == 0

    run_with(bucket_mem, tmp_path, body, capacity=6 * (BS + 4096))


def test_segmented_lru_holds():
    lru = SegmentedLRU(1 << 20)
    for name in "abc":
        lru.add(name, Entry(10, 10))
    lru.hold("a")
    lru.hold("a")
    lru.hold("z")                                        # a hold may come before its entry
    lru.add("z", Entry(5, 5))
    assert lru.held_bytes == 15 and lru.victim() == "b"
    lru.touch("a")
    lru.release("a")
    assert lru.victim() == "b" and lru.is_held("a")
    lru.release("a")
    assert not lru.is_held("a") and lru.held_bytes == 5
    lru.remove("b"), lru.remove("c"), lru.remove("a")
    assert lru.victim() is None and len(lru) == 1 and lru.bytes == 5


@pytest.mark.parametrize("pattern, path, matches", [
    ("train/*.jpg", "train/a.jpg", True),
    ("train/*.jpg", "train/x/a.jpg", False),
    ("train/**/*.jpg", "train/x/y/a.jpg", True),
    ("train/**/*.jpg", "train/a.jpg", True),
    ("train/c[01]/*", "train/c1/z", True),
    ("train/c[!01]/*", "train/c1/z", False),
    ("**", "any/thing", True),
    ("t?ain/a", "train/a", True),
])
def test_glob_regex(pattern, path, matches):
    assert bool(glob_regex(pattern).match(path)) is matches


def test_static_dir_and_spec_names():
    assert static_dir("train/c*/x.jpg") == "train"
    assert static_dir("*.jpg") == ""
    assert WarmSpec(paths=("a", "b")).name == WarmSpec(paths=("b", "a")).name
    assert WarmSpec.from_args({"paths": ["./a/", "a"]}, None).paths == ("a",)
    with pytest.raises(ValueError):
        WarmSpec.from_args({"paths": ["../etc"]}, None)
