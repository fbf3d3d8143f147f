"""The cache files handed to the kernel (FUSE passthrough), without a kernel: verified before the
first hand-over, held while handed over, and re-verified by a paced background scrub that goes
round every handed-over file (small exact files and whole-object files) and drops a corrupt one."""

import errno
import logging
import os
import random
import time

import pytest
import trio
from mounts import ramfs

from cachefs.errors import CorruptBlock, NeedsWait
from cachefs.metrics import Metrics
from cachefs.ports import Port
from cachefs.tiers import handover as handover_module
from cachefs.tiers.disk import DiskTier
from cachefs.tiers.disk import format as fmt
from cachefs.tiers.handover import HandOver
from cachefs.tiers.key import WHOLE, BlockKey

BS = 64 << 10


def key(path: str, index: int = 0) -> BlockKey:
    return BlockKey("s3://b", path, "v1", BS, index)


def scrubbing(tmp_path, rate: int) -> tuple[Metrics, DiskTier, HandOver, list[str]]:
    """A disk tier with no seals (every file verified at its hand-over) and a hand-over scrubbing
    at ``rate`` bytes a second; the digests it names corrupt are appended to the list."""
    metrics = Metrics()
    disk = DiskTier(tmp_path, capacity=64 << 20, free_space_ratio=0.0, metrics=metrics, fsync=False,
                    chunk_size=4096, exact_files=True, seals=False)
    named = []
    corrupted = Port("corrupted")
    corrupted.connect(named.append)
    return metrics, disk, HandOver(disk, metrics, scrub_bytes_s=rate, corrupted=corrupted), named


def test_the_scrub_goes_round_every_handed_over_file_and_drops_a_corrupt_one(tmp_path, monkeypatch):
    monkeypatch.setattr(handover_module, "SCRUB_AGE", 0.0)
    metrics, disk, hand, named = scrubbing(tmp_path, 64 << 20)
    small = {f"s{i}": random.Random(i).randbytes(1000 + 37 * i) for i in range(6)}
    big = [random.Random(99 + i).randbytes(BS) for i in range(3)]
    whole = key("big", WHOLE)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(disk.run)
            for name, data in small.items():
                assert await disk.fill(key(name), data)
            for i, data in enumerate(big):
                assert await disk.fill(key("big", i), data)
            assert await disk.assemble(whole, [key("big", i) for i in range(3)], 3 * BS)
            for name, data in small.items():              # verified, handed over, released
                exact = await hand.get(key(name), len(data))
                assert exact is not None
                os.close(exact.fd)
                hand.release(exact)
            exact = await hand.get(whole, 3 * BS)
            assert exact is not None and os.pread(exact.fd, 3 * BS, 0) == b"".join(big)
            os.close(exact.fd)
            hand.release(exact)
            verified = metrics.counter_value("cachefs_scrub_files_total", result="ok")
            assert verified == len(small) + 1
            victim = disk.layout.block_path(key("s5").digest())       # the last one in turn
            data = bytearray(victim.read_bytes())
            data[10] ^= 1
            with open(victim, "r+b") as f:
                f.write(data)
            await nursery.start(hand.scrub)
            with trio.fail_after(20):
                while not metrics.counter_value("cachefs_scrub_files_total", result="corrupt"):
                    await trio.sleep(0.05)
            assert metrics.counter_value("cachefs_scrub_files_total", result="ok") >= verified + len(small) - 1
            with trio.fail_after(20):                      # and on to the whole-object file after it
                while metrics.counter_value("cachefs_scrub_files_total", result="ok") < verified + len(small):
                    await trio.sleep(0.05)
            assert not disk.contains(key("s5")) and disk.contains(whole) and disk.contains(key("s0"))
            assert named == [key("s5").digest()]          # the FUSE layer is told (its backing goes)
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_the_scrub_checks_small_files_many_to_a_thread_call_at_its_rate(tmp_path, monkeypatch):
    """Small files are checked a batch of up to VERIFY_STEP bytes per worker-thread call (a call
    per file cost more CPU than the checking); a file larger than that ends its batch and is
    checked step by step; a corrupt small file is dropped and named, an evicted one forgotten;
    the pass as a whole keeps to the scrub's rate."""
    monkeypatch.setattr(handover_module, "SCRUB_AGE", 0.0)
    monkeypatch.setattr(fmt, "VERIFY_STEP", 16 << 10)
    calls = []
    check = HandOver._check_small
    monkeypatch.setattr(HandOver, "_check_small", lambda self, *a: calls.append(a[1]) or check(self, *a))
    rate = 256 << 10
    metrics, disk, hand, named = scrubbing(tmp_path, rate)
    small = {f"s{i:02d}": random.Random(i).randbytes(1000 + 7 * i) for i in range(40)}
    big = [random.Random(99 + i).randbytes(BS) for i in range(3)]
    whole = key("big", WHOLE)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(disk.run)
            for name, data in list(small.items())[:20]:
                assert await disk.fill(key(name), data)
            for i, data in enumerate(big):
                assert await disk.fill(key("big", i), data)
            assert await disk.assemble(whole, [key("big", i) for i in range(3)], 3 * BS)
            for name, data in list(small.items())[20:]:
                assert await disk.fill(key(name), data)
            for k, size in [(key(name), len(data)) for name, data in small.items()] + [(whole, 3 * BS)]:
                exact = await hand.get(k, size)
                assert exact is not None
                os.close(exact.fd)
                hand.release(exact)
            before = metrics.counter_value("cachefs_scrub_files_total", result="ok")
            victim = disk.layout.block_path(key("s07").digest())
            data = bytearray(victim.read_bytes())
            data[100] ^= 1
            victim.write_bytes(data)
            os.unlink(disk.layout.block_path(key("s30").digest()))      # gone under the scrub
            began = trio.current_time()
            await nursery.start(hand.scrub)
            want = before + len(small) - 2 + 1
            with trio.fail_after(30):
                while metrics.counter_value("cachefs_scrub_files_total", result="ok") < want:
                    await trio.sleep(0.02)
            took = trio.current_time() - began - 1.0        # (the scrub's first second of rest)
            nursery.cancel_scope.cancel()
        checked = sum(len(d) for d in small.values()) - len(small["s30"]) + 3 * BS
        assert took >= 0.8 * checked / rate, took
        assert named == [key("s07").digest()] and not disk.contains(key("s07"))
        assert key("s30").digest() not in hand._verified and disk.contains(whole)
        assert len(calls) <= 5 < len(small), calls        # 39 small files of ~1.1 KiB, 16 KiB a call
    trio.run(main)


def test_the_scrub_paces_itself_inside_a_large_file(tmp_path, monkeypatch):
    """A whole-object file is re-read at the scrub's rate, step by step, not in one go."""
    monkeypatch.setattr(fmt, "VERIFY_STEP", BS)
    metrics = Metrics()
    disk = DiskTier(tmp_path, capacity=64 << 20, free_space_ratio=0.0, metrics=metrics, fsync=False,
                    chunk_size=4096, exact_files=True)
    hand = HandOver(disk, metrics, scrub_bytes_s=4 * BS)         # 4 blocks a second
    whole = key("big", WHOLE)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(disk.run)
            blocks = [key("big", i) for i in range(8)]
            for i, k in enumerate(blocks):
                assert await disk.fill(k, random.Random(i).randbytes(BS))
            assert await disk.assemble(whole, blocks, 8 * BS)
            fd = os.open(disk.layout.block_path(whole.digest()), os.O_RDONLY)
            header = fmt.exact_header(fd)
            began = trio.current_time()
            await hand._verify(fd, header, hand.scrub_bytes_s)
            os.close(fd)
            assert trio.current_time() - began >= 1.9                  # 8 steps at 4 a second
            nursery.cancel_scope.cancel()
    trio.run(main)


@pytest.mark.allow_warnings          # the corrupt file is logged
def test_files_sealed_as_written_are_handed_over_unread_and_a_changed_one_is_verified(tmp_path):
    """The disk tier reads each exact file back as it writes it and seals it: this daemon and a
    later one (the same boot) hand it over with no read (``now`` answers at once); the later one
    queues it for the scrub. A file written to since its seal is read and checked first (and
    dropped, being corrupt); with seals off every file is verified before its hand-over."""
    small = {f"s{i}": random.Random(i).randbytes(1000 + 37 * i) for i in range(4)}

    def tier(metrics, seals=True):
        return DiskTier(tmp_path, capacity=64 << 20, free_space_ratio=0.0, metrics=metrics, fsync=False,
                        chunk_size=4096, exact_files=True, seals=seals)

    async def daemon(seals: bool = True, fill: bool = False):
        metrics = Metrics()
        disk = tier(metrics, seals)
        hand = HandOver(disk, metrics)
        async with trio.open_nursery() as nursery:
            await nursery.start(disk.run)
            handed = {}
            for name, data in small.items():
                if fill:
                    assert await disk.fill(key(name), data)
                try:
                    exact = hand.now(key(name), len(data))
                except NeedsWait:
                    exact = await hand.get(key(name), len(data))
                if exact is not None:
                    handed[name] = os.pread(exact.fd, len(data) + 1, 0)
                    os.close(exact.fd)
                    hand.release(exact)
            nursery.cancel_scope.cancel()
        if disk.seals is not None:
            disk.seals.close()
        return metrics, hand, handed

    def count(metrics, result):
        return metrics.counter_value("cachefs_scrub_files_total", result=result)

    metrics, hand, handed = trio.run(daemon, True, True)            # written, read back, sealed
    assert handed == small and count(metrics, "sealed") == len(small) and count(metrics, "ok") == 0
    assert all(when > time.monotonic() - 60 for when in hand._verified.values())   # checked just now
    metrics, hand, handed = trio.run(daemon)                          # a later daemon
    assert handed == small and count(metrics, "sealed") == len(small) and count(metrics, "ok") == 0
    assert set(hand._verified) == {key(n).digest() for n in small}        # queued for the scrub at once
    assert all(when <= time.monotonic() - handover_module.SCRUB_AGE for when in hand._verified.values())

    victim = DiskTier(tmp_path, capacity=64 << 20, free_space_ratio=0.0, metrics=Metrics(),
                      exact_files=True, seals=False).layout.block_path(key("s2").digest())
    with open(victim, "r+b") as fh:                      # one byte flipped in place: a new ctime
        fh.seek(7)
        byte = fh.read(1)
        fh.seek(7)
        fh.write(bytes([byte[0] ^ 1]))
    metrics, hand, handed = trio.run(daemon)
    assert handed == {n: d for n, d in small.items() if n != "s2"}         # never the changed file
    assert count(metrics, "sealed") == len(small) - 1
    assert metrics.counter_value("cachefs_corrupt_blocks_total") >= 1

    metrics, hand, handed = trio.run(daemon, False)
    assert hand.seals is None and handed == {n: d for n, d in small.items() if n != "s2"}
    assert count(metrics, "sealed") == 0 and count(metrics, "ok") == len(small) - 1


@pytest.mark.allow_warnings          # the dropped fill is logged
def test_an_exact_file_that_does_not_read_back_as_written_is_dropped_not_sealed(tmp_path):
    """A writer that publishes other bytes than it was given (a bug, a lying device): the read-back
    check fails, the file is unlinked, the fill is not cached and nothing is sealed."""
    metrics = Metrics()
    disk = DiskTier(tmp_path, capacity=64 << 20, free_space_ratio=0.0, metrics=metrics, fsync=False,
                    chunk_size=4096, exact_files=True, direct_io=False)
    honest = disk._write_file

    def lying(doomed, tmp, final, data, *args, **kwargs):
        real_publish = fmt._publish

        def publish(tmp_, final_, write):
            real_publish(tmp_, final_, write)
            with open(final_, "r+b") as fh:           # one byte changed after the header was set
                fh.write(b"\xff" if data[:1] != b"\xff" else b"\x00")
        fmt._publish = publish
        try:
            return honest(doomed, tmp, final, data, *args, **kwargs)
        finally:
            fmt._publish = real_publish

    disk._write_file = lying
    data = random.Random(5).randbytes(3000)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(disk.run)
            assert not await disk.fill(key("bad"), data)
            assert not disk.contains(key("bad")) and len(disk.seals) == 0
            assert not disk.layout.block_path(key("bad").digest()).exists()
            disk._write_file = honest
            assert await disk.fill(key("good"), data)
            assert disk.contains(key("good")) and len(disk.seals) == 1
            nursery.cancel_scope.cancel()
    trio.run(main)


@pytest.mark.parametrize("direct_reads", [True, False])
def test_the_read_back_checks_around_the_page_cache_or_buffered_where_o_direct_is_refused(
        tmp_path, monkeypatch, direct_reads):
    """Written with O_DIRECT, an exact file is read back with O_DIRECT too; a file system that
    refuses O_DIRECT reads (EINVAL) gets the buffered check: either way a right file is sealed
    and a damaged one is unlinked, its error raised."""
    from cachefs.tiers.disk.direct import DirectWrites
    real_open, seen = os.open, []

    def opening(path, flags, *args):
        if flags & os.O_DIRECT and not flags & os.O_WRONLY:
            seen.append(path)
            if not direct_reads:
                raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)
    monkeypatch.setattr(os, "open", opening)
    direct = DirectWrites()
    data = random.Random(7).randbytes(300_000)            # three chunks and a tail
    sealed = []
    for name in ("good", "bad"):
        final = tmp_path / name
        fmt.write_block_file([], tmp_path / f"{name}.tmp", final, data, 128 << 10, False, direct, exact=True)
        if name == "bad":
            with open(final, "r+b") as fh:
                fh.seek(200_000)
                fh.write(b"\0")
        try:
            fmt.check_written(final, sealed.append, direct)
        except CorruptBlock:
            assert name == "bad" and not final.exists()
        else:
            assert name == "good" and final.read_bytes() == data
    assert len(sealed) == 1 and sealed[0].st_size == len(data)
    assert len(seen) == 2                                   # both read back O_DIRECT first


def test_a_disk_tier_on_a_filesystem_without_extended_attributes_writes_no_exact_files(tmp_path, caplog):
    """Found at start, before any write (ramfs here, which has no size either, so nothing is
    written to it): one log line, the fallback counted once, no exact files from then on."""
    caplog.set_level(logging.INFO, logger="cachefs.tiers.disk.tier")
    metrics = Metrics()

    async def main(root):
        disk = DiskTier(root, capacity=64 << 20, free_space_ratio=0.0, metrics=metrics, fsync=False,
                        exact_files=True, seals=False)
        async with trio.open_nursery() as nursery:
            await nursery.start(disk.run)
            assert not disk.exact_files
            assert not disk._exact(key("a"), b"x" * 5000)         # a small object: no exact file
            nursery.cancel_scope.cancel()
    with ramfs(tmp_path / "bare") as root:
        trio.run(main, root / "blocks")
    assert metrics.counter_value("cachefs_passthrough_fallbacks_total", reason="no_xattr") == 1
    assert sum("keeps no user extended attributes" in r.getMessage() for r in caplog.records) == 1
