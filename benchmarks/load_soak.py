"""Load soak: 64 concurrent readers, a warmup and a write-back upload at once, for N minutes.

One mount of a moto bucket (started here) holds a read dataset (``read/``), a second dataset that
``cachefs warmup`` warms, evicts and warms again in a loop (``warm/``), and a writable prefix where a
writer saves checkpoints and appends to a log (``out/``: uploaded by the write-back engine while
everything else runs). Every read is compared with the source. Every ``--sample`` seconds the
daemon's RSS and open file descriptors are sampled.

Pass: RSS stays within the memory budget (``--mem-cache-size``) + 250 MiB, no fd leak (when idle
after the load and the final sync, the daemon's fds other than the disk tier's bounded cache of open
block files (<= 256) are within 4 of their count before the load; the maxima of the two halves of
the run and the kinds of the fds left are reported too), no error (reads, writes, warmups, and no
ERROR line in the daemon log), and what was written is in the bucket after a final sync.

    python -m benchmarks.load_soak --minutes 10 [--readers 64] [--json out.json]

Needs root and /dev/fuse. Prints one JSON line of figures; exit 1 if a check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from cachefs.config import parse_size
from testing.stuck import abort_fuse_connection, blocked_in_kernel

MIB = 1 << 20


def dataset(prefix: str, count: int, seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {f"{prefix}/d{i % 8}/f{i:05d}.bin": rng.randbytes(rng.randrange(1_000, 300_000)) for i in range(count)}


def put_all(client, bucket: str, files: dict[str, bytes]) -> None:
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda item: client.put_object(Bucket=bucket, Key=item[0], Body=item[1]), files.items()))


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {"reads": 0, "bytes_read": 0, "wrong_reads": 0, "read_errors": 0, "checkpoints": 0,
                       "log_appends": 0, "write_errors": 0, "warmups": 0, "warmup_errors": 0}
        self.errors: list[str] = []
        self.hung_at: float | None = None
        self.fds_idle: tuple[int, int] = (0, 0)
        self.fd_kinds: dict[str, int] = {}

    def add(self, **deltas) -> None:
        with self.lock:
            for key, value in deltas.items():
                self.counts[key] += value

    def error(self, kind: str, text: str) -> None:
        with self.lock:
            self.counts[kind] += 1
            if len(self.errors) < 20:
                self.errors.append(f"{kind}: {text}")


def reader(root: Path, digests: dict[str, str], tally: Tally, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    names = sorted(digests)
    while not stop.is_set():
        name = rng.choice(names)
        try:
            data = (root / name).read_bytes()
        except OSError as exc:
            tally.error("read_errors", f"{name}: {exc}")
            continue
        if hashlib.md5(data).hexdigest() != digests[name]:
            tally.error("wrong_reads", name)
        tally.add(reads=1, bytes_read=len(data))


def writer(root: Path, tally: Tally, stop: threading.Event, ckpt_size: int, written: dict) -> None:
    """Checkpoints saved whole (8 MiB writes) and a log appended and fsynced between them."""
    rng = random.Random(1)
    (root / "out").mkdir(exist_ok=True)
    log_path = root / "out" / "train.log"
    n = 0
    while not stop.is_set():
        n += 1
        try:
            data = rng.randbytes(ckpt_size)
            with open(root / "out" / f"ckpt-{n % 3}.pt", "wb") as fh:
                for off in range(0, len(data), 8 * MIB):
                    fh.write(data[off:off + 8 * MIB])
            written[f"out/ckpt-{n % 3}.pt"] = hashlib.md5(data).hexdigest()
            tally.add(checkpoints=1)
            for step in range(20):
                with open(log_path, "a") as fh:
                    fh.write(f"checkpoint {n} step {step}\n")
                    fh.flush()
                    os.fsync(fh.fileno())
                tally.add(log_appends=1)
                if stop.wait(0.1):
                    break
        except OSError as exc:
            tally.error("write_errors", str(exc))
            stop.wait(1.0)
    with contextlib.suppress(OSError):
        written["out/train.log"] = hashlib.md5(log_path.read_bytes()).hexdigest()


def warmer(target: Path, tally: Tally, stop: threading.Event) -> None:
    """Warm, evict, warm again: the warmup engine and eviction run the whole time."""
    command = [sys.executable, "-m", "cachefs", "warmup", "--quiet"]
    while not stop.is_set():
        for extra in ([], ["--evict"]):
            result = subprocess.run([*command, *extra, str(target)], capture_output=True, text=True, check=False)
            if result.returncode != 0:
                tally.error("warmup_errors", result.stderr.strip()[-300:])
                stop.wait(2.0)
            elif not extra:
                tally.add(warmups=1)


def fd_kinds(pid: int) -> dict[str, int]:
    """What the daemon's fds point at, counted by kind (socket, pipe, a cache-dir subdirectory...)."""
    kinds: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            kind = target.split(":")[0] if ":" in target and not target.startswith("/") else \
                "/".join(target.split("/")[-3:-1]) or target
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def sample(pid: int) -> tuple[int, int]:
    """(RSS bytes, open fds) of the daemon."""
    with open(f"/proc/{pid}/status") as fh:
        rss = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def run(args, workdir: Path) -> dict:
    from benchmarks.cachefs_mount import CachefsMount
    from testing.s3 import LocalS3Server, local_credentials_env, make_bucket, s3_client
    for name, value in local_credentials_env().items():
        os.environ.setdefault(name, value)
    with LocalS3Server() as server:
        bucket = f"soak-{os.getpid()}"
        make_bucket(server.endpoint_url, bucket)
        client = s3_client(server.endpoint_url)
        read_files, warm_files = dataset("read", args.files, 1), dataset("warm", args.files // 2, 2)
        put_all(client, bucket, {**read_files, **warm_files})
        digests = {name[len("read/"):]: hashlib.md5(data).hexdigest() for name, data in read_files.items()}
        extra = ("--log-sync-period", "2", "--checkpoint-quiet-period", "1", "--upload-part-size", "8M",
                 "--metrics-port", "0")
        with CachefsMount(f"s3://{bucket}", workdir / "mnt", endpoint_url=server.endpoint_url,
                          cache_dir=workdir / "cache", cache_size=args.cache_size, mem_cache_size=args.mem_cache_size,
                          immutable=False, extra=extra) as mnt:
            return soak(args, mnt, digests, client, bucket)


def soak(args, mnt, digests: dict[str, str], client, bucket: str) -> dict:
    tally, stop, written = Tally(), threading.Event(), {}
    root = mnt.mountpoint
    fds_idle_before = sample(mnt.pid)[1]
    threads = [threading.Thread(target=reader, args=(root / "read", digests, tally, stop, i))
               for i in range(args.readers)]
    threads.append(threading.Thread(target=writer, args=(root, tally, stop, parse_size(args.checkpoint_size),
                                                         written)))
    threads.append(threading.Thread(target=warmer, args=(root / "warm", tally, stop)))
    for thread in threads:
        thread.start()
    samples, stuck = [], []
    started = time.monotonic()
    try:
        while time.monotonic() - started < args.minutes * 60:
            time.sleep(args.sample)
            samples.append((round(time.monotonic() - started, 1), *sample(mnt.pid)))
            stuck = stuck + [blocked_in_kernel(mnt.pid)] if blocked_in_kernel(mnt.pid) else []
            if len(stuck) >= 5:              # ~10 s asleep in the kernel: a deadlock, not I/O
                tally.error("read_errors", f"daemon deadlocked in the kernel ({stuck[-1]}) at "
                            f"{samples[-1][0]:.0f} s; FUSE connection aborted")
                tally.hung_at = samples[-1][0]
                abort_fuse_connection(root)
                break
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=300)
    synced = mnt.run("sync", str(root), "--wait", "--timeout", "300")
    time.sleep(25)                           # idle: uploads retired, handles released, keep-alive sockets (20 s) closed
    with contextlib.suppress(OSError):
        tally.fds_idle = (fds_idle_before, sample(mnt.pid)[1])
        tally.fd_kinds = fd_kinds(mnt.pid)
    in_bucket = {key: hashlib.md5(client.get_object(Bucket=bucket, Key=key)["Body"].read()).hexdigest()
                 for key in written}
    log_errors = [line for line in (mnt.cache_dir / "cachefs.log").read_text().splitlines() if " ERROR " in line]
    return figures(args, tally, samples, written, in_bucket, synced.returncode, log_errors)


def figures(args, tally: Tally, samples, written, in_bucket, sync_code: int, log_errors: list[str]) -> dict:
    half = len(samples) // 2
    fds_first = max((s[2] for s in samples[:half]), default=0)
    fds_second = max((s[2] for s in samples[half:]), default=0)
    rss_max = max((s[1] for s in samples), default=0)
    budget = parse_size(args.mem_cache_size) + 250 * MIB
    out = {**tally.counts, "minutes": args.minutes, "readers": args.readers, "rss_max_mib": rss_max // MIB,
           "rss_limit_mib": budget // MIB, "fds_first_half_max": fds_first, "fds_second_half_max": fds_second,
           "samples": len(samples), "sync_exit": sync_code, "uploaded_intact": in_bucket == written,
           "daemon_log_errors": len(log_errors), "daemon_hung_at_s": tally.hung_at,
           "errors": tally.errors + log_errors[:5]}
    out["fds_idle_before"], out["fds_idle_after"] = tally.fds_idle
    out["fd_kinds_idle_after"] = tally.fd_kinds
    # the disk tier keeps up to 256 block files open (an LRU in cachefs/tiers/disk/reader.py): not a leak
    blocks = sum(n for kind, n in tally.fd_kinds.items() if kind.startswith("blocks/"))
    out["ok"] = (rss_max <= budget and tally.fds_idle[1] - blocks <= tally.fds_idle[0] + 4 and blocks <= 256
                 and sync_code == 0
                 and in_bucket == written
                 and not log_errors and not any(tally.counts[k] for k in
                                                ("wrong_reads", "read_errors", "write_errors", "warmup_errors")))
    out["rss_fd_series"] = samples
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--readers", type=int, default=64)
    parser.add_argument("--files", type=int, default=600, help="files in the read dataset (half as many warmed)")
    parser.add_argument("--mem-cache-size", default="256M")
    parser.add_argument("--cache-size", default="2G")
    parser.add_argument("--checkpoint-size", default="48M")
    parser.add_argument("--sample", type=float, default=2.0, help="seconds between RSS/fd samples")
    parser.add_argument("--workdir")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        workdir = Path(args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-")))
        result = run(args, workdir)
    series = result.pop("rss_fd_series")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "rss_fd_series": series}, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
