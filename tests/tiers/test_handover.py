"""The cache files handed to the kernel (FUSE passthrough), without a kernel: verified before the
first hand-over, held while handed over, and re-verified by a paced background scrub that goes
round every handed-over file (small exact files and whole-object files) and drops a corrupt one."""

import os
import random

import trio

from cachefs.metrics import Metrics
from cachefs.tiers import handover as handover_module
from cachefs.tiers.disk import DiskTier
from cachefs.tiers.handover import HandOver
from cachefs.tiers.key import WHOLE, BlockKey

BS = 64 << 10


def key(path: str, index: int = 0) -> BlockKey:
    return BlockKey("s3://b", path, "v1", BS, index)


def test_the_scrub_goes_round_every_handed_over_file_and_drops_a_corrupt_one(tmp_path, monkeypatch):
    monkeypatch.setattr(handover_module, "SCRUB_AGE", 0.0)
    metrics = Metrics()
    disk = DiskTier(tmp_path, capacity=64 << 20, free_space_ratio=0.0, metrics=metrics, fsync=False,
                    chunk_size=4096, exact_files=True)
    hand = HandOver(disk, metrics, scrub_bytes_s=64 << 20)
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
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_the_scrub_paces_itself_inside_a_large_file(tmp_path, monkeypatch):
    """A whole-object file is re-read at the scrub's rate, step by step, not in one go."""
    monkeypatch.setattr(handover_module, "_VERIFY_STEP", BS)
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
            from cachefs.tiers.disk import format as fmt
            header = fmt.exact_header(fd)
            began = trio.current_time()
            await hand._verify(fd, header, hand.scrub_bytes_s)
            os.close(fd)
            assert trio.current_time() - began >= 1.9                  # 8 steps at 4 a second
            nursery.cancel_scope.cancel()
    trio.run(main)
