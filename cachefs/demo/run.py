"""`cachefs demo`: the whole job on an embedded default, end to end.

Starts moto's S3 server on loopback, uploads a sample dataset (small image-like
files in class folders plus one large file), mounts it with cachefs, reads it
cold, then from the disk tier after a remount with the page cache dropped, then
hot, verifying every byte, prints throughput and tier hit ratios, and cleans up
everything it started.
"""

import concurrent.futures
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import xxhash

from cachefs.config import parse_size
from cachefs.control.client import request
from cachefs.control.status_view import render

BUCKET = "demo-datasets"
PREFIX = "imagenet-mini"
READERS = 8


def _sample(rng: random.Random, n: int) -> bytes:
    """n incompressible bytes (in 1 MiB pieces: randbytes of 256 MiB or more overflows)."""
    piece = 1 << 20
    return b"".join(rng.randbytes(min(piece, n - off)) for off in range(0, n, piece))


def make_dataset(client, files: int, large_size: int) -> dict[str, str]:
    """Upload the dataset; return path -> xxh3 digest of its content."""
    rng = random.Random(42)
    items = [(f"train/class_{i % 20:02d}/img_{i:05d}.jpg", int(110 * 1024 * rng.uniform(0.8, 1.2)), i)
             for i in range(files)]
    digests: dict[str, str] = {}

    def put(item):
        path, n, seed = item
        data = _sample(random.Random(seed), n)
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{path}", Body=data)
        return path, xxhash.xxh3_64_hexdigest(data)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        digests.update(pool.map(put, items))
    if large_size:
        data = _sample(random.Random(7), large_size)
        import io

        from boto3.s3.transfer import TransferConfig
        client.upload_fileobj(io.BytesIO(data), BUCKET, f"{PREFIX}/large/shard_0.bin",
                              Config=TransferConfig(multipart_chunksize=16 << 20, max_concurrency=8))
        digests["large/shard_0.bin"] = xxhash.xxh3_64_hexdigest(data)
    return digests


def read_epoch(mountpoint: str, paths: list[str], digests: dict[str, str]) -> tuple[float, int]:
    """Read ``paths`` with READERS threads in shuffled order; verify; return (seconds, bytes)."""
    order = list(paths)
    random.Random(time.time_ns()).shuffle(order)

    def read(path: str) -> int:
        with open(os.path.join(mountpoint, path), "rb") as fh:
            hasher = xxhash.xxh3_64()
            total = 0
            while chunk := fh.read(1 << 20):
                hasher.update(chunk)
                total += len(chunk)
        if hasher.hexdigest() != digests[path]:
            raise SystemExit(f"cachefs demo: WRONG BYTES in {path}")
        return total

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(READERS) as pool:
        total = sum(pool.map(read, order))
    return time.perf_counter() - started, total


def drop_page_cache(cache_dir: str) -> int:
    """Drop what the demo itself cached, never the machine's whole page cache: the mount's pages
    went with the unmount; the disk tier's files are flushed and dropped one by one
    (POSIX_FADV_DONTNEED). Returns how many files were dropped."""
    dropped = 0
    for root, _, names in os.walk(cache_dir):
        for name in names:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += 1
            except OSError:
                pass
            finally:
                os.close(fd)
    return dropped


class DemoMount:
    def __init__(self, url: str, mountpoint: str, endpoint: str, cache_dir: str) -> None:
        self.args = [sys.executable, "-m", "cachefs", "mount", url, mountpoint, "--endpoint-url", endpoint,
                     "--cache-dir", cache_dir, "--cache-size", "4G", "--mem-cache-size", "256M",
                     "--metadata-ttl", "300"]
        self.mountpoint = mountpoint

    def __enter__(self) -> "DemoMount":
        subprocess.run(self.args, check=True)
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run([sys.executable, "-m", "cachefs", "umount", self.mountpoint], check=False)


def run_demo(files: int = 2000, large_size: str = "256M", workdir: str | None = None) -> int:
    from cachefs.demo.local_s3 import LocalS3Server, local_credentials_env, make_bucket, s3_client

    os.environ.update({k: v for k, v in local_credentials_env().items() if k not in os.environ})
    own_workdir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="cachefs-demo-", dir="/var/tmp")
    mountpoint, cache_dir = os.path.join(workdir, "mnt"), os.path.join(workdir, "cache")
    os.makedirs(mountpoint, exist_ok=True)
    try:
        with LocalS3Server() as server:
            print(f"[1/6] local S3 server (moto) at {server.endpoint_url}")
            make_bucket(server.endpoint_url, BUCKET)
            started = time.perf_counter()
            digests = make_dataset(s3_client(server.endpoint_url), files, parse_size(large_size))
            print(f"[2/6] uploaded {len(digests)} objects to s3://{BUCKET}/{PREFIX} "
                  f"in {time.perf_counter() - started:.1f}s")
            small = sorted(p for p in digests if p.startswith("train/"))
            large = sorted(p for p in digests if p.startswith("large/"))
            rows = []
            url = f"s3://{BUCKET}/{PREFIX}"
            cold = small[: len(small) // 2]
            with DemoMount(url, mountpoint, server.endpoint_url, cache_dir):
                print(f"[3/6] mounted {url} at {mountpoint}; reading half the files cold")
                rows.append(("cold (object store)", len(cold), *read_epoch(mountpoint, cold, digests),
                             *read_epoch(mountpoint, large, digests)))
                print(f"[4/6] cachefs warmup {mountpoint}: the rest into the disk tier")
                sys.stdout.flush()
                subprocess.run([sys.executable, "-m", "cachefs", "warmup", mountpoint], check=True)
            dropped = drop_page_cache(cache_dir)
            with DemoMount(url, mountpoint, server.endpoint_url, cache_dir):
                print(f"[5/6] remounted; the page cache of the disk tier's {dropped} files dropped")
                rows.append(("warm (disk tier)", len(small), *read_epoch(mountpoint, small, digests),
                             *read_epoch(mountpoint, large, digests)))
                rows.append(("hot (page cache)", len(small), *read_epoch(mountpoint, small, digests),
                             *read_epoch(mountpoint, large, digests)))
                status = next(request(mountpoint, "status"))
            _print_table(rows)
            print("\n[6/6] daemon status after the warm and hot passes:\n" + render(status))
            get = sum(v for k, v in status["store_requests"].items() if k.startswith("get"))
            print(f"\nall {len(digests)} files verified; object-store GETs after the remount: {get}")
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _print_table(rows) -> None:
    print(f"\n{'pass':<22}{'small files/s':>14}{'small MB/s':>12}{'large MB/s':>12}")
    for name, nfiles, s_sec, s_bytes, l_sec, l_bytes in rows:
        large = f"{l_bytes / l_sec / 1e6:12.0f}" if l_bytes else f"{'-':>12}"
        print(f"{name:<22}{nfiles / s_sec:14.0f}{s_bytes / s_sec / 1e6:12.0f}{large}")
