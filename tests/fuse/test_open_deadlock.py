"""Bug 7 (docs/reliability.md): the first open of a small file whose block is on the disk tier pushes
its bytes into the kernel page cache (FUSE notify-store) before the open returns. If another reader
of that inode has a READ pending on the page, the kernel holds the page locked until the daemon
answers the READ; a notify-store issued on the daemon's only trio thread then waits for that lock
forever and every process on the mount hangs.

Here many threads open and read the same small files at the same moment on a fresh mount over a
warm disk tier (every first open preloads), a few rounds with a remount between them. A hang is
detected (the daemon asleep in the kernel, or the readers not done in time), the FUSE connection is
aborted so the test ends, and the test fails."""

import hashlib
import os
import random
import threading
import time
from pathlib import Path

import pytest
from mounts import put_tree

from testing.s3 import s3_client
from testing.stuck import abort_fuse_connection, blocked_in_kernel

pytestmark = pytest.mark.fuse

THREADS, FILES, ROUNDS = 12, 40, 3
HANG_S = 4.0            # asleep in the kernel this long: a deadlock, not I/O
ROUND_LIMIT_S = 60.0    # a round is seconds of work; this long means stuck


def dataset() -> dict[str, bytes]:
    rng = random.Random(7)
    return {f"d/f{i:03}.bin": rng.randbytes(rng.randrange(4_000, 120_000)) for i in range(FILES)}


def read_together(root: Path, files: dict[str, bytes], errors: list[str]) -> None:
    """THREADS threads open and read each file at the same moment (a barrier per file)."""
    barrier = threading.Barrier(THREADS)
    names = sorted(files)

    def reader() -> None:
        for name in names:
            try:
                barrier.wait(timeout=ROUND_LIMIT_S)
                with open(root / name, "rb") as fh:
                    got = fh.read()
                if hashlib.md5(got).digest() != hashlib.md5(files[name]).digest():
                    errors.append(f"{name}: wrong bytes")
            except threading.BrokenBarrierError:
                return
            except OSError as exc:
                errors.append(f"{name}: {exc!r}")
                barrier.abort()
                return

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    return threads


def watch(threads, pid: int, root: Path) -> str | None:
    """Wait for the readers; on a hang abort the FUSE connection and say where the daemon slept."""
    started, asleep_since = time.monotonic(), None
    while any(thread.is_alive() for thread in threads):
        time.sleep(0.2)
        where = blocked_in_kernel(pid)
        asleep_since = (asleep_since or time.monotonic()) if where else None
        stuck = asleep_since is not None and time.monotonic() - asleep_since >= HANG_S
        if stuck or time.monotonic() - started > ROUND_LIMIT_S:
            abort_fuse_connection(root)
            for thread in threads:
                thread.join(timeout=10)
            return f"daemon hung (asleep in the kernel in {where!r}); FUSE connection aborted"
    return None


def test_concurrent_first_opens_of_preloaded_files_never_hang(s3_server, bucket, mount_factory):
    files = dataset()
    put_tree(s3_client(s3_server.endpoint_url), bucket, "", files)
    mnt = mount_factory(f"s3://{bucket}", "--endpoint-url", s3_server.endpoint_url, "--read-only",
                        "--metadata-ttl", "3600", "--block-size", "256K").start()
    for name, data in files.items():                   # fill the disk tier
        assert (mnt / name).read_bytes() == data
    deadline = time.monotonic() + 20
    while mnt.status()["tiers"]["disk"]["blocks"] < FILES:
        assert time.monotonic() < deadline, "the disk tier was not filled"
        time.sleep(0.05)
    for _ in range(ROUNDS):
        mnt.umount()                                   # a new daemon: every first open preloads
        mnt.start()
        assert len(os.listdir(mnt / "d")) == FILES
        errors: list[str] = []
        hung = watch(read_together(mnt.path, files, errors), mnt.pid, mnt.path)
        assert hung is None, hung
        assert errors == [], errors[:5]
    assert mnt.requests("get") == 0                    # all served by the disk tier (and preloads)
