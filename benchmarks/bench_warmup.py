"""The warmup benchmark: `cachefs warmup` against boto3 and the peers, in one run.

The ImageNet-like dataset (benchmarks/dataset.py) sits in a local S3 server behind the
latency proxy (10 ms per request by default). Rows:

  warmup     `cachefs warmup` of the small files        vs a parallel boto3 download to local
             (objects/s, same concurrency)                 disk (same concurrency)
  large      `cachefs warmup` of the large file through a proxy capped at --bandwidth-mbps
  epochs     8 readers, one shuffled order, page cache dropped before each:
             cachefs after warmup; cachefs cold with --prefetch-dataset; boto3 GETs;
             s3fs-fuse (no cache, and use_cache) cold + warm; rclone --vfs-cache-mode full cold + warm

Each row also says where its CPU went (benchmarks/cpu_meter.py): milliseconds per file of
the FUSE daemon, the store (S3 server + latency proxy), the client (readers, boto3 threads,
the warmup CLI) and the rest of the box, the mean busy CPUs, and the rate at which that CPU
per file would fill every CPU of the machine (``cap``): a row near its cap is bound by this
machine's CPUs, not by the store's latency.

    .venv/bin/python benchmarks/bench_warmup.py --quick
    .venv/bin/python benchmarks/bench_warmup.py --json benchmarks/results/warmup.json --png docs/warmup-bench.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import dataset, readers
from benchmarks.bench_read import BUCKET, PREFIX, resolve_server, use_local_credentials
from benchmarks.cachefs_mount import (
    CachefsMount,
    cachefs_command,
    drop_page_cache,
    remove_tree,
)
from benchmarks.cpu_meter import CPU_GROUPS, CpuMeter, cpu_text, pids_with_arg
from benchmarks.peer_mounts import RcloneMount, S3fsMount, s3fs_available
from benchmarks.readers import Result
from testing.s3_servers import ProxyProcess, start_server

MiB = 1 << 20
VERIFY_EVERY = 10


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, help="small files (default 10000; 2000 with --quick)")
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--file-size", type=dataset.parse_size, default=110 * 1024)
    p.add_argument("--large-size", type=dataset.parse_size, help="the large file (default 512MiB; 128MiB quick)")
    p.add_argument("--readers", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=32, help="warmup and boto3 download parallelism")
    p.add_argument("--latency-ms", type=float, default=10.0)
    p.add_argument("--bandwidth-mbps", type=float, default=200.0, help="proxy cap for the large-object row")
    p.add_argument("--server", choices=("auto", "moto", "seaweedfs", "rclone"), default="auto")
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp/cachefs-bench-warmup"))
    p.add_argument("--json", type=Path)
    p.add_argument("--png", type=Path, help="bar chart of the epochs and their CPU per file")
    p.add_argument("--replot", type=Path, metavar="JSON",
                   help="run nothing: print the table and draw --png from a --json file of an earlier run")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip-peers", action="store_true")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.files = args.files or (2000 if args.quick else 10_000)
    args.large_size = args.large_size or (128 * MiB if args.quick else 512 * MiB)
    args.server = resolve_server(args.server)
    return args


class Bench:
    def __init__(self, args: argparse.Namespace, entries: list[dataset.Entry]):
        self.args = args
        self.small = [e for e in entries if not e.is_large]
        self.order = random.Random(args.seed).sample(self.small, len(self.small))
        self.large = next(e for e in entries if e.is_large)
        self.rows: dict[str, dict] = {}
        self.store_pids: list[int | None] = []     # the S3 server and the latency proxy in use

    def record(self, key: str, name: str, cpu: CpuMeter | None = None, files: int = 0, **values) -> None:
        if cpu is not None:
            values |= cpu.per_file(files)
        self.rows[key] = {"name": name, **values}
        shown = "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items()
                          if not k.startswith(("cpu_", "cap_")))
        print(f"  {name:<46} {shown}", flush=True)
        if "cpu_total_ms" in values:
            print(f"  {'':<46} {cpu_text(values)}", flush=True)

    def meter(self, daemon: list[int | None] = ()) -> CpuMeter:
        return CpuMeter(daemon=daemon, store=self.store_pids)

    def epoch(self, key: str, name: str, root: Path, daemon: list[int | None]) -> Result:
        drop_page_cache()
        with self.meter(daemon) as cpu:
            result = readers.read_files(name, root, self.order, self.args.readers, VERIFY_EVERY)
        self.record(key, name, cpu, result.tally.files, files_s=result.files_per_s, mb_s=result.mb_per_s,
                    seconds=result.seconds, ok=result.ok and result.tally.files == len(self.order))
        return result

    def work(self, name: str) -> Path:
        path = self.args.workdir / name
        remove_tree(path)
        return path

    # ---- rows ----
    def boto3_download(self, endpoint_url: str) -> None:
        client = dataset.s3_client(endpoint_url, pool=self.args.concurrency + 4)
        client.head_bucket(Bucket=BUCKET)
        out = self.work("download")

        def fetch(entry: dataset.Entry) -> None:
            target = out / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            body = client.get_object(Bucket=BUCKET, Key=dataset.object_key(PREFIX, entry.path))["Body"].read()
            target.write_bytes(body)

        start = time.monotonic()
        with self.meter() as cpu, ThreadPoolExecutor(self.args.concurrency) as pool:
            list(pool.map(fetch, self.order))
        seconds = time.monotonic() - start
        self.record("boto3_download", f"boto3 download to disk, {self.args.concurrency} threads", cpu,
                    len(self.order), objects_s=len(self.order) / seconds, seconds=seconds)
        remove_tree(out)

    def mount(self, endpoint_url: str, name: str, *extra: str) -> CachefsMount:
        return CachefsMount(f"s3://{BUCKET}/{PREFIX}", self.work(name + "-mnt"), endpoint_url=endpoint_url,
                            cache_dir=self.work(name + "-cache"), cache_size="50G", mem_cache_size="1G",
                            extra=("--max-connections", str(self.args.concurrency + 40), *extra))

    def warmup(self, mnt: CachefsMount, target: Path, cpu: CpuMeter | None = None) -> dict:
        start = time.monotonic()
        with cpu or contextlib.nullcontext():
            result = subprocess.run(cachefs_command() + ["warmup", "--json", "--concurrency",
                                                         str(self.args.concurrency), str(target)],
                                    capture_output=True, text=True, timeout=3600, check=False)
        wall = time.monotonic() - start
        lines = [json.loads(x) for x in result.stdout.splitlines() if x.strip()]
        done = [x for x in lines if x.get("event") == "done"]
        if result.returncode != 0 or not done:
            raise RuntimeError(f"warmup failed ({result.returncode}): {result.stderr.strip()}")
        return done[-1] | {"wall_s": wall}

    def cachefs_rows(self, endpoint_url: str) -> None:
        with self.mount(endpoint_url, "warm") as mnt:
            drop_page_cache()
            cpu = self.meter([mnt.pid])       # over the CLI's wall time: start-up included
            done = self.warmup(mnt, mnt.mountpoint / "train", cpu)
            took = done["elapsed_s"]          # in the daemon: listing + fetching, not CLI start-up
            self.record("warmup", f"cachefs warmup, concurrency {self.args.concurrency}", cpu,
                        done["fetched_files"], objects_s=done["fetched_files"] / took,
                        mb_s=done["fetched_bytes"] / took / 1e6, seconds=took, wall_s=done["wall_s"],
                        failed=done["failed_files"])
            self.epoch("cachefs_warm", "cachefs epoch after warmup", mnt.mountpoint, [mnt.pid])
        with self.mount(endpoint_url, "prefetch", "--prefetch-dataset") as mnt:
            self.epoch("cachefs_prefetch_cold", "cachefs cold epoch, --prefetch-dataset", mnt.mountpoint,
                       [mnt.pid])

    def large_row(self, endpoint_url: str) -> None:
        with self.mount(endpoint_url, "large") as mnt:
            drop_page_cache()
            done = self.warmup(mnt, mnt.mountpoint / self.large.path)
            mb_s = done["fetched_bytes"] / done["elapsed_s"] / 1e6
            self.record("large", f"cachefs warmup of {self.large.size // MiB} MiB, proxy cap "
                        f"{self.args.bandwidth_mbps:g} MB/s", mb_s=mb_s, seconds=done["elapsed_s"],
                        wall_s=done["wall_s"])

    def boto3_epoch(self, endpoint_url: str) -> None:
        client = dataset.s3_client(endpoint_url, pool=self.args.readers + 4)
        drop_page_cache()
        with self.meter() as cpu:
            result = readers.read_s3(f"boto3 GETs, {self.args.readers} threads", client, BUCKET, PREFIX,
                                     self.order, self.args.readers, VERIFY_EVERY)
        self.record("boto3_epoch", result.name, cpu, result.tally.files, files_s=result.files_per_s,
                    mb_s=result.mb_per_s, seconds=result.seconds, ok=result.ok)

    def peer_rows(self, endpoint_url: str) -> None:
        if s3fs_available():
            for key, label, cached in (("s3fs", "s3fs-fuse", False), ("s3fs_cache", "s3fs-fuse use_cache", True)):
                cache = self.work(key + "-cache") if cached else None
                with S3fsMount(BUCKET, PREFIX, self.work(key + "-mnt"), endpoint_url, self.args.workdir,
                               cache_dir=cache) as mnt:
                    daemon = pids_with_arg(mnt.mountpoint)     # s3fs daemonizes itself
                    self.epoch(f"{key}_cold", f"{label} cold", mnt.mountpoint, daemon)
                    self.epoch(f"{key}_warm", f"{label} warm", mnt.mountpoint, daemon)
        with RcloneMount(BUCKET, PREFIX, self.work("rclone-mnt"), endpoint_url, self.work("rclone-cache")) as mnt:
            self.epoch("rclone_cold", "rclone vfs-cache full cold", mnt.mountpoint, [mnt.proc.pid])
            self.epoch("rclone_warm", "rclone vfs-cache full warm", mnt.mountpoint, [mnt.proc.pid])


TARGETS = [  # label, ours, metric, baseline (row or a number), metric, minimum
    ("warmup objects/s vs boto3 download", "warmup", "objects_s", "boto3_download", "objects_s", 0.9),
    ("large warmup MB/s vs proxy bandwidth", "large", "mb_s", None, None, 0.8),
    ("epoch after warmup vs s3fs use_cache warm", "cachefs_warm", "files_s", "s3fs_cache_warm", "files_s", 5.0),
    ("epoch after warmup vs rclone warm", "cachefs_warm", "files_s", "rclone_warm", "files_s", 3.0),
    ("cold --prefetch-dataset vs boto3 GETs", "cachefs_prefetch_cold", "files_s", "boto3_epoch", "files_s", 3.0),
]


def ratios(rows: dict[str, dict], bandwidth_mbps: float) -> list[dict]:
    out = []
    for label, ours, metric, base, base_metric, minimum in TARGETS:
        a = rows.get(ours)
        b = bandwidth_mbps if base is None else rows.get(base, {}).get(base_metric)
        if a is None or not b:
            continue
        value = a[metric] / b
        out.append({"label": label, "ratio": round(value, 2), "target": minimum, "pass": value >= minimum})
    return out


def render(rows: dict[str, dict], bandwidth_mbps: float, header: str) -> str:
    lines = [header, "",
             ("| row | files/s | MB/s | seconds | CPUs busy | CPU ms/file: daemon / store / client / other | "
              "CPU cap files/s |"),
             "|---|---:|---:|---:|---:|---|---:|"]
    for row in rows.values():
        rate = row.get("files_s", row.get("objects_s"))
        cpu = ["-", "-", "-"]
        if "cpu_total_ms" in row:
            cpu = [f"{row['cpu_cores']:.2f}",
                   " / ".join(f"{row.get(f'cpu_{name}_ms', 0):.2f}" for name in CPU_GROUPS[:4]),
                   f"{row['cap_files_s']:.0f}"]
        mb_s = row.get("mb_s")
        lines.append(f"| {row['name']} | {'-' if rate is None else f'{rate:.0f}'} | "
                     f"{'-' if mb_s is None else f'{mb_s:.1f}'} | "
                     f"{row['seconds']:.1f} | {' | '.join(cpu)} |")
    lines += ["", "| ratio | value | target | pass |", "|---|---:|---:|---|"]
    for r in ratios(rows, bandwidth_mbps):
        lines.append(f"| {r['label']} | {r['ratio']} | >= {r['target']} | {'PASS' if r['pass'] else 'FAIL'} |")
    return "\n".join(lines)


def chart(rows: dict[str, dict], setup: dict[str, str], path: Path) -> None:
    """Files/s of each epoch row, and beside it where each row's CPU per file went.
    ``setup`` is the run's arguments as strings, as the --json file keeps them."""
    caption = f"files/s, {setup['readers']} readers, {float(setup['latency_ms']):g} ms store latency"
    title = f"One epoch of {setup['files']} x ~{int(setup['file_size']) // 1024} KiB files"
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows.values() if "files_s" in r][::-1]
    names = [r["name"] for r in rows]
    fig, (rate_ax, cpu_ax) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 1.4), sharey=True,
                                          gridspec_kw={"width_ratios": [3, 2]})
    colors = ["#2a7" if n.startswith("cachefs") else "#888" for n in names]
    rate_ax.barh(names, [r["files_s"] for r in rows], color=colors)
    rate_ax.set_xlabel(caption)
    rate_ax.set_title(title)
    for i, r in enumerate(rows):
        rate_ax.text(r["files_s"], i, f" {r['files_s']:.0f}", va="center", fontsize=8)
    left = [0.0] * len(rows)
    for group, color in zip(CPU_GROUPS[:4], ("#2a7", "#c84", "#58c", "#bbb"), strict=False):
        widths = [r.get(f"cpu_{group}_ms", 0.0) for r in rows]
        cpu_ax.barh(names, widths, left=left, color=color, label=group)
        left = [a + b for a, b in zip(left, widths, strict=False)]
    cpu_ax.set_xlabel("CPU ms per file, all processes on the machine")
    cpu_ax.set_title("Where the CPU went")
    cpu_ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def describe(args: argparse.Namespace) -> str:
    return (f"cachefs warmup benchmark: {args.files} files (~{args.file_size // 1024} KiB) in {args.classes} "
            f"classes + 1 x {args.large_size // MiB} MiB; {args.server} behind a {args.latency_ms:g} ms proxy; "
            f"{args.readers} readers; warmup/download concurrency {args.concurrency}; {os.cpu_count()} CPUs, "
            f"kernel {platform.release()}; {S3fsMount.version() if s3fs_available() else 's3fs missing'}; "
            f"{RcloneMount.version()}")


def run(args: argparse.Namespace) -> int:
    use_local_credentials()
    spec = dataset.DatasetSpec(files=args.files, classes=args.classes, file_size=args.file_size, large=1,
                               large_size=args.large_size, seed=args.seed)
    entries = dataset.build_local(args.workdir / "dataset", spec)
    header = describe(args)
    print(header, flush=True)
    bench = Bench(args, entries)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(start_server(args.server, args.workdir / "server"))
        dataset.upload(args.workdir / "dataset" / "data", entries, server.endpoint_url, BUCKET, PREFIX)
        with ProxyProcess(server.endpoint_url, args.latency_ms) as proxy:
            bench.store_pids = [server.pid, proxy.pid]
            bench.boto3_download(proxy.endpoint_url)
            bench.cachefs_rows(proxy.endpoint_url)
            bench.boto3_epoch(proxy.endpoint_url)
            if not args.skip_peers:
                bench.peer_rows(proxy.endpoint_url)
        with ProxyProcess(server.endpoint_url, args.latency_ms, args.bandwidth_mbps) as capped:
            bench.store_pids = [server.pid, capped.pid]
            bench.large_row(capped.endpoint_url)
    report = render(bench.rows, args.bandwidth_mbps, header)
    print("\n" + report)
    setup = {k: str(v) for k, v in vars(args).items()}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"header": header, "rows": bench.rows,
                                         "ratios": ratios(bench.rows, args.bandwidth_mbps), "setup": setup},
                                        indent=2))
    if args.png:
        chart(bench.rows, setup, args.png)
    return 0 if all(r.get("ok", True) for r in bench.rows.values()) else 1


def replot(args: argparse.Namespace) -> int:
    saved = json.loads(args.replot.read_text())
    setup = saved["setup"]
    print(render(saved["rows"], float(setup["bandwidth_mbps"]), saved["header"]))
    if args.png:
        chart(saved["rows"], setup, args.png)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        return replot(args)
    if os.geteuid() != 0:
        print("bench_warmup: needs root (drop_caches and FUSE mounts)", file=sys.stderr)
        return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    try:
        return run(args)
    finally:
        if not args.keep:
            for child in ("download", "warm-mnt", "warm-cache", "prefetch-mnt", "prefetch-cache", "large-mnt",
                          "large-cache", "rclone-mnt", "rclone-cache", "s3fs-mnt", "s3fs_cache-mnt",
                          "s3fs_cache-cache", "server"):
                remove_tree(args.workdir / child)     # mountpoints are unmounted by then: empty dirs
            (args.workdir / "s3fs.passwd").unlink(missing_ok=True)
            shutil.rmtree(args.workdir / "dataset", ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
