"""The read benchmark: cachefs epochs beside local disk and boto3, in one run.

An ImageNet-like dataset (benchmarks/dataset.py) goes into a local S3 server
behind a latency-injecting proxy (testing/latency_proxy.py, default 10 ms
per request). Then, with ``--readers`` parallel readers in one shuffled order:

  small files   cold     cachefs, empty cache          vs boto3 GETs, same threads, via the proxy
                warm     cachefs remounted (empty memory tier, disk tier full), page cache dropped
                                                        vs local disk, page cache dropped
                hot      cachefs again, no drop         vs local page cache
  large file    one reader, 1 MiB reads: cachefs cold, cachefs disk tier (dropped: the first
                open in the daemon's life, which verifies the cache file it hands to the
                kernel, then a second open), local disk (dropped), boto3 one stream

and the daemon's peak RSS (VmHWM). Needs root (drop_caches, FUSE).

    .venv/bin/python benchmarks/bench_read.py --quick
    .venv/bin/python benchmarks/bench_read.py --json benchmarks/results/read.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import dataset, readers
from benchmarks.cachefs_mount import CachefsMount, cachefs_available, drop_page_cache
from benchmarks.readers import Result
from testing.s3_servers import ProxyProcess, find_binary, start_server

MiB = 1 << 20
BUCKET, PREFIX = "bench", "imagenet"
VERIFY_EVERY = 10          # hash one file in ten on cold and warm epochs
HOT_PASSES = 3             # hot rows read the order this many times: long enough to time
HOT_TARGET = 10_000        # files/s


# ---- options -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, help="small files (default 10000; 2000 with --quick)")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--file-size", type=dataset.parse_size, default=110 * 1024)
    parser.add_argument("--large", type=int, help="large files (default 2; 1 with --quick)")
    parser.add_argument("--large-size", type=dataset.parse_size,
                        help="bytes per large file (default 512MiB; 128MiB with --quick)")
    parser.add_argument("--readers", type=int, default=8, help="parallel readers")
    parser.add_argument("--latency-ms", type=float, default=10.0, help="proxy delay per request")
    parser.add_argument("--bandwidth-mbps", type=float, default=None, help="proxy cap, MB/s")
    parser.add_argument("--server", choices=("auto", "moto", "seaweedfs", "rclone"), default="auto",
                        help="local S3 server (auto: seaweedfs if installed, else moto)")
    parser.add_argument("--mem-cache-size", default="1G", help="cachefs memory tier")
    parser.add_argument("--cache-size", default="50G", help="cachefs disk tier")
    parser.add_argument("--mount-opt", action="append", default=[],
                        help="extra `cachefs mount` flag, e.g. --mount-opt=--block-size=1M")
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp/cachefs-bench"),
                        help="dataset, server data, cache dir, mountpoint (not tmpfs)")
    parser.add_argument("--json", type=Path, help="write all results here")
    parser.add_argument("--quick", action="store_true", help="2,000 files and 1 x 128 MiB")
    parser.add_argument("--keep", action="store_true", help="keep the workdir (reuses the dataset)")
    parser.add_argument("--skip-cachefs", action="store_true", help="only the baselines")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a target is missed (always 1 on read errors)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    quick = args.quick
    args.files = args.files if args.files is not None else (2000 if quick else 10_000)
    args.large = args.large if args.large is not None else (1 if quick else 2)
    args.large_size = args.large_size or (128 * MiB if quick else 512 * MiB)
    args.server = resolve_server(args.server)
    return args


def resolve_server(choice: str) -> str:
    if choice != "auto":
        return choice
    try:
        find_binary("weed")
        return "seaweedfs"
    except RuntimeError:
        return "moto"


def use_local_credentials() -> None:
    from testing.s3 import local_credentials_env
    for name, value in {**local_credentials_env(), "AWS_EC2_METADATA_DISABLED": "true"}.items():
        os.environ.setdefault(name, value)


# ---- the rows ------------------------------------------------------------------------------------
class Bench:
    """Holds the dataset, the order and every result; one method per group of rows."""

    def __init__(self, args: argparse.Namespace, entries: list[dataset.Entry]):
        self.args = args
        self.root = args.workdir / "dataset" / "data"
        small = [e for e in entries if not e.is_large]
        self.order = random.Random(args.seed).sample(small, len(small))
        self.large = next((e for e in entries if e.is_large), None)
        self.results: dict[str, Result] = {}
        self.extra: dict[str, object] = {}

    def record(self, key: str, result: Result) -> Result:
        self.results[key] = result
        flag = "" if result.ok else f"  ERRORS: {result.tally}"
        print(f"  {result.name:<40} {result.tally.files:>6} files {result.mb_per_s:>8.1f} MB/s "
              f"{result.seconds:>7.2f} s{flag}", flush=True)
        return result

    def files(self, key: str, name: str, root: Path, verify: bool, drop: bool,
              passes: int = 1) -> Result:
        if drop:
            drop_page_cache()
        every = VERIFY_EVERY if verify else 0
        return self.record(key, readers.read_files(name, root, self.order * passes,
                                                   self.args.readers, every))

    def sequential(self, key: str, name: str, root: Path, drop: bool = True) -> Result | None:
        if self.large is None:
            return None
        if drop:
            drop_page_cache()
        return self.record(key, readers.read_sequential(name, root / self.large.path, self.large))

    def local_rows(self) -> None:
        self.files("local_cold", "local disk, page cache dropped", self.root, True, drop=True)
        self.files("local_hot", "local page cache", self.root, False, drop=False,
                   passes=HOT_PASSES)
        self.sequential("large_local", "large: local disk, dropped", self.root)

    def boto3_rows(self, endpoint_url: str) -> None:
        client = dataset.s3_client(endpoint_url, pool=self.args.readers + 4)
        drop_page_cache()
        self.record("boto3_cold", readers.read_s3(
            f"boto3 GETs, {self.args.readers} threads", client, BUCKET, PREFIX, self.order,
            self.args.readers, VERIFY_EVERY))
        if self.large is not None:
            self.record("large_boto3", readers.read_s3_stream(
                "large: boto3, one stream", client, BUCKET, PREFIX, self.large))

    def cachefs_rows(self, endpoint_url: str) -> None:
        mnt_dir, cache_dir = self.args.workdir / "mnt", self.args.workdir / "cache"
        shutil.rmtree(cache_dir, ignore_errors=True)
        with self.mount(endpoint_url, mnt_dir, cache_dir) as mnt:
            self.cachefs_cold(mnt)
        with self.mount(endpoint_url, mnt_dir, cache_dir) as mnt:
            self.cachefs_warm(mnt)

    def mount(self, endpoint_url: str, mnt_dir: Path, cache_dir: Path) -> CachefsMount:
        return CachefsMount(f"s3://{BUCKET}/{PREFIX}", mnt_dir, endpoint_url=endpoint_url,
                            cache_dir=cache_dir, cache_size=self.args.cache_size,
                            mem_cache_size=self.args.mem_cache_size,
                            extra=tuple(self.args.mount_opt))

    def cachefs_cold(self, mnt: CachefsMount) -> None:
        drop_page_cache()
        self.files("cold", "cachefs cold (S3 via proxy)", mnt.mountpoint, True, drop=False)
        self.files("hot", "cachefs hot (no drop)", mnt.mountpoint, False, drop=False,
                   passes=HOT_PASSES)
        if self.sequential("large_cold", "large: cachefs cold", mnt.mountpoint):
            self.verify_large(mnt.mountpoint, "large_cold")
        self.extra["status_cold_mount"] = settle(mnt)
        self.extra["peak_rss_cold_mount"] = mnt.peak_rss()

    def cachefs_warm(self, mnt: CachefsMount) -> None:
        self.files("warm", "cachefs warm (disk tier, dropped)", mnt.mountpoint, True, drop=True)
        if self.sequential("large_disk", "large: cachefs disk tier, dropped", mnt.mountpoint):
            self.verify_large(mnt.mountpoint, "large_disk")
        if self.sequential("large_again", "large: disk tier, dropped, opened again", mnt.mountpoint):
            self.verify_large(mnt.mountpoint, "large_again")
        self.extra["status_warm_mount"] = mnt.status()
        self.extra["peak_rss_warm_mount"] = mnt.peak_rss()

    def verify_large(self, root: Path, key: str) -> None:
        """Hash the large file again, untimed; a mismatch marks the row as failed."""
        tally = self.results[key].tally
        try:
            digest = readers.hash_file(root / self.large.path)
        except OSError as exc:
            tally.error(f"{self.large.path}: verifying: {exc}")
            return
        tally.verified += 1
        if digest != self.large.xxh3:
            tally.bad_hash += 1


def settle(mnt: CachefsMount, timeout: float = 120.0) -> dict:
    """Wait until the disk tier stops growing (fills done, no whole-object file being written);
    return the last status."""
    last, stable_since = None, time.monotonic()
    deadline = time.monotonic() + timeout
    status = mnt.status()
    while time.monotonic() < deadline:
        disk = status.get("tiers", {}).get("disk", {})
        used = disk.get("used_bytes")
        if used != last or disk.get("whole_files_writing") or disk.get("pending_fill_bytes"):
            last, stable_since = used, time.monotonic()
        elif time.monotonic() - stable_since >= 2.0:
            break
        time.sleep(0.5)
        status = mnt.status()
    return status


# ---- report --------------------------------------------------------------------------------------
TARGETS = [  # (label, cachefs row, baseline row or None, metric, minimum ratio or absolute)
    ("cold  vs boto3 (same threads)", "cold", "boto3_cold", "files_per_s", 1.0),
    ("warm  vs local disk (dropped)", "warm", "local_cold", "files_per_s", 0.5),
    ("hot   vs local page cache", "hot", "local_hot", "files_per_s", None),
    ("large disk tier vs local disk", "large_disk", "large_local", "mb_per_s", 0.8),
    ("large again (verified) vs local disk", "large_again", "large_local", "mb_per_s", 0.9),
    ("large cold vs boto3 stream", "large_cold", "large_boto3", "mb_per_s", None),
]


def ratios(bench: Bench) -> list[dict]:
    rows = []
    for label, ours, base, metric, minimum in TARGETS:
        a, b = bench.results.get(ours), bench.results.get(base)
        if a is None or b is None:
            continue
        value = getattr(a, metric) / getattr(b, metric) if getattr(b, metric) else 0.0
        rows.append({"label": label, "ratio": round(value, 3), "target": minimum,
                     "pass": None if minimum is None else value >= minimum and a.ok})
    hot = bench.results.get("hot")
    if hot is not None:
        rows.append({"label": "hot   files/s", "ratio": round(hot.files_per_s), "target": HOT_TARGET,
                     "pass": hot.files_per_s >= HOT_TARGET and hot.ok})
    return rows


def rss_check(bench: Bench) -> dict | None:
    peaks = [v for k, v in bench.extra.items() if k.startswith("peak_rss")]
    if not peaks:
        return None
    from cachefs.config import parse_size
    budget = parse_size(bench.args.mem_cache_size) + 250 * MiB
    return {"peak_rss": max(peaks), "limit": budget, "pass": max(peaks) <= budget}


def render(bench: Bench, header: str) -> str:
    lines = [header, "", f"{'row':<42} {'files/s':>9} {'MB/s':>9} {'seconds':>8}  ok"]
    for key, result in bench.results.items():
        rate = "-" if key.startswith("large") else f"{result.files_per_s:.0f}"
        lines.append(f"{result.name:<42} {rate:>9} {result.mb_per_s:>9.1f} "
                     f"{result.seconds:>8.2f}  {'yes' if result.ok else 'NO'}")
    lines += ["", f"{'ratio':<42} {'value':>9} {'target':>9}  pass"]
    for row in ratios(bench):
        target = "-" if row["target"] is None else f">= {row['target']}"
        verdict = {None: "", True: "PASS", False: "FAIL"}[row["pass"]]
        lines.append(f"{row['label']:<42} {row['ratio']:>9} {target:>9}  {verdict}")
    rss = rss_check(bench)
    if rss:
        lines.append(f"{'daemon peak RSS (VmHWM), MiB':<42} {rss['peak_rss'] / MiB:>9.0f} "
                     f"{'<= ' + str(rss['limit'] // MiB):>9}  {'PASS' if rss['pass'] else 'FAIL'}")
    return "\n".join(lines)


def describe(args: argparse.Namespace, entries: list[dataset.Entry]) -> str:
    small = [e for e in entries if not e.is_large]
    mean = sum(e.size for e in small) / max(1, len(small)) / 1024
    large = f" + {args.large} x {args.large_size // MiB} MiB" if args.large else ""
    return (f"cachefs read benchmark: {len(small)} files (mean {mean:.0f} KiB) in {args.classes} "
            f"classes{large}; {args.readers} readers; {args.server} behind a {args.latency_ms:g} ms "
            f"proxy; memory tier {args.mem_cache_size}; {os.cpu_count()} CPUs, "
            f"kernel {platform.release()}")


def write_json(path: Path, bench: Bench, header: str, timings: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"setup": {k: str(v) if isinstance(v, Path) else v for k, v in vars(bench.args).items()},
           "header": header, "rows": {k: r.to_dict() for k, r in bench.results.items()},
           "ratios": ratios(bench), "rss": rss_check(bench), "timings": timings, **bench.extra}
    path.write_text(json.dumps(doc, indent=2, default=str))


# ---- main ----------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    use_local_credentials()
    timings: dict[str, float] = {}
    t = time.monotonic()
    spec = dataset.DatasetSpec(files=args.files, classes=args.classes, file_size=args.file_size,
                               large=args.large, large_size=args.large_size, seed=args.seed)
    entries = dataset.build_local(args.workdir / "dataset", spec)
    timings["dataset_s"] = time.monotonic() - t
    header = describe(args, entries)
    print(header, flush=True)
    bench = Bench(args, entries)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(start_server(args.server, args.workdir / "server"))
        t = time.monotonic()
        dataset.upload(bench.root, entries, server.endpoint_url, BUCKET, PREFIX)
        timings["upload_s"] = time.monotonic() - t
        proxy = stack.enter_context(ProxyProcess(server.endpoint_url, args.latency_ms,
                                                 args.bandwidth_mbps))
        bench.local_rows()
        bench.boto3_rows(proxy.endpoint_url)
        if not args.skip_cachefs:
            bench.cachefs_rows(proxy.endpoint_url)
    report = render(bench, header)
    print("\n" + report)
    if args.json:
        write_json(args.json, bench, header, timings)
    errors = not all(r.ok for r in bench.results.values())
    return 1 if errors or (args.check and not targets_met(bench)) else 0


def targets_met(bench: Bench) -> bool:
    rss = rss_check(bench)
    return all(r["pass"] is not False for r in ratios(bench)) and (rss is None or rss["pass"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench_read: needs root (drop_caches and FUSE mounts)", file=sys.stderr)
        return 2
    if not args.skip_cachefs and (why := cachefs_available()):
        print(f"bench_read: the cachefs CLI does not work yet ({why}); use --skip-cachefs",
              file=sys.stderr)
        return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    try:
        return run(args)
    finally:
        if not args.keep:
            cleanup(args.workdir)


def cleanup(workdir: Path) -> None:
    from benchmarks.cachefs_mount import remove_tree
    remove_tree(workdir)


if __name__ == "__main__":
    sys.exit(main())
