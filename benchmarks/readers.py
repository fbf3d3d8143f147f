"""Timed readers: N processes reading files, N threads reading S3 objects, one sequential stream.

Every reader gets the same static, interleaved slice of one shuffled order
(reader i takes entries i, i+N, i+2N, ...), the way a PyTorch DataLoader shards
indices over its workers, so the file rows and the boto3 rows read the same
objects in the same order.

File readers are processes, not threads: the hot epoch must reach well over
10,000 files/s, and one Python process doing open/readinto/close tops out near
that. Processes are forked and wait at a barrier before the clock starts, so
start-up is not timed. Each file is read to EOF with ``readinto`` into a
reused 1 MiB buffer (plain open/read/close, as a data loader does), its size is
checked against the manifest, and every ``verify_every``-th file is also
hashed (xxh3_64, ~20 GB/s: well under 1% of a cold or warm epoch).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from benchmarks.dataset import Entry, object_key

MiB = 1 << 20
BUF_SIZE = MiB


@dataclasses.dataclass
class Tally:
    files: int = 0
    bytes: int = 0
    errors: int = 0          # OSError / S3 errors
    bad_size: int = 0
    verified: int = 0
    bad_hash: int = 0
    first_error: str = ""

    def add(self, other: Tally) -> None:
        for f in ("files", "bytes", "errors", "bad_size", "verified", "bad_hash"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.first_error = self.first_error or other.first_error

    def error(self, text: str) -> None:
        self.errors += 1
        self.first_error = self.first_error or text


@dataclasses.dataclass
class Result:
    """One timed run."""

    name: str
    seconds: float
    tally: Tally

    @property
    def files_per_s(self) -> float:
        return self.tally.files / self.seconds if self.seconds else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.tally.bytes / self.seconds / 1e6 if self.seconds else 0.0

    @property
    def ok(self) -> bool:
        t = self.tally
        return not (t.errors or t.bad_size or t.bad_hash)

    def to_dict(self) -> dict:
        return {"name": self.name, "seconds": round(self.seconds, 4),
                "files_per_s": round(self.files_per_s, 1), "mb_per_s": round(self.mb_per_s, 1),
                **dataclasses.asdict(self.tally)}


def check(tally: Tally, entry: Entry, n: int, digest: str | None) -> None:
    tally.files += 1
    tally.bytes += n
    if n != entry.size:
        tally.bad_size += 1
        tally.first_error = tally.first_error or f"{entry.path}: {n} bytes, expected {entry.size}"
    if digest is not None:
        tally.verified += 1
        if digest != entry.xxh3:
            tally.bad_hash += 1
            tally.first_error = tally.first_error or f"{entry.path}: content differs from manifest"


# ---- files, in processes ---------------------------------------------------------------------------
def read_file(path: str, buf: memoryview, hasher, buffered: bool = False) -> int:
    """Read ``path`` whole into ``buf`` in pieces. ``buffered``: opened as PIL and torchvision's
    loaders open an image (``open(path, "rb")``: on CPython before 3.14 that asks the file
    ``isatty``, an ioctl each open, which a FUSE mount answers as a request of its own)."""
    n_total = 0
    with open(path, "rb") if buffered else open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            if hasher is not None:
                hasher.update(buf[:n])
            n_total += n
    return n_total


def read_slice(root: Path, entries: list[Entry], verify_every: int, buffered: bool = False) -> Tally:
    tally = Tally()
    buf = memoryview(bytearray(BUF_SIZE))
    for i, entry in enumerate(entries):
        hasher = xxhash.xxh3_64() if verify_every and i % verify_every == 0 else None
        try:
            n = read_file(os.path.join(root, entry.path), buf, hasher, buffered)
        except OSError as exc:
            tally.error(f"{entry.path}: {exc}")
            continue
        check(tally, entry, n, hasher.hexdigest() if hasher else None)
    return tally


def _file_worker(root, entries, verify_every, barrier, results, buffered=False) -> None:
    barrier.wait()
    tally = read_slice(root, entries, verify_every, buffered)
    results.put((time.monotonic(), tally))


def read_files(name: str, root: Path, order: list[Entry], readers: int,
               verify_every: int = 0, timeout: float = 3600.0, buffered: bool = False) -> Result:
    """Read ``order`` under ``root`` with ``readers`` forked processes; time the whole epoch
    (``buffered``: each file opened as an image loader does, ``read_file``)."""
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(readers + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_file_worker, daemon=True,
                         args=(str(root), order[i::readers], verify_every, barrier, results, buffered))
             for i in range(readers)]
    for proc in procs:
        proc.start()
    try:
        barrier.wait(timeout=60)
        start = time.monotonic()
        ends, total = collect(results, procs, timeout)
    finally:
        reap(procs)
    return Result(name, max(ends) - start, total)


def collect(results, procs, timeout: float) -> tuple[list[float], Tally]:
    """One (end time, tally) per process; fails fast if a reader dies, or after ``timeout``."""
    ends, total = [], Tally()
    deadline = time.monotonic() + timeout
    while len(ends) < len(procs):
        try:
            end, tally = results.get(timeout=1.0)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a reader process died") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"readers still busy after {timeout:.0f} s") from None
            continue
        ends.append(end)
        total.add(tally)
    return ends, total


def reap(procs) -> None:
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()


def read_sequential(name: str, path: Path, entry: Entry, block: int = MiB) -> Result:
    """One reader, ``block``-sized reads from start to end (size checked, not hashed)."""
    buf = memoryview(bytearray(block))
    tally = Tally()
    start = time.monotonic()
    try:
        n = read_file(str(path), buf, None)
    except OSError as exc:
        tally.error(f"{entry.path}: {exc}")
        return Result(name, time.monotonic() - start, tally)
    seconds = time.monotonic() - start
    check(tally, entry, n, None)
    return Result(name, seconds, tally)


def hash_file(path: Path) -> str:
    hasher = xxhash.xxh3_64()
    read_file(str(path), memoryview(bytearray(4 * MiB)), hasher)
    return hasher.hexdigest()


# ---- S3 objects, in threads ----------------------------------------------------------------------
def s3_key(prefix: str, entry: Entry) -> str:
    return object_key(prefix, entry.path)


def get_object(client, bucket: str, key: str, hasher, chunk: int = MiB) -> int:
    body = client.get_object(Bucket=bucket, Key=key)["Body"]
    n_total = 0
    while data := body.read(chunk):
        if hasher is not None:
            hasher.update(data)
        n_total += len(data)
    return n_total


def _s3_slice(client, bucket, prefix, entries, verify_every) -> Tally:
    tally = Tally()
    for i, entry in enumerate(entries):
        hasher = xxhash.xxh3_64() if verify_every and i % verify_every == 0 else None
        try:
            n = get_object(client, bucket, s3_key(prefix, entry), hasher)
        except Exception as exc:  # noqa: BLE001 - botocore raises many types; count them all
            tally.error(f"{entry.path}: {type(exc).__name__}: {exc}")
            continue
        check(tally, entry, n, hasher.hexdigest() if hasher else None)
    return tally


def read_s3(name: str, client, bucket: str, prefix: str, order: list[Entry], threads: int,
            verify_every: int = 0) -> Result:
    """GET ``order`` with ``threads`` threads sharing one boto3 client (its pool >= threads)."""
    client.head_bucket(Bucket=bucket)   # connect and sign once before the clock starts
    barrier = threading.Barrier(threads + 1)

    def run(i: int) -> tuple[float, Tally]:
        barrier.wait()
        tally = _s3_slice(client, bucket, prefix, order[i::threads], verify_every)
        return time.monotonic(), tally

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(run, i) for i in range(threads)]
        barrier.wait(timeout=60)
        start = time.monotonic()
        outcomes = [f.result() for f in futures]
    total = Tally()
    for _, tally in outcomes:
        total.add(tally)
    return Result(name, max(end for end, _ in outcomes) - start, total)


def read_s3_stream(name: str, client, bucket: str, prefix: str, entry: Entry) -> Result:
    """One GET of a whole (large) object, read in 1 MiB pieces."""
    client.head_bucket(Bucket=bucket)
    tally = Tally()
    start = time.monotonic()
    try:
        n = get_object(client, bucket, s3_key(prefix, entry), None)
    except Exception as exc:  # noqa: BLE001
        tally.error(f"{entry.path}: {type(exc).__name__}: {exc}")
        return Result(name, time.monotonic() - start, tally)
    seconds = time.monotonic() - start
    check(tally, entry, n, None)
    return Result(name, seconds, tally)
