"""The FUSE layer benchmark: epochs served from the disk tier and the page cache, and a large
file from the disk tier, for each FUSE variant beside local disk, in one run.

The dataset (benchmarks/dataset.py: 10,000 x ~110 KiB in 100 folders plus one large file) is
mounted from a ``file://`` store: after ``cachefs warmup`` the store is never asked again, so the
rows measure the FUSE path and the disk tier, not S3. Each variant (``--variants``) is a list of
`cachefs mount` flags; the default compares cachefs's own protocol layer with pyfuse3 (libfuse).
Per round and variant, page cache dropped where it says so:

  disk tier   remount (empty memory tier), drop, 8 readers in one shuffled order   vs local disk (dropped)
  hot         again, no drop (the kernel page cache)                               vs local page cache
  known       again, pages dropped, the kernel's inodes kept (epoch 2+ of a        vs local disk (dropped)
              dataset larger than RAM: each open answered with the inode's backing id)
  large       one reader, 1 MiB reads of the large file, dropped                   vs local disk (dropped)
              (the first open in the daemon's life: with passthrough, it verifies the cache file)
  again       the same, a second open (passthrough: the kernel reads the verified file)

with the daemon's CPU per file (``cpu_meter``). Local rows run before and after the mount rows
of each round; ratios divide by their mean. ``--list-first`` walks the tree (untimed) before each
disk-tier epoch, as a loader that scans its dataset at start does (torchvision's ImageFolder):
the mount then answers the epoch's opens with no LOOKUP (READDIRPLUS gave the kernel every entry).
``--warmup-first`` runs `cachefs warmup` of the whole mount (timed: its own row, ``warmup``)
after each remount and drops only the page cache before the disk-tier epoch, as a researcher's
warmup just before a run: on an ``--immutable`` mount it lists what it warmed through the mount,
so a loader that opens files by name also opens with no LOOKUP. A variant's ``warmup:FLAG``
goes to that warmup (``cachefs,warmup:--no-list``). Needs root (drop_caches, FUSE).

    sudo .venv/bin/python -m benchmarks.bench_fuse --quick
    sudo .venv/bin/python -m benchmarks.bench_fuse --readers 16 --variants "cachefs,--fuse-loops=1" "cachefs,--fuse-loops=4"
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import dataset, readers
from benchmarks.cachefs_mount import CachefsMount, drop_page_cache
from benchmarks.cpu_meter import CpuMeter, with_children

MiB = 1 << 20
DEFAULT_VARIANTS = ("cachefs", "pyfuse3")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, help="small files (default 10000; 2000 with --quick)")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--file-size", type=dataset.parse_size, default=110 * 1024)
    parser.add_argument("--large-size", type=dataset.parse_size, help="the large file (default 1G; 256M --quick)")
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every row (alternating)")
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                        help="one per variant: BACKEND[,FLAG...] e.g. cachefs,--passthrough=off")
    parser.add_argument("--hot-passes", type=int, default=3, help="hot epochs read the order this many times")
    parser.add_argument("--fill", choices=("warmup", "read"), default="warmup",
                        help="fill the disk tier with `cachefs warmup`, or by reading every file once")
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp/cachefs-fuse-bench"))
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the workdir (reuses the dataset and caches)")
    parser.add_argument("--list-first", action="store_true",
                        help="walk the tree before each disk-tier epoch (untimed), as ImageFolder does at start")
    parser.add_argument("--list-pause", type=float, default=0.0, metavar="S",
                        help="with --list-first: seconds between the walk and the epoch (a loader's workers starting)")
    parser.add_argument("--buffered-open", action="store_true",
                        help="readers open each file as PIL/torchvision do (open(path, 'rb'): an isatty ioctl per "
                        "open on CPython < 3.14), not unbuffered")
    parser.add_argument("--warmup-first", action="store_true",
                        help="after each remount, `cachefs warmup` the mount (timed), then drop only the page cache")
    args = parser.parse_args(argv)
    args.files = args.files if args.files is not None else (2000 if args.quick else 10_000)
    args.large_size = args.large_size or (256 * MiB if args.quick else 1024 * MiB)
    return args


def variant_flags(variant: str) -> tuple[str, list[str]]:
    """A variant's name and its mount flags (its ``warmup:FLAG``s go to ``--warmup-first``'s warmup)."""
    backend, *flags = variant.split(",")
    return variant, ["--fuse-backend", backend, *(f for f in flags if not f.startswith("warmup:"))]


def warmup_flags(variant: str) -> list[str]:
    return [f.removeprefix("warmup:") for f in variant.split(",")[1:] if f.startswith("warmup:")]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        spec = dataset.DatasetSpec(files=args.files, classes=args.classes, file_size=args.file_size, large=1,
                                   large_size=args.large_size)
        entries = dataset.build_local(args.workdir / "dataset", spec)
        self.root = args.workdir / "dataset" / "data"
        small = [e for e in entries if not e.is_large]
        self.order = random.Random(0).sample(small, len(small))
        self.large = next(e for e in entries if e.is_large)
        self.rows: list[dict] = []

    def mount(self, variant: str) -> CachefsMount:
        name, flags = variant_flags(variant)
        slug = name.replace(",", "_").replace("-", "").replace("=", "")
        return CachefsMount(f"file://{self.root}", self.args.workdir / f"mnt-{slug}", endpoint_url=None,
                            cache_dir=self.args.workdir / f"cache-{slug}", extra=tuple(flags))

    def warm(self, variant: str) -> None:
        with self.mount(variant) as mnt:
            if self.args.fill == "read":
                result = readers.read_files("fill", mnt.mountpoint, self.order + [self.large], self.args.readers)
                if not result.ok:
                    raise RuntimeError(f"fill failed: {result.tally}")
                return
            result = mnt.run("warmup", "-q", str(mnt.mountpoint), timeout=3600)
            if result.returncode != 0:
                raise RuntimeError(f"warmup failed: {result.stderr.strip()}")

    def listed(self, round_: int, who: str, root: Path, pid: int | None = None) -> None:
        """``--list-first``: the loader's scan of its dataset, before the epoch (its own row,
        ``list``: entries listed per second and the daemon's CPU per entry)."""
        if self.args.list_first:
            with CpuMeter(daemon=with_children(pid)) as meter:
                found = sum(len(files) for _dir, _dirs, files in os.walk(root))
            if found < len(self.order):
                raise RuntimeError(f"listing {root} found {found} files, not {len(self.order)}")
            self.record(round_, who, "list", files_s=found / meter.seconds, meter=meter, files=found)
            time.sleep(self.args.list_pause)

    def local_rows(self, round_: int) -> None:
        drop_page_cache()
        self.listed(round_, "local disk", self.root)
        self.epoch(round_, "local disk", "disk", self.root, None)
        self.epoch(round_, "local disk", "hot", self.root, None, passes=self.args.hot_passes)
        drop_page_cache()
        self.sequential(round_, "local disk", self.root / self.large.path)

    def warmed_first(self, round_: int, variant: str, mnt: CachefsMount) -> None:
        """``--warmup-first``: `cachefs warmup` of the whole (already cached) mount in the new
        daemon, its own row (``warmup``: files checked, and listed through the mount unless the
        variant says ``warmup:--no-list``, per second), then the page cache dropped, the
        kernel's entries kept."""
        if self.args.warmup_first:
            with CpuMeter(daemon=with_children(mnt.pid)) as meter:
                result = mnt.run("warmup", "-q", *warmup_flags(variant), str(mnt.mountpoint), timeout=3600)
            if result.returncode != 0:
                raise RuntimeError(f"warmup failed: {result.stderr.strip()}")
            self.record(round_, variant, "warmup", files_s=(len(self.order) + 1) / meter.seconds,
                        seconds=meter.seconds, meter=meter, files=len(self.order) + 1)
            drop_page_cache(keep_inodes=True)

    def mount_rows(self, round_: int, variant: str) -> None:
        drop_page_cache()
        with self.mount(variant) as mnt:
            self.warmed_first(round_, variant, mnt)
            self.listed(round_, variant, mnt.mountpoint, mnt.pid)
            self.epoch(round_, variant, "disk", mnt.mountpoint, mnt.pid)
            self.epoch(round_, variant, "hot", mnt.mountpoint, mnt.pid, passes=self.args.hot_passes)
            drop_page_cache(keep_inodes=True)
            self.epoch(round_, variant, "known", mnt.mountpoint, mnt.pid)
            drop_page_cache()
            self.sequential(round_, variant, mnt.mountpoint / self.large.path, mnt.pid)
            drop_page_cache()               # a second open: its cache file was verified by the first
            self.sequential(round_, variant, mnt.mountpoint / self.large.path, mnt.pid, kind="again")

    def epoch(self, round_: int, who: str, kind: str, root: Path, pid: int | None, passes: int = 1) -> None:
        order = self.order * passes
        with CpuMeter(daemon=with_children(pid)) as meter:
            result = readers.read_files(f"{who} {kind}", root, order, self.args.readers, verify_every=10,
                                        buffered=self.args.buffered_open)
        if not result.ok:
            raise RuntimeError(f"{who} {kind}: {result.tally}")
        self.record(round_, who, kind, files_s=len(order) / result.seconds, meter=meter, files=len(order))

    def sequential(self, round_: int, who: str, path: Path, pid: int | None = None, kind: str = "large") -> None:
        with CpuMeter(daemon=with_children(pid)) as meter:
            result = readers.read_sequential(f"{who} {kind}", path, self.large)
        if not result.ok:
            raise RuntimeError(f"{who} {kind}: {result.tally}")
        self.record(round_, who, kind, mb_s=result.mb_per_s, meter=meter, files=1)

    def record(self, round_: int, who: str, kind: str, *, meter: CpuMeter, files: int, **figures) -> None:
        row = {"round": round_, "who": who, "kind": kind, **{k: round(v, 1) for k, v in figures.items()},
               **meter.per_file(files)}
        self.rows.append(row)
        value = f"{row['files_s']:>9,.0f} files/s" if "files_s" in row else f"{row['mb_s']:>9,.0f} MB/s"
        cpu = f"daemon {row.get('cpu_daemon_ms', 0):.3f} ms/file" if "cpu_daemon_ms" in row and files > 1 else ""
        print(f"  round {round_} {who:<28} {kind:<5} {value}  {cpu}", flush=True)


def summary(rows: list[dict], variants: list[str]) -> list[str]:
    """Per variant and row kind: the median over rounds, and the ratio to local disk (its rows
    of the same round: the mean of the runs before and after)."""
    listing = any(r["kind"] == "list" for r in rows)      # --list-first: the walk before each disk-tier epoch
    warming = any(r["kind"] == "warmup" for r in rows)    # --warmup-first: a warmup after each remount
    lines = ["| variant | disk tier files/s (x local) | daemon ms/file | hot files/s (x page cache) | "
             "disk tier, inodes known (x local) | daemon ms/file | large MB/s, first open (x local dd) | "
             "large, opened again |" + (" listing entries/s (x local) | daemon ms/entry |" if listing else "")
             + (" warmup files/s | warmup s |" if warming else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if listing else "") + ("---|---|" if warming else "")]
    kinds = [("disk", "files_s"), ("hot", "files_s"), ("known", "files_s"), ("large", "mb_s"), ("again", "mb_s")]
    for variant in variants:
        cells = []
        for kind, unit in kinds + ([("list", "files_s")] if listing else []) + (
                [("warmup", "files_s")] if warming else []):
            ratios, values, cpu = [], [], []
            base = {"again": "large", "known": "disk"}.get(kind, kind)
            if kind == "warmup":            # no local row: files/s and seconds
                runs = sorted((r for r in rows if r["who"] == variant and r["kind"] == kind), key=lambda r: r[unit])
                cells += [f"{runs[len(runs) // 2][unit]:,.0f}", f"{min(r['seconds'] for r in runs):.1f}-"
                          f"{max(r['seconds'] for r in runs):.1f}"] if runs else ["-", "-"]
                continue
            for row in (r for r in rows if r["who"] == variant and r["kind"] == kind):
                local = [r[unit] for r in rows if r["who"] == "local disk" and r["kind"] == base
                         and r["round"] in (row["round"], row["round"] + 1)]
                values.append(row[unit])
                ratios.append(row[unit] / (sum(local) / len(local)))
                cpu.append(row.get("cpu_daemon_ms", 0.0))
            if not values:
                cells += ["-", "-"] if kind in ("disk", "known", "list") else ["-"]
                continue
            values.sort()
            ratios.sort()
            cells.append(f"{values[len(values) // 2]:,.0f} ({ratios[0]:.2f}-{ratios[-1]:.2f}x)")
            if kind in ("disk", "known", "list"):
                cpu.sort()
                cells.append(f"{cpu[0]:.3f}-{cpu[-1]:.3f}")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench_fuse needs root (drop_caches, FUSE)", file=sys.stderr)
        return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    bench = Bench(args)
    print(f"dataset: {args.files} files of ~{args.file_size // 1024} KiB + {args.large_size // MiB} MiB; "
          f"{args.readers} readers; {os.cpu_count()} CPUs")
    try:
        for variant in args.variants:
            bench.warm(variant)
        for round_ in range(args.rounds):
            bench.local_rows(round_)
            for variant in args.variants:
                bench.mount_rows(round_, variant)
        bench.local_rows(args.rounds)
    finally:
        if not args.keep:
            for path in args.workdir.glob("cache-*"):
                shutil.rmtree(path, ignore_errors=True)
    lines = summary(bench.rows, args.variants)
    print("\n".join(lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": bench.rows,
                                         "summary": lines, "time": time.time()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
