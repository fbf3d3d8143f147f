"""Cold reads of one large object: cachefs beside boto3, in one run, with each row's CPU split.

One object (``--size``, default 1 GiB; 256 MiB with ``--quick``) laid out as a safetensors file
(an 8-byte header length, a JSON header, then the tensors' bytes) goes into a local S3 server
behind the latency proxy (default 10 ms per request). Rows, each on a cold cache (a new cache
directory and mount, page cache dropped):

  sequential    one reader, 1 MiB reads from start to end (a checkpoint or weights load,
                a video, a loader's first pass over a shard)
                    vs boto3 one stream, 8 parallel 8 MiB ranged GETs, ``download_file``
                    with its default transfer settings (to a file on the work disk)
  safetensors   the header, then every tensor read whole, in a shuffled order
                    vs the same ranged GETs with boto3, one thread
  random        ``--random-reads`` 1 MiB reads at random offsets, one reader
                    vs the same ranged GETs with boto3, one thread

Every row checks its bytes (xxh3 of what it read against the local file, untimed). For the
cachefs rows the CPU seconds per GiB of the daemon, the S3 server, the proxy, the reader and
the rest of the machine (``cpu_meter.py``), and the daemon's peak RSS, are reported: the
machine's CPUs are shared by all of them.

    .venv/bin/python -m benchmarks.bench_cold --quick
    .venv/bin/python -m benchmarks.bench_cold --size 2G --json benchmarks/results/cold.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import random
import shutil
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import xxhash  # noqa: E402

from benchmarks import dataset, readers  # noqa: E402
from benchmarks.cachefs_mount import CachefsMount, cannot_run, drop_page_cache, vm_hwm  # noqa: E402
from benchmarks.cpu_meter import CpuMeter  # noqa: E402
from testing.s3_servers import ProxyProcess, start_server  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
BUCKET, PREFIX, NAME = "cold", "models", "model.safetensors"
PACKED = "packed"        # ``cachefs pack`` of PREFIX (with --rows ...,packed): the object in a shard of its own
RANGE = 8 * MiB          # the parallel baseline's ranged GETs
RANGE_THREADS = 8


# ---- the object: a safetensors layout -----------------------------------------------------------
def tensor_sizes(total: int, rng: random.Random) -> list[int]:
    """Tensor sizes from 64 KiB to 64 MiB (as a model's layers are) that fill ``total`` bytes."""
    sizes, left = [], total
    while left > 0:
        size = min(left, rng.choice((64 << 10, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)) + rng.randrange(4096))
        sizes.append(size)
        left -= size
    return sizes


def write_object(path: Path, size: int, seed: int) -> list[tuple[int, int]]:
    """Write a safetensors-style file of about ``size`` bytes; return each tensor's (start, end)
    in the file."""
    rng = random.Random(seed)
    sizes = tensor_sizes(size - 64 * 1024, rng)
    header, offset = {}, 0
    for i, n in enumerate(sizes):
        header[f"layer.{i:04d}.weight"] = {"dtype": "U8", "shape": [n], "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    base = 8 + len(text)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text)
        chunk = rng.randbytes(MiB)
        for n in sizes:
            while n:
                piece = min(n, MiB)
                fh.write(chunk[:piece])
                chunk = chunk[piece:] + chunk[:piece]     # no two MiB of the file alike
                n -= piece
    tmp.rename(path)
    return tensors_of(path, base)


def tensors_of(path: Path, base: int | None = None) -> list[tuple[int, int]]:
    with open(path, "rb") as fh:
        length = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(length))
    base = 8 + length
    return [(base + t["data_offsets"][0], base + t["data_offsets"][1]) for t in header.values()]


# ---- readers -------------------------------------------------------------------------------------
class Row:
    def __init__(self, name: str, nbytes: int, seconds: float, digest: str, expect: str) -> None:
        self.name, self.nbytes, self.seconds = name, nbytes, seconds
        self.ok = digest == expect
        self.extra: dict[str, float] = {}

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e6 if self.seconds else 0.0

    def to_dict(self) -> dict:
        return {"name": self.name, "bytes": self.nbytes, "seconds": round(self.seconds, 3),
                "mb_per_s": round(self.mb_per_s, 1), "ok": self.ok, **self.extra}


def cpu_caps(spent: dict[str, float]) -> dict[str, float]:
    """The rates at which a row's CPU per GiB would fill every CPU of this machine: as measured,
    and with the S3 server and the proxy on other machines (as a real bucket is)."""
    cpus = os.cpu_count() or 1
    total = spent.get("cpu_total_s_per_gib", 0.0)
    here = total - spent.get("cpu_store_s_per_gib", 0.0) - spent.get("cpu_proxy_s_per_gib", 0.0)
    return {"cap_mb_s": round(cpus / total * GiB / 1e6, 1) if total else 0.0,
            "cap_store_elsewhere_mb_s": round(cpus / here * GiB / 1e6, 1) if here > 0 else 0.0}


def minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[7])


def pieces_digest(pieces: list[bytes]) -> str:
    hasher = xxhash.xxh3_64()
    for piece in pieces:
        hasher.update(piece)
    return hasher.hexdigest()


def local_digest(path: Path, ranges: list[tuple[int, int]] | None) -> str:
    """xxh3 of the local file (``ranges``: of those byte ranges, in that order)."""
    return (file_sequential(path) if ranges is None else file_ranges(path, ranges))[1]


def file_sequential(path: Path) -> tuple[int, str]:
    """One reader, 1 MiB reads from start to end: (bytes, xxh3)."""
    hasher = xxhash.xxh3_64()
    return readers.read_file(str(path), memoryview(bytearray(MiB)), hasher), hasher.hexdigest()


def file_ranges(path: Path, ranges: list[tuple[int, int]]) -> tuple[int, str]:
    hasher, total = xxhash.xxh3_64(), 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for start, end in ranges:
            data = os.pread(fd, end - start, start)
            if len(data) != end - start:
                raise OSError(f"short read at {start}: {len(data)} of {end - start}")
            hasher.update(data)
            total += len(data)
    finally:
        os.close(fd)
    return total, hasher.hexdigest()


def s3_sequential(client) -> tuple[int, str]:
    hasher = xxhash.xxh3_64()
    return readers.get_object(client, BUCKET, f"{PREFIX}/{NAME}", hasher), hasher.hexdigest()


def s3_range(client, start: int, end: int) -> bytes:
    return client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{NAME}", Range=f"bytes={start}-{end - 1}")["Body"].read()


def s3_parallel(client, size: int) -> tuple[int, str]:
    ranges = [(o, min(o + RANGE, size)) for o in range(0, size, RANGE)]
    with ThreadPoolExecutor(RANGE_THREADS) as pool:
        pieces = list(pool.map(lambda r: s3_range(client, *r), ranges))
    return sum(map(len, pieces)), pieces_digest(pieces)


def s3_download_file(client, target: Path) -> tuple[int, str]:
    client.download_file(BUCKET, f"{PREFIX}/{NAME}", str(target))
    try:
        return file_sequential(target)       # the "load" that follows reads the copy
    finally:
        target.unlink()


def s3_ranges(client, ranges: list[tuple[int, int]]) -> tuple[int, str]:
    pieces = [s3_range(client, start, end) for start, end in ranges]
    return sum(map(len, pieces)), pieces_digest(pieces)


# ---- the run -------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace, local: Path, tensors: list[tuple[int, int]]) -> None:
        self.args, self.local = args, local
        self.size = local.stat().st_size
        rng = random.Random(args.seed)
        header_end = tensors[0][0]
        self.safetensors = [(0, 8), (8, header_end)] + rng.sample(tensors, len(tensors))
        self.random = sorted({rng.randrange(0, self.size - MiB) & ~4095 for _ in range(args.random_reads)})
        rng.shuffle(self.random)
        self.random_ranges = [(o, o + MiB) for o in self.random]
        self.expect = {"sequential": local_digest(local, None),
                       "safetensors": local_digest(local, self.safetensors),
                       "random": local_digest(local, self.random_ranges)}
        self.rows: dict[str, Row] = {}

    def timed(self, key: str, name: str, expect: str, call, meter: CpuMeter | None = None) -> Row:
        drop_page_cache()
        with meter or contextlib.nullcontext():
            start = time.monotonic()
            nbytes, digest = call()
            seconds = time.monotonic() - start
        row = Row(name, nbytes, seconds, digest, self.expect[expect])
        if meter is not None:
            gib = nbytes / GiB
            row.extra = {f"cpu_{who}_s_per_gib": round(s / gib, 3) for who, s in meter.spent.items()}
            row.extra.update(cpu_caps(row.extra))
        self.rows[key] = row
        flag = "" if row.ok else "  WRONG BYTES"
        print(f"  {name:<44} {nbytes / MiB:>8.0f} MiB {row.mb_per_s:>8.1f} MB/s {seconds:>7.2f} s{flag}",
              flush=True)
        if row.extra:
            print("      CPU s/GiB: " + " ".join(f"{k[4:-10]} {v:.2f}" for k, v in row.extra.items()
                                                   if k.startswith("cpu_")) +
                  f"; CPU caps {row.extra['cap_mb_s']:.0f} MB/s, {row.extra['cap_store_elsewhere_mb_s']:.0f} "
                  "with the store and proxy elsewhere", flush=True)
        return row

    def meter(self) -> CpuMeter:
        return CpuMeter(**self.pids)

    def boto3_rows(self, endpoint_url: str, pids: dict[str, list[int]]) -> None:
        self.pids = pids
        client = dataset.s3_client(endpoint_url, pool=RANGE_THREADS + 4)
        client.head_bucket(Bucket=BUCKET)
        self.timed("boto3_stream", "boto3, one stream", "sequential", lambda: s3_sequential(client), self.meter())
        self.timed("boto3_parallel", f"boto3, {RANGE_THREADS} x {RANGE // MiB} MiB ranged GETs", "sequential",
                   lambda: s3_parallel(client, self.size), self.meter())
        target = self.args.workdir / "download.bin"
        self.timed("boto3_download", "boto3 download_file (defaults) + read", "sequential",
                   lambda: s3_download_file(client, target), self.meter())
        self.timed("boto3_safetensors", "boto3 safetensors-style ranged GETs", "safetensors",
                   lambda: s3_ranges(client, self.safetensors), self.meter())
        self.timed("boto3_random", f"boto3 {len(self.random)} random 1 MiB GETs", "random",
                   lambda: s3_ranges(client, self.random_ranges), self.meter())

    def cachefs_rows(self, endpoint_url: str, pids: dict[str, list[int]]) -> None:
        path = Path(PREFIX) / NAME
        rows = (("cachefs_sequential", "cachefs cold, sequential 1 MiB reads", "sequential", file_sequential),
                ("cachefs_safetensors", "cachefs cold, safetensors-style", "safetensors",
                 lambda p: file_ranges(p, self.safetensors)),
                ("cachefs_random", f"cachefs cold, {len(self.random)} random 1 MiB reads", "random",
                 lambda p: file_ranges(p, self.random_ranges)))
        if "packed" in self.args.rows:
            rows += (("cachefs_packed", "cachefs cold, packed mount, sequential", "sequential",
                      file_sequential),)
        for key, name, expect, read in rows:
            if key.removeprefix("cachefs_") not in self.args.rows:
                continue
            packed = key == "cachefs_packed"
            target = Path(NAME) if packed else path        # the packed view shows the tree below PREFIX
            with self.mount(endpoint_url, PACKED if packed else "") as mnt:
                meter = CpuMeter(daemon=[mnt.pid], **pids)
                faults = minor_faults(mnt.pid)
                row = self.timed(key, name, expect, functools.partial(read, mnt.mountpoint / target), meter)
                row.extra["daemon_faults_per_mib"] = round((minor_faults(mnt.pid) - faults) / (row.nbytes / MiB), 1)
                row.extra["daemon_peak_rss_mib"] = round(vm_hwm(mnt.pid) / MiB)
                memory = mnt.status().get("tiers", {}).get("memory", {})
                row.extra["memory_tier_used_mib"] = round(memory.get("used_bytes", 0) / MiB)
                print(f"      daemon: {row.extra['daemon_faults_per_mib']:.0f} page faults per MiB, "
                      f"peak RSS {row.extra['daemon_peak_rss_mib']} MiB, memory tier "
                      f"{row.extra['memory_tier_used_mib']} MiB after the read", flush=True)

    def mount(self, endpoint_url: str, prefix: str = "") -> CachefsMount:
        cache_dir = self.args.workdir / "cache"
        shutil.rmtree(cache_dir, ignore_errors=True)
        return CachefsMount(f"s3://{BUCKET}/{prefix}".rstrip("/"), self.args.workdir / "mnt", endpoint_url=endpoint_url,
                            cache_dir=cache_dir, cache_size=self.args.cache_size,
                            mem_cache_size=self.args.mem_cache_size, extra=tuple(self.args.mount_opt))


RATIOS = (
    ("sequential vs boto3 one stream", "cachefs_sequential", "boto3_stream", 1.0),
    (f"sequential vs {RANGE_THREADS} x {RANGE // MiB} MiB ranged GETs", "cachefs_sequential", "boto3_parallel", 1.0),
    ("sequential (checkpoint load) vs download_file", "cachefs_sequential", "boto3_download", 1.0),
    ("safetensors-style vs download_file", "cachefs_safetensors", "boto3_download", 1.0),
    ("safetensors-style vs boto3 same ranges", "cachefs_safetensors", "boto3_safetensors", None),
    ("random 1 MiB vs boto3 same ranges", "cachefs_random", "boto3_random", None),
    ("packed mount sequential vs 8 x 8 MiB ranged GETs", "cachefs_packed", "boto3_parallel", 1.0),
    ("packed mount sequential vs the plain mount", "cachefs_packed", "cachefs_sequential", None),
)


def ratios(rows: dict[str, Row]) -> list[dict]:
    out = []
    for label, ours, theirs, target in RATIOS:
        if ours in rows and theirs in rows and rows[theirs].mb_per_s:
            value = rows[ours].mb_per_s / rows[theirs].mb_per_s
            out.append({"label": label, "ratio": round(value, 3), "target": target,
                        "pass": None if target is None else value >= target})
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=dataset.parse_size, help="object size (default 1G; 256M with --quick)")
    parser.add_argument("--random-reads", type=int, default=200)
    parser.add_argument("--latency-ms", type=float, default=10.0)
    parser.add_argument("--proxy", choices=("splice", "python"), default="splice",
                        help="how the latency proxy moves answers (splice: in the kernel)")
    parser.add_argument("--server", choices=("seaweedfs", "moto", "rclone"), default="seaweedfs")
    parser.add_argument("--mem-cache-size", default="1G")
    parser.add_argument("--cache-size", default="50G")
    parser.add_argument("--mount-opt", action="append", default=[], help="extra `cachefs mount` flag")
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp/cachefs-bench-cold"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-boto3", action="store_true", help="only the cachefs rows")
    parser.add_argument("--rows", type=lambda text: set(text.split(",")), default={"sequential", "safetensors", "random"},
                        help="cachefs rows to run, of sequential,safetensors,random,packed (packed: not by default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.size = args.size or (256 * MiB if args.quick else GiB)
    return args


def pack(endpoint_url: str) -> None:
    """``cachefs pack`` the object's prefix (untimed, straight to the server)."""
    import subprocess

    from benchmarks.cachefs_mount import cachefs_command
    subprocess.run(cachefs_command() + ["pack", f"s3://{BUCKET}/{PREFIX}", f"s3://{BUCKET}/{PACKED}",
                                        "--endpoint-url", endpoint_url, "--quiet"], check=True, timeout=600)


def run(args: argparse.Namespace) -> int:
    from testing.s3 import local_credentials_env
    for name, value in {**local_credentials_env(), "AWS_EC2_METADATA_DISABLED": "true"}.items():
        os.environ.setdefault(name, value)
    local = args.workdir / "local" / NAME
    if not local.exists() or abs(local.stat().st_size - args.size) > 64 * 1024:
        local.parent.mkdir(parents=True, exist_ok=True)
        write_object(local, args.size, args.seed)
    bench = Bench(args, local, tensors_of(local))
    header = (f"cachefs cold large-object benchmark: {bench.size / MiB:.0f} MiB safetensors-style object; "
              f"{args.server} behind a {args.latency_ms:g} ms {args.proxy} proxy; memory tier "
              f"{args.mem_cache_size}; {os.cpu_count()} CPUs, kernel {platform.release()}")
    print(header, flush=True)
    shutil.rmtree(args.workdir / "server", ignore_errors=True)     # the object is uploaded anew each run
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(start_server(args.server, args.workdir / "server"))
        client = dataset.s3_client(server.endpoint_url)
        dataset.ensure_bucket(client, BUCKET)
        from boto3.s3.transfer import TransferConfig
        client.upload_file(str(local), BUCKET, f"{PREFIX}/{NAME}",
                           Config=TransferConfig(multipart_threshold=64 * MiB, multipart_chunksize=64 * MiB))
        if "packed" in args.rows:
            pack(server.endpoint_url)
        proxy = stack.enter_context(ProxyProcess(server.endpoint_url, args.latency_ms,
                                                 splice=args.proxy == "splice"))
        pids = {"store": [server.pid], "proxy": [proxy.pid]}
        if not args.skip_boto3:
            bench.boto3_rows(proxy.endpoint_url, pids)
        bench.cachefs_rows(proxy.endpoint_url, pids)
    table = ratios(bench.rows)
    print()
    for row in table:
        target = "-" if row["target"] is None else f">= {row['target']}"
        verdict = "" if row["pass"] is None else ("PASS" if row["pass"] else "FAIL")
        print(f"  {row['label']:<48} {row['ratio']:>7.2f} {target:>8}  {verdict}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"header": header, "setup": {k: str(v) for k, v in vars(args).items()},
                                         "rows": {k: r.to_dict() for k, r in bench.rows.items()},
                                         "ratios": table}, indent=2))
    return 0 if all(r.ok for r in bench.rows.values()) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if why := cannot_run("bench_cold"):
        print(why, file=sys.stderr)
        return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
