"""Write-back benchmark (issue 4): a checkpoint and a log through a real mount, ratios in one run.

    .venv/bin/python -m benchmarks.bench_write [--size 1G] [--part-size 16M] [--concurrency 8]

Set-up: moto server on loopback behind ``LatencyProxy`` (10 ms each way per request), a
cachefs mount of a fresh bucket with ``--checkpoint-quiet-period 0`` (upload as soon as the
file is closed), the cache dir and the local baseline on the same disk.

1. local: write SIZE in 8 MiB writes to a local file, time to close() (no fsync on either side);
2. mount: the same writes to ``ckpt.pt`` on the mount, time to close(); then the time from
   close() until the object is complete in the bucket (HEAD polled every 20 ms);
3. boto3 ``upload_file`` of the local file through the same proxy, same part size and concurrency;
4. log lag: while a second checkpoint uploads, a line is appended to ``train.log`` every 100 ms;
   the bucket copy is polled every 50 ms; lag = first seen in the bucket - written.
"""

import argparse
import json
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from boto3.s3.transfer import TransferConfig

from benchmarks.cachefs_mount import cachefs_command
from benchmarks.latency_proxy import LatencyProxy
from cachefs.config import parse_size
from cachefs.local_s3 import LocalS3Server, local_credentials_env, make_bucket, s3_client

CHUNK = 8 << 20


def write_file(path: Path, size: int, block: bytes) -> float:
    started = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(size // len(block)):
            fh.write(block)
    return time.perf_counter() - started


def wait_object(client, bucket: str, key: str, size: int, timeout: float = 3600) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if client.head_object(Bucket=bucket, Key=key)["ContentLength"] == size:
                return time.perf_counter()
        except client.exceptions.ClientError:
            pass
        time.sleep(0.02)
    raise TimeoutError(f"{key} not complete in the bucket after {timeout} s")


def run_cli(*args: str) -> None:
    import subprocess
    subprocess.run(cachefs_command() + list(args), check=True, capture_output=True, text=True)


def log_lag(mnt: Path, client, bucket: str, seconds: float) -> list[float]:
    written, seen, stop = {}, {}, threading.Event()

    def poll():
        while not stop.is_set():
            try:
                body = client.get_object(Bucket=bucket, Key="train.log")["Body"].read().decode()
            except client.exceptions.ClientError:
                body = ""
            now = time.time()
            for line in body.splitlines():
                seen.setdefault(int(line.split()[1]), now)
            time.sleep(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    with open(mnt / "train.log", "a") as fh:
        for i in range(int(seconds * 10)):
            written[i] = time.time()
            fh.write(f"step {i} loss {random.random():.4f}\n")
            fh.flush()
            time.sleep(0.1)
    deadline = time.time() + 30
    while len(seen) < len(written) and time.time() < deadline:
        time.sleep(0.1)
    stop.set()
    return sorted(seen.get(i, float("inf")) - t for i, t in written.items())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1G")
    parser.add_argument("--part-size", default="16M")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--latency", type=float, default=0.010)
    parser.add_argument("--log-seconds", type=float, default=20.0)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default="benchmarks/results/write.json")
    args = parser.parse_args(argv)
    size, part = parse_size(args.size), parse_size(args.part_size)
    os.environ.update(local_credentials_env())
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-write-", dir="/var/tmp"))
    block = random.Random(0).randbytes(CHUNK)
    results: dict = {"size": size, "part_size": part, "concurrency": args.concurrency, "latency_s": args.latency}
    with LocalS3Server() as server:
        url = urlparse(server.endpoint_url)
        with LatencyProxy(url.hostname, url.port, latency=args.latency) as proxy:
            make_bucket(server.endpoint_url, "bench-write")
            client = s3_client(proxy.endpoint_url)
            local = work / "local.pt"
            results["local_close_s"] = write_file(local, size, block)
            mnt = work / "mnt"
            mnt.mkdir(exist_ok=True)
            run_cli("mount", "s3://bench-write", str(mnt), "--endpoint-url", proxy.endpoint_url,
                    "--cache-dir", str(work / "cache"), "--metrics-port", "0", "--checkpoint-quiet-period", "0",
                    "--upload-part-size", args.part_size, "--upload-concurrency", str(args.concurrency),
                    "--log-sync-period", "5")
            try:
                results["mount_close_s"] = write_file(mnt / "ckpt.pt", size, block)
                closed = time.perf_counter()
                results["mount_close_to_bucket_s"] = wait_object(client, "bench-write", "ckpt.pt", size) - closed
                config = TransferConfig(multipart_threshold=part, multipart_chunksize=part,
                                        max_concurrency=args.concurrency)
                started = time.perf_counter()
                client.upload_file(str(local), "bench-write", "boto3.pt", Config=config)
                results["boto3_upload_s"] = time.perf_counter() - started
                writer = threading.Thread(target=write_file, args=(mnt / "ckpt2.pt", size, block))
                writer.start()
                lags = log_lag(mnt, client, "bench-write", args.log_seconds)
                writer.join()
                results["log_lag_p50_s"] = statistics.median(lags)
                results["log_lag_p95_s"] = lags[int(len(lags) * 0.95)]
                results["log_lag_max_s"] = lags[-1]
            finally:
                run_cli("umount", str(mnt), "--timeout", "600")
    results["close_ratio"] = results["mount_close_s"] / results["local_close_s"]
    results["bucket_ratio"] = results["mount_close_to_bucket_s"] / results["boto3_upload_s"]
    results["log_lag_target_s"] = 5 + 1.0
    print(json.dumps(results, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
