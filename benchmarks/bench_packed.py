"""The packed benchmark: `cachefs pack`, the native loader and the packed mount beside
boto3, local disk, the unpacked mount and four peers (MosaicML Streaming, LitData, WebDataset,
s3torchconnector), on one S3 server behind the latency proxy, in one run.

    .venv/bin/python -m benchmarks.bench_packed --setup          # the peers' virtualenvs, once
    .venv/bin/python -m benchmarks.bench_packed --quick          # 2,000 files, a few minutes
    .venv/bin/python -m benchmarks.bench_packed --json benchmarks/results/packed.json \
        --png docs/img/packed_bench.png                          # 10,000 x 110 KiB, ~20 min

See benchmarks/README.md ("The packed benchmark") for the rows, the targets and what each
ratio compares.
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

from benchmarks import dataset, packed_rows, readers
from benchmarks.bench_read import resolve_server, settle, use_local_credentials
from benchmarks.cachefs_mount import CachefsMount, cannot_run, drop_page_cache, remove_tree
from benchmarks.cpu_meter import CPU_GROUPS, CpuMeter, cpu_text
from benchmarks.readers import Result, Tally
from testing.s3_servers import ProxyProcess, start_server

MiB = 1 << 20
BUCKET, SRC, PACKED, COPY = "bench", "imagenet", "packed", "copy"
VERIFY_EVERY = 10
STEPS = ("local", "boto3", "pack", "loader", "unpacked_mount", "packed_mount", "peers")
# The DataLoader rows' batch size: the PyTorch ImageNet example's loader config (docs/design.md, measured facts, batch
# 128, 8 workers). Training code takes batches; one sample per item (--batch-size 0) measures
# DataLoader's own per-item cost (its queues and profiler scope in the training process) as much as
# the dataset's.
BATCH = 128
AGAIN = ", again (after the rows it is compared with)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, help="small files (default 10000; 2000 with --quick)")
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--size", type=dataset.parse_size, default=110 * 1024, help="mean file size (110KiB)")
    p.add_argument("--latency-ms", type=float, default=10.0, help="proxy delay per request")
    p.add_argument("--readers", type=int, default=8, help="boto3 threads and mount reader processes")
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers (loader and peer rows)")
    p.add_argument("--batch-size", type=int, default=BATCH,
                   help=f"DataLoader batch size of the loader, local-disk and peer rows, batches collated as "
                        f"lists of raw samples (default {BATCH}); 0: batch_size=None, one sample per item")
    p.add_argument("--pack-concurrency", type=int, default=32,
                   help="`cachefs pack --concurrency` and the boto3 copy's threads (default 32)")
    p.add_argument("--shard-size", default="256M", help="`cachefs pack --shard-size` (default 256M)")
    p.add_argument("--server", choices=("auto", "moto", "seaweedfs", "rclone"), default="auto")
    p.add_argument("--proxy", choices=("splice", "copy"), default="splice",
                   help="how the latency proxy moves answers: in the kernel (splice, ~0.3-0.5 ms of CPU per MiB) "
                        "or through Python (copy, ~0.8-0.9 ms; the default before 2026-11-27 evening)")
    p.add_argument("--peers", default=",".join(packed_rows.PEER_REQUIREMENTS),
                   help="comma-separated peers to run (default all; '' for none)")
    p.add_argument("--rows", default=",".join(STEPS),
                   help=f"comma-separated groups of rows to run (default all: {','.join(STEPS)}); "
                   "loader and packed_mount need pack, which is then run too")
    p.add_argument("--mount-opt", action="append", default=[], help="extra `cachefs mount` flag")
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp/cachefs-bench-packed"))
    p.add_argument("--json", type=Path, help="write all results here")
    p.add_argument("--png", type=Path, help="draw the chart here (matplotlib)")
    p.add_argument("--replot", type=Path, metavar="JSON", help="only draw --png from an earlier --json")
    p.add_argument("--quick", action="store_true", help="2,000 files")
    p.add_argument("--keep", action="store_true", help="keep the workdir (reuses the local dataset)")
    p.add_argument("--setup", action="store_true",
                   help="create the peers' virtualenvs in .bench-venvs/ (pip from PyPI) and exit")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.files = args.files if args.files is not None else (2000 if args.quick else 10_000)
    args.peers = [x for x in args.peers.split(",") if x]
    args.rows = [x for x in args.rows.split(",") if x]
    if unknown := set(args.rows) - set(STEPS):
        p.error(f"unknown row group(s): {', '.join(sorted(unknown))}")
    if {"loader", "packed_mount"} & set(args.rows) and "pack" not in args.rows:
        args.rows.append("pack")
    if unknown := set(args.peers) - set(packed_rows.PEER_REQUIREMENTS):
        p.error(f"unknown peer(s): {', '.join(sorted(unknown))}")
    return args


# ---- the run -------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace, entries: list[dataset.Entry]):
        self.args = args
        self.root = args.workdir / "dataset" / "data"
        self.entries = entries
        self.order = random.Random(args.seed).sample(entries, len(entries))
        self.rows: dict[str, dict] = {}
        self.extra: dict[str, object] = {}
        self.env = {**os.environ}
        self.store_pids: list[int | None] = []     # the S3 server and the latency proxy

    def meter(self, daemon: list[int | None] = ()) -> CpuMeter:
        return CpuMeter(daemon=daemon, store=self.store_pids)

    def record(self, key: str, result: Result | None = None, cpu: CpuMeter | None = None, **fields) -> dict:
        row = {"name": fields.pop("name", result.name if result else key)}
        if result is not None:
            row.update(result.to_dict(), ok=result.ok)
        if cpu is not None and result is not None:
            row.update(cpu.per_file(result.tally.files))
        row.update(fields)
        self.rows[key] = row
        rate = f"{row['files_per_s']:>8.0f} files/s" if row.get("files_per_s") else " " * 16
        seconds = f"{row['seconds']:>7.2f} s" if row.get("seconds") is not None else ""
        note = f"  {row['note']}" if row.get("note") else ""
        err = "" if row.get("ok", True) else f"  ERRORS: {row.get('first_error') or row.get('error')}"
        print(f"  {row['name']:<44} {rate} {seconds}{note}{err}", flush=True)
        if "cpu_total_ms" in row:
            print(f"  {'':<44} {cpu_text(row)}", flush=True)
        return row

    # -- baselines
    # The baselines run twice, before and after the rows compared with them (AGAIN), and ratios
    # use the mean of the two: this VM's speed drifts over minutes, and one baseline row caught
    # in a slow stretch moved a ratio by 1.5x (boto3 at 287 files/s, ~400 in the rounds around it).
    def local_rows(self, again: bool = False) -> None:
        drop_page_cache()
        ds = packed_rows.FileDataset(self.root, [e.path for e in self.entries])
        with self.meter() as cpu:
            result = packed_rows.loader_epoch(f"local disk, DataLoader {self.args.workers} workers"
                                              + (AGAIN if again else ""), ds,
                                              self.entries, self.args.workers, self.args.seed,
                                              self.args.batch_size)
        self.record("local_loader" + ("_again" if again else ""), result, cpu)

    def boto3_rows(self, endpoint_url: str, again: bool = False) -> None:
        client = dataset.s3_client(endpoint_url, pool=self.args.readers + 4)
        drop_page_cache()
        with self.meter() as cpu:
            result = readers.read_s3(f"boto3 GETs, {self.args.readers} threads" + (AGAIN if again else ""),
                                     client, BUCKET, SRC, self.order, self.args.readers, VERIFY_EVERY)
        self.record("boto3" + ("_again" if again else ""), result, cpu, gets=len(self.order))

    def pack_rows(self, endpoint_url: str) -> None:
        n = self.args.pack_concurrency
        client = dataset.s3_client(endpoint_url, pool=n + 4)
        with self.meter() as cpu:
            result = packed_rows.boto3_copy(f"boto3 copy (GET+PUT), {n} threads", client, BUCKET, SRC, COPY,
                                            self.entries, n)
        self.record("copy", result, cpu)
        with self.meter() as pack_cpu:     # the CLI is a child this process waits for: client CPU
            run = packed_rows.pack_run(f"s3://{BUCKET}/{SRC}", f"s3://{BUCKET}/{PACKED}", endpoint_url, n,
                                       self.args.shard_size, self.env)
        summary = run["summary"]
        tally = Tally(files=int(summary.get("total_files", 0)), bytes=int(summary.get("total_bytes", 0)))
        if run["returncode"] != 0:
            tally.error(f"cachefs pack exited {run['returncode']}: {run['stderr'][-300:]}")
        elif tally.files != len(self.entries) or tally.bytes != sum(e.size for e in self.entries):
            tally.error(f"packed {tally.files} files / {tally.bytes} bytes, expected {len(self.entries)}")
        from cachefs.config import parse_size
        bound = 2 * parse_size(self.args.shard_size) + 256 * MiB
        self.record("pack", Result(f"cachefs pack, --concurrency {n}", run["seconds"], tally), pack_cpu,
                    peak_rss=run["peak_rss"], rss_bound=bound, shards=summary.get("total_shards"),
                    note=f"peak RSS {run['peak_rss'] / MiB:.0f} MiB (bound {bound // MiB})")

    # -- cachefs rows
    def mount(self, url: str, endpoint_url: str, cache: Path) -> CachefsMount:
        return CachefsMount(url, self.args.workdir / "mnt", endpoint_url=endpoint_url, cache_dir=cache,
                            extra=tuple(self.args.mount_opt))

    def loader_rows(self, endpoint_url: str) -> None:
        from cachefs.data import PackedIterableDataset
        cache = self.args.workdir / "cache-loader"
        shutil.rmtree(cache, ignore_errors=True)
        for key, label in (("loader_cold", "cold: empty cache, S3 via the mount"),
                           ("loader_warm", "warm: remounted, disk tier, page cache dropped")):
            name = f"cachefs.data loader, {self.args.workers} workers, {label}"
            with self.mount(f"s3://{BUCKET}/{PACKED}", endpoint_url, cache) as mnt:
                root = packed_root(mnt.mountpoint)
                if root is None:
                    self.record(key, name=name, ok=True, note="n/a (no manifest.json reachable in the mount)")
                    continue
                drop_page_cache()
                before = gets(mnt)
                ds = PackedIterableDataset(root, seed=self.args.seed)
                try:
                    with self.meter([mnt.pid]) as cpu:
                        result = packed_rows.loader_epoch(name, ds, self.entries, self.args.workers,
                                                          batch_size=self.args.batch_size)
                finally:
                    ds.close()
                fds = (mnt.status().get("loader_fds") or {}).get("served", 0)
                self.record(key, result, cpu, gets=gets(mnt) - before, loader_root=str(root), cache_fds=fds,
                            note=f"{fds} cache files read directly")
                if key == "loader_cold":
                    settle(mnt)

    def packed_mount_row(self, endpoint_url: str) -> None:
        cache = self.args.workdir / "cache-packed"
        shutil.rmtree(cache, ignore_errors=True)
        name = f"cachefs mount, packed, cold, {self.args.readers} readers"
        with self.mount(f"s3://{BUCKET}/{PACKED}", endpoint_url, cache) as mnt:
            if not (mnt.mountpoint / self.order[0].path).exists():
                self.record("packed_cold", name=name, ok=True,
                            note="n/a (packed view not available: the mount shows the raw layout)")
                return
            drop_page_cache()
            before = gets(mnt)
            with self.meter([mnt.pid]) as cpu:
                result = readers.read_files(name, mnt.mountpoint, self.order, self.args.readers, VERIFY_EVERY)
            self.record("packed_cold", result, cpu, gets=gets(mnt) - before)
            self.extra["status_packed_mount"] = mnt.status()
            self.extra["peak_rss_packed_mount"] = mnt.peak_rss()

    def unpacked_mount_rows(self, endpoint_url: str, again: bool = False) -> None:
        """The unpacked mount's cold epoch, then an epoch from its disk tier after a remount; with
        ``again``, only the disk-tier epoch once more (the cache the first left behind), after the
        packed mount's row that is compared with it."""
        cache = self.args.workdir / "cache-unpacked"
        if again:
            if not (self.rows.get("unpacked_disk") or {}).get("ok"):
                return                 # no disk tier to read again: a cold epoch is no baseline
            rows = (("unpacked_disk_again", f"disk tier, page cache dropped{AGAIN}"),)
        else:
            shutil.rmtree(cache, ignore_errors=True)
            rows = (("unpacked_cold", "cold"), ("unpacked_disk", "disk tier, page cache dropped"))
        for key, label, in rows:
            name = f"cachefs mount, unpacked, {label}, {self.args.readers} readers"
            with self.mount(f"s3://{BUCKET}/{SRC}", endpoint_url, cache) as mnt:
                drop_page_cache()
                before = gets(mnt)
                with self.meter([mnt.pid]) as cpu:
                    result = readers.read_files(name, mnt.mountpoint, self.order, self.args.readers, VERIFY_EVERY)
                self.record(key, result, cpu, gets=gets(mnt) - before)
                if key == "unpacked_cold":
                    settle(mnt)

    # -- peers
    def peer_rows(self, endpoint_url: str, direct_url: str) -> None:
        job = {"endpoint_url": endpoint_url, "direct_url": direct_url, "bucket": BUCKET, "src_prefix": SRC,
               "root": str(self.root), "files": [[e.path, e.size] for e in self.entries],
               "workers": self.args.workers, "batch_size": self.args.batch_size, "seed": self.args.seed,
               "store_pids": [pid for pid in self.store_pids if pid]}   # metered in the peer's process
        total = sum(e.size for e in self.entries)
        for peer in self.args.peers:
            drop_page_cache()
            out = packed_rows.run_peer(peer, {**job, "dst_prefix": f"peer-{peer}"},
                                       self.args.workdir / "peers")
            self.extra[f"peer_{peer}"] = out
            label = packed_rows.PEER_LABELS[peer]
            version = out.get("version", "?")
            if out.get("convert_s") is not None:
                conv = Tally(files=len(self.entries), bytes=total)
                self.record(f"{peer}_convert", Result(f"{label} {version}, converter", out["convert_s"], conv),
                            version=version, note="local files -> S3")
            if "error" in out:
                self.record(f"{peer}_epoch", name=f"{label} {version}, first epoch", ok=False,
                            error=out["error"], version=version)
                continue
            tally = Tally(files=out["files"], bytes=out["bytes"], bad_size=out["bad_size"])
            if out["missing"]:
                tally.error(f"{out['missing']} files never yielded")
            self.record(f"{peer}_epoch", Result(f"{label} {version}, first epoch, {self.args.workers} workers",
                                                out["epoch_s"], tally), version=version, **out.get("cpu", {}))


def packed_root(mountpoint: Path) -> Path | None:
    """Where the packed layout (manifest.json, index/, shards/) is reachable in a mount of DST: its
    root, or a hidden directory of it (the packed view, which shows the original tree, keeps it in
    ``.cachefs-packed``, not listed)."""
    for root in (mountpoint, mountpoint / ".cachefs-packed"):
        if (root / "manifest.json").exists():
            return root
    with contextlib.suppress(OSError):
        for child in sorted(mountpoint.iterdir()):
            if child.name.startswith(".") and (child / "manifest.json").exists():
                return child
    return None


def gets(mnt: CachefsMount) -> int:
    """Object GETs the mount sent so far (``cachefs status``: store requests by op and status)."""
    return int(sum(v for k, v in mnt.status()["store_requests"].items() if k.startswith("get")))


# ---- ratios and the table ------------------------------------------------------------------------
def _rate(rows: dict, key: str) -> float | None:
    row = rows.get(key)
    if not row or not row.get("ok", False) or not row.get("seconds"):
        return None
    return row["files_per_s"]


def _baseline(rows: dict, key: str) -> tuple[float | None, str]:
    """The mean rate of a baseline row and its rerun (``key``_again), and a label suffix."""
    rates = [r for r in (_rate(rows, key), _rate(rows, key + "_again")) if r is not None]
    if not rates:
        return None, ""
    return sum(rates) / len(rates), " (mean of the rows before and after)" if len(rates) == 2 else ""


def ratios(rows: dict, files: int) -> list[dict]:
    def ratio(label: str, a: str, b: str | float | None, target: float | None) -> dict:
        ra = _rate(rows, a)
        rb, suffix = (b, "") if isinstance(b, float) or b is None else _baseline(rows, b)
        value = ra / rb if ra is not None and rb else None
        return {"label": label + suffix, "value": value, "target": target,
                "pass": None if value is None or target is None else value >= target}

    peers = [(k, _rate(rows, k)) for k in rows if k.endswith("_epoch") and _rate(rows, k)]
    best = max(peers, key=lambda kv: kv[1], default=(None, None))
    out = [
        ratio("packed mount cold / boto3", "packed_cold", "boto3", 5.0),
        ratio("packed mount cold / unpacked disk tier", "packed_cold", "unpacked_disk", 0.9),
        ratio(f"loader cold / best peer ({best[0] and best[0].removesuffix('_epoch')})", "loader_cold",
              float(best[1]) if best[1] else None, 1.5),
        ratio("loader warm / local disk (same workers)", "loader_warm", "local_loader", 0.8),
        ratio("cachefs pack / boto3 copy", "pack", "copy", 1.0),
        ratio("unpacked mount cold / boto3", "unpacked_cold", "boto3", None),
        ratio("loader cold / boto3", "loader_cold", "boto3", None),
    ]
    for key in ("packed_cold", "loader_cold"):
        row = rows.get(key)
        if row and row.get("gets") is not None:
            out.append({"label": f"GETs per epoch, {key.replace('_', ' ')} (<= files/20 = {files // 20})",
                        "value": row["gets"], "target": files / 20, "pass": row["gets"] <= files / 20,
                        "at_most": True})
    pack = rows.get("pack")
    if pack and pack.get("peak_rss"):
        out.append({"label": f"cachefs pack peak RSS, MiB (<= {pack['rss_bound'] // MiB})",
                    "value": pack["peak_rss"] / MiB, "target": pack["rss_bound"] / MiB,
                    "pass": pack["peak_rss"] <= pack["rss_bound"], "at_most": True})
    return out


def render(rows: dict, rats: list[dict], header: str) -> str:
    lines = [header, "", f"{'row':<62} {'files/s':>8} {'MB/s':>7} {'seconds':>8} {'GETs':>6}  ok   "
                         f"{'CPUs':>4}  CPU ms/file: daemon / store / client / other{'cap':>12}"]
    for row in rows.values():
        if row.get("seconds") is None:
            lines.append(f"{row['name']:<62} {row.get('note') or row.get('error', '')}")
            continue
        get_count = row.get("gets")
        lines.append(f"{row['name']:<62} {row['files_per_s']:>8.0f} {row['mb_per_s']:>7.1f} "
                     f"{row['seconds']:>8.2f} {'-' if get_count is None else get_count:>6}  "
                     f"{'yes' if row.get('ok') else 'NO ':<3}  {cpu_columns(row)}")
    lines += ["", f"{'ratio':<62} {'value':>8} {'target':>8}  met"]
    for r in rats:
        value = "n/a" if r["value"] is None else f"{r['value']:.0f}" if r.get("at_most") else f"{r['value']:.2f}"
        target = "-" if r["target"] is None else ("<= " if r.get("at_most") else ">= ") + f"{r['target']:g}"
        verdict = {None: "", True: "met", False: "NOT MET"}[r["pass"]]
        lines.append(f"{r['label']:<62} {value:>8} {target:>8}  {verdict}")
    return "\n".join(lines)


def cpu_columns(row: dict) -> str:
    """Busy CPUs, CPU ms per file by group and the CPU cap (files/s) of a metered row, or ''."""
    if "cpu_total_ms" not in row:
        return ""
    groups = " / ".join("-" if f"cpu_{g}_ms" not in row else f"{row[f'cpu_{g}_ms']:.2f}" for g in CPU_GROUPS[:4])
    return f"{row['cpu_cores']:>4.2f}  {groups:<42} {row['cap_files_s']:>8.0f}"


def describe(args: argparse.Namespace, entries: list[dataset.Entry], server: str) -> str:
    mean = sum(e.size for e in entries) / max(1, len(entries)) / 1024
    import torch
    return (f"cachefs packed benchmark: {len(entries)} files (mean {mean:.0f} KiB); {server} behind a "
            f"{args.latency_ms:g} ms proxy ({args.proxy}); {args.readers} readers, {args.workers} DataLoader workers "
            f"(batch {args.batch_size or 'None'}), pack "
            f"concurrency {args.pack_concurrency}, shard size {args.shard_size}; torch {torch.__version__}; "
            f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, kernel {platform.release()}")


def plot(doc: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = doc["rows"]
    epochs = [(r["name"], r["files_per_s"]) for k, r in rows.items()
              if r.get("seconds") and r.get("ok") and k not in ("copy", "pack") and not k.endswith("_convert")]
    convert = [(r["name"], r["mb_per_s"]) for k, r in rows.items()
               if r.get("seconds") and r.get("ok") and (k in ("copy", "pack") or k.endswith("_convert"))]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 8), height_ratios=[max(1, len(epochs)), max(1, len(convert))])
    for ax, data, xlabel in ((ax1, epochs, "files/s"), (ax2, convert, "MB/s")):
        names = [n for n, _ in data][::-1]
        values = [v for _, v in data][::-1]
        colors = ["tab:blue" if ("cachefs" in n) else "tab:gray" for n in names]
        ax.barh(names, values, color=colors)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:,.0f}", va="center", fontsize=8)
        ax.set_xlabel(xlabel)
        ax.tick_params(axis="y", labelsize=8)
    ax1.set_title("Epochs (one pass over the files)", fontsize=10)
    ax2.set_title("Packing / converting the same files", fontsize=10)
    import textwrap
    fig.suptitle("\n".join(textwrap.wrap(doc["header"], 150)), fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ---- main ----------------------------------------------------------------------------------------
def make_doc(bench: Bench, header: str, timings: dict) -> dict:
    return {"header": header, "setup": {k: str(v) for k, v in vars(bench.args).items()}, "rows": bench.rows,
            "ratios": ratios(bench.rows, len(bench.entries)), "timings": timings, **bench.extra}


def write_json(path: Path, bench: Bench, header: str, timings: dict) -> dict:
    doc = make_doc(bench, header, timings)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str))
    return doc


def wanted(step: str, rows: list[str]) -> bool:
    """A requested group of rows; a baseline reruns after the rows compared with it, if they run."""
    if step == "local_again":
        return "local" in rows and "loader" in rows
    if step == "boto3_again":
        return "boto3" in rows and any(r in rows for r in ("packed_mount", "unpacked_mount"))
    if step == "unpacked_disk_again":
        return "unpacked_mount" in rows and "packed_mount" in rows
    return step in rows


def run(args: argparse.Namespace) -> int:
    use_local_credentials()
    server_name = resolve_server(args.server)
    spec = dataset.DatasetSpec(files=args.files, classes=args.classes, file_size=args.size, large=0,
                               seed=args.seed)
    entries = dataset.build_local(args.workdir / "dataset", spec)
    header = describe(args, entries, server_name)
    print(header, flush=True)
    bench = Bench(args, entries)
    timings: dict[str, float] = {}
    shutil.rmtree(args.workdir / "server", ignore_errors=True)   # a fresh bucket every run
    shutil.rmtree(args.workdir / "peers", ignore_errors=True)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(start_server(server_name, args.workdir / "server"))
        timings["upload_s"] = dataset.upload(bench.root, entries, server.endpoint_url, BUCKET, SRC)
        proxy = stack.enter_context(ProxyProcess(server.endpoint_url, args.latency_ms, splice=args.proxy == "splice"))
        bench.store_pids = [server.pid, proxy.pid]
        steps = {"local": bench.local_rows, "boto3": lambda: bench.boto3_rows(proxy.endpoint_url),
                 "pack": lambda: bench.pack_rows(proxy.endpoint_url),
                 "loader": lambda: bench.loader_rows(proxy.endpoint_url),
                 "local_again": lambda: bench.local_rows(again=True),
                 "unpacked_mount": lambda: bench.unpacked_mount_rows(proxy.endpoint_url),
                 "packed_mount": lambda: bench.packed_mount_row(proxy.endpoint_url),
                 "unpacked_disk_again": lambda: bench.unpacked_mount_rows(proxy.endpoint_url, again=True),
                 "boto3_again": lambda: bench.boto3_rows(proxy.endpoint_url, again=True),
                 "peers": lambda: bench.peer_rows(proxy.endpoint_url, server.endpoint_url)}
        for name, step in steps.items():
            if not wanted(name, args.rows):
                continue
            t = time.monotonic()
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - one broken group must not lose the others' rows
                bench.record(f"{name}_failed", name=f"{name}: failed", ok=False, error=f"{type(exc).__name__}: {exc}")
            timings[f"{name}_s"] = round(time.monotonic() - t, 2)
            if args.json:
                write_json(args.json, bench, header, timings)
    rats = ratios(bench.rows, len(entries))
    print("\n" + render(bench.rows, rats, header), flush=True)
    doc = write_json(args.json, bench, header, timings) if args.json else make_doc(bench, header, timings)
    if args.png:
        plot(doc, args.png)
    return 0 if all(r.get("ok", True) for r in bench.rows.values()) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        if not args.png:
            print("bench_packed: --replot needs --png", file=sys.stderr)
            return 2
        plot(json.loads(args.replot.read_text()), args.png)
        return 0
    if args.setup:
        for peer in args.peers:
            print(f"setting up {peer} in {packed_rows.VENVS / peer}", flush=True)
            packed_rows.setup_peer(peer)
        return 0
    if why := cannot_run("bench_packed"):
        print(why, file=sys.stderr)
        return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    try:
        return run(args)
    finally:
        if not args.keep:
            remove_tree(args.workdir)


if __name__ == "__main__":
    sys.exit(main())
