"""Fault campaign: readers on a real mount read a dataset over and over through
testing/latency_proxy.py while it injects a seeded random schedule of every fault it knows (503
SlowDown with Retry-After, 500, resets before and mid-body, stalls before and mid-body, slow first
byte, truncated bodies, wrong Content-Range) plus server restarts. Every byte read is compared with
the source. Pass: 0 wrong bytes, reads keep flowing (only EIO, from exhausted retries, may fail a
read), no read waits past its budget: max_attempts x (connect + read timeout) + backoff + the
Retry-After waits, plus slack for a busy 2-CPU machine.

The caches are kept small (a 1 MiB disk tier, two memory blocks, the kernel's pages dropped after
each file) so most reads go to the store.
``FAULT_CAMPAIGN_SECONDS`` (default 35) sets how long the readers run; figures are printed
(``pytest -s``) and recorded in docs/reliability.md."""

import errno
import json
import os
import random
import threading
import time
from urllib.parse import urlparse

import pytest
from mounts import put_tree

from testing.latency_proxy import FAULT_KINDS, LatencyProxy
from testing.s3 import s3_client

pytestmark = pytest.mark.fuse

BLOCK = 256 << 10
CONNECT, READ, ATTEMPTS = 1.0, 2.0, 4
SLOW_FIRST_BYTE = 0.5
# retries' backoff caps 0.05 + 0.1 + 0.2 s; a SlowDown may ask 1 s per retry; 3 s of slack. A refused or
# reset connection is retried past the attempts only within min(5 s, READ) of the first attempt (a
# restarting server): at most READ + 0.5 s of backoff + one attempt, inside this budget
BUDGET = ATTEMPTS * (CONNECT + READ) + 0.35 + (ATTEMPTS - 1) * 1.0 + 3.0
SECONDS = float(os.environ.get("FAULT_CAMPAIGN_SECONDS", "35"))


def dataset() -> dict[str, bytes]:
    rng = random.Random(5)
    files = {f"small/s{i}.bin": rng.randbytes(rng.randrange(1, 200_000)) for i in range(12)}
    files.update({f"big/b{i}.bin": rng.randbytes(rng.randrange(BLOCK, 5 * BLOCK)) for i in range(4)})
    return files


class Readers:
    """Threads that read random files in 256 KiB preads and compare every byte."""

    def __init__(self, root, files: dict[str, bytes], stop: threading.Event):
        self.root, self.files, self.stop = root, files, stop
        self.lock = threading.Lock()
        self.tally = {"reads": 0, "bytes": 0, "wrong_bytes": 0, "failed_reads": 0, "max_latency": 0.0}
        self.other_errors: list[str] = []

    def run(self, seed: int) -> None:
        rng = random.Random(seed)
        names = sorted(self.files)
        while not self.stop.is_set():
            name = rng.choice(names)
            try:
                self.read_file(name)
            except OSError as exc:
                self.note_error(name, exc)

    def read_file(self, name: str) -> None:
        want = self.files[name]
        fd = os.open(self.root / name, os.O_RDONLY)
        try:
            for offset in range(0, max(len(want), 1), BLOCK):
                started = time.monotonic()
                try:
                    got = os.pread(fd, BLOCK, offset)
                finally:
                    self.note_latency(time.monotonic() - started)
                self.note_read(got, want[offset:offset + BLOCK])
        finally:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)    # the next read asks the daemon again
            os.close(fd)

    def note_latency(self, seconds: float) -> None:
        with self.lock:
            self.tally["max_latency"] = max(self.tally["max_latency"], seconds)

    def note_read(self, got: bytes, want: bytes) -> None:
        wrong = sum(a != b for a, b in zip(got, want, strict=False)) + abs(len(got) - len(want)) \
            if got != want else 0
        with self.lock:
            self.tally["reads"] += 1
            self.tally["bytes"] += len(got)
            self.tally["wrong_bytes"] += wrong

    def note_error(self, name: str, exc: OSError) -> None:
        with self.lock:
            if exc.errno == errno.EIO:
                self.tally["failed_reads"] += 1
            else:
                self.other_errors.append(f"{name}: {exc!r}")


@pytest.mark.allow_warnings       # retries and failed GETs are logged
def test_reads_under_random_faults_are_exact_and_bounded(s3_server, bucket, mount_factory):
    files = dataset()
    put_tree(s3_client(s3_server.endpoint_url), bucket, "", files)
    url = urlparse(s3_server.endpoint_url)
    with LatencyProxy(url.hostname, url.port, latency=0.002, seed=11) as proxy:
        mnt = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint_url, "--block-size", str(BLOCK),
                            "--mem-cache-size", str(2 * BLOCK), "--cache-size", "1M", "--metadata-ttl", "3600",
                            "--connect-timeout", str(CONNECT), "--read-timeout", str(READ),
                            "--max-attempts", str(ATTEMPTS), "--read-only").start()
        for name in files:                       # lookups and listings before the faults
            assert (mnt / name).stat().st_size == len(files[name])
        proxy.set_slow_first_byte(SLOW_FIRST_BYTE)
        proxy.random_faults(0.12, FAULT_KINDS)
        stop = threading.Event()
        readers = Readers(mnt.path, files, stop)
        threads = [threading.Thread(target=readers.run, args=(seed,)) for seed in range(6)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + SECONDS
        restarts = 0
        while time.monotonic() < deadline:
            time.sleep(min(7.0, max(0.0, deadline - time.monotonic())))
            if time.monotonic() < deadline - 2:
                proxy.restart(0.5)
                restarts += 1
        stop.set()
        for thread in threads:
            thread.join(timeout=BUDGET * 4)
        proxy.clear_faults()
        stats = proxy.stats()
        for name, data in files.items():          # the mount is healthy afterwards
            assert (mnt / name).read_bytes() == data
    figures = {**readers.tally, "faults": stats["faults"], "faults_total": stats["faults_total"],
               "restarts": restarts, "requests": stats["requests"], "budget_s": BUDGET,
               "read_timeout_s": READ, "max_attempts": ATTEMPTS, "seconds": SECONDS}
    print("fault campaign:", json.dumps(figures))
    assert readers.other_errors == [], readers.other_errors[:10]
    assert readers.tally["wrong_bytes"] == 0
    assert readers.tally["max_latency"] <= BUDGET
    assert readers.tally["reads"] >= 50 and readers.tally["failed_reads"] <= readers.tally["reads"] * 0.05
    assert set(stats["faults"]) == set(FAULT_KINDS), stats["faults"]     # every kind was injected


# ---- what the campaign found: one fault of these kinds fails a read (see docs/reliability.md) -----
def one_fault_mount(s3_server, bucket, mount_factory, proxy, size: int = 3 * BLOCK):
    """A mount through ``proxy`` of one file of ``size`` bytes."""
    files = {"f.bin": random.Random(9).randbytes(size)}
    put_tree(s3_client(s3_server.endpoint_url), bucket, "", files)
    mnt = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint_url, "--block-size", str(BLOCK),
                        "--connect-timeout", str(CONNECT), "--read-timeout", str(READ),
                        "--max-attempts", str(ATTEMPTS), "--read-only").start()
    assert (mnt / "f.bin").stat().st_size == len(files["f.bin"])
    return mnt, files["f.bin"]


@pytest.mark.allow_warnings
@pytest.mark.parametrize("kind", ["reset-body", "truncate", "stall-body"])
def test_one_fault_is_retried(s3_server, bucket, mount_factory, kind):
    url = urlparse(s3_server.endpoint_url)
    with LatencyProxy(url.hostname, url.port, latency=0.0) as proxy:
        mnt, data = one_fault_mount(s3_server, bucket, mount_factory, proxy)
        proxy.fail_next(1, kind)
        started = time.monotonic()
        assert (mnt / "f.bin").read_bytes() == data
        assert time.monotonic() - started <= BUDGET
        assert proxy.stats()["faults"] == {kind: 1}


@pytest.mark.allow_warnings
def test_one_wrong_content_range_is_retried(s3_server, bucket, mount_factory):
    url = urlparse(s3_server.endpoint_url)
    with LatencyProxy(url.hostname, url.port, latency=0.0) as proxy:
        mnt, data = one_fault_mount(s3_server, bucket, mount_factory, proxy, size=2 * BLOCK)
        proxy.fail_next(1, "wrong-range")              # the first ranged GET: block 0
        assert (mnt / "f.bin").read_bytes() == data    # the kernel may retry a failed page itself
        assert proxy.stats()["faults"] == {"wrong-range": 1}
        failed = [line for line in (mnt.cache_dir / "cachefs.log").read_text().splitlines()
                  if "ERROR cachefs.fuse_ops" in line]
        assert failed == []                            # no FUSE read failed with EIO


@pytest.mark.allow_warnings
def test_a_one_second_server_restart_is_ridden_out(s3_server, bucket, mount_factory):
    url = urlparse(s3_server.endpoint_url)
    with LatencyProxy(url.hostname, url.port, latency=0.0) as proxy:
        mnt, data = one_fault_mount(s3_server, bucket, mount_factory, proxy)
        proxy.restart(1.0)
        assert (mnt / "f.bin").read_bytes() == data
