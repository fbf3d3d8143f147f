"""Stragglers: per-file latency of a cold read with and without hedged GETs.

A local S3 server (SeaweedFS by default, or moto) sits behind the latency proxy
(``latency_proxy.py``, in its own process) adding ``--latency-ms`` (10 ms) per request
and making ``--straggler-fraction`` (1%) of requests ``--straggler-ms`` (200 ms, 20x) slower
(seeded: every run sees the same straggler draw). ``--readers`` threads read ``--files``
small files through a fresh cachefs mount (empty cache, listing done before timing) and time
each open+read+close. Runs alternate hedging off (``--hedge-budget 0``) and on (defaults),
``--runs`` of each, each with a fresh proxy, mount and cache. Reported per mode: p50, p99,
max per-file latency over all its runs, GETs per file and hedges (won/lost).

Targets (docs/design.md, components): p99 with hedging <= 0.5x without; extra GETs <= 5%.

    .venv/bin/python benchmarks/bench_stragglers.py
    .venv/bin/python benchmarks/bench_stragglers.py --server moto --files 500 --runs 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import dataset
from benchmarks.cachefs_mount import CachefsMount, remove_tree
from testing.s3_servers import start_server, stop_process

BUCKET = "stragglers"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--file-size", type=dataset.parse_size, default=16 * 1024)
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--latency-ms", type=float, default=10.0)
    parser.add_argument("--straggler-fraction", type=float, default=0.01)
    parser.add_argument("--straggler-ms", type=float, default=200.0)
    parser.add_argument("--runs", type=int, default=2, help="runs of each mode, alternated")
    parser.add_argument("--on-first", action="store_true", help="start with hedging on (order effects)")
    parser.add_argument("--server", choices=("seaweedfs", "moto"), default="seaweedfs")
    parser.add_argument("--mount-opt", action="append", default=[], help="extra cachefs mount flag (repeat)")
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp/cachefs-bench-stragglers"))
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args(argv)


# ---- the proxy in its own process (the straggler knob is not a CLI flag of latency_proxy.py) ----

def proxy_main(upstream: str, latency_ms: float, fraction: float, delay_ms: float, seed: int) -> None:
    """Serve the proxy until stdin closes; print its endpoint first, its stats last (JSON)."""
    from testing.latency_proxy import LatencyProxy, parse_hostport
    host, port = parse_hostport(upstream)
    with LatencyProxy(host, port, latency=latency_ms / 1000, seed=seed) as proxy:
        proxy.stragglers(fraction, delay_ms / 1000)
        print(proxy.endpoint_url, flush=True)
        sys.stdin.read()
        print(json.dumps(proxy.stats()), flush=True)


@contextlib.contextmanager
def straggling_proxy(upstream_url: str, args: argparse.Namespace):
    """Yield (endpoint_url, stats()) of a fresh proxy process; stats() ends it."""
    upstream = upstream_url.split("://", 1)[1].rstrip("/")
    call = (upstream, args.latency_ms, args.straggler_fraction, args.straggler_ms, args.seed)
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r}); "
            f"from benchmarks.bench_stragglers import proxy_main; proxy_main(*{call!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    stats: dict = {}

    def finish() -> dict:
        if not stats and proc.poll() is None:
            proc.stdin.close()
            stats.update(json.loads(proc.stdout.readline() or "{}"))
            proc.wait(10)
        return stats
    try:
        yield proc.stdout.readline().strip(), finish
    finally:
        finish() if proc.poll() is None else None
        stop_process(proc)


# ---- one run -------------------------------------------------------------------------------------

def read_timed(root: Path, names: list[str], readers: int) -> tuple[list[float], float, int]:
    """(per-file seconds, wall seconds, bytes) of ``readers`` threads reading ``names`` once."""
    latencies: list[float] = []
    total = [0]
    lock = threading.Lock()
    chunks = [names[i::readers] for i in range(readers)]

    def work(part: list[str]) -> None:
        mine, got = [], 0
        for name in part:
            started = time.perf_counter()
            with open(root / name, "rb") as fh:
                got += len(fh.read())
            mine.append(time.perf_counter() - started)
        with lock:
            latencies.extend(mine)
            total[0] += got

    threads = [threading.Thread(target=work, args=(part,)) for part in chunks]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, time.perf_counter() - started, total[0]


def one_run(args: argparse.Namespace, upstream_url: str, names: list[str], hedging: bool, n: int) -> dict:
    run_dir = args.workdir / f"run-{n}"
    remove_tree(run_dir)
    extra = tuple(args.mount_opt) + (() if hedging else ("--hedge-budget", "0"))
    with straggling_proxy(upstream_url, args) as (endpoint, proxy_stats):
        with CachefsMount(f"s3://{BUCKET}", run_dir / "mnt", endpoint_url=endpoint, cache_dir=run_dir / "cache",
                          cache_size="4G", mem_cache_size="256M", extra=extra) as mnt:
            os.listdir(mnt.mountpoint)                  # the listing is not what we time
            before = mnt.status()
            latencies, wall, size = read_timed(mnt.mountpoint, names, args.readers)
            after = mnt.status()
        stats = proxy_stats()
    remove_tree(run_dir)
    gets = _gets(after) - _gets(before)
    hedge = after["tiers"].get("hedge", {})
    if size != args.files * args.file_size:
        raise RuntimeError(f"read {size} bytes, expected {args.files * args.file_size}")
    return {"hedging": hedging, "latencies": latencies, "wall_s": wall, "gets": gets,
            "hedges_won": hedge.get("won", 0), "hedges_lost": hedge.get("lost", 0),
            "hedges_failed": hedge.get("failed", 0), "skipped": {k: v for k, v in hedge.items()
                                                                 if k.startswith("skipped_")},
            "delay_ms": hedge.get("delay_ms"), "proxy_requests": stats.get("requests"),
            "stragglers": stats.get("stragglers"), "load": os.getloadavg()[0]}


def _gets(status: dict) -> int:
    return sum(v for k, v in status["store_requests"].items() if k.split()[0] == "get")


# ---- report --------------------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def tail_mean(values: list[float], fraction: float) -> float:
    """The mean of the slowest ``fraction`` (less jumpy than p99 when ~1% of files straggle)."""
    ordered = sorted(values, reverse=True)[:max(1, round(fraction * len(values)))]
    return sum(ordered) / len(ordered)


def summary(runs: list[dict], files: int) -> dict:
    lat = [x for r in runs for x in r["latencies"]]
    return {"files": len(lat), "p50_ms": pct(lat, 50) * 1000, "p99_ms": pct(lat, 99) * 1000,
            "max_ms": max(lat) * 1000, "tail1_ms": tail_mean(lat, 0.01) * 1000, "gets_per_file": sum(r["gets"] for r in runs) / (files * len(runs)),
            "hedges_won": sum(r["hedges_won"] for r in runs), "hedges_lost": sum(r["hedges_lost"] for r in runs),
            "stragglers": sum(r["stragglers"] or 0 for r in runs),
            "per_run_p99_ms": [round(pct(r["latencies"], 99) * 1000, 1) for r in runs]}


def table(off: dict, on: dict) -> str:
    rows = ["| hedging | files | p50 ms | p99 ms | slowest 1% mean ms | max ms | GETs/file | hedges won/lost | "
            "stragglers | p99 per run |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in (("off", off), ("on", on)):
        rows.append(f"| {name} | {s['files']} | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {s['tail1_ms']:.1f} | {s['max_ms']:.1f} | "
                    f"{s['gets_per_file']:.4f} | {s['hedges_won']}/{s['hedges_lost']} | {s['stragglers']} | "
                    f"{', '.join(map(str, s['per_run_p99_ms']))} |")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    from benchmarks.bench_read import use_local_credentials
    use_local_credentials()
    args.workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    names = [f"f{i:05d}.bin" for i in range(args.files)]
    order = names[:]
    rng.shuffle(order)
    with start_server(args.server, args.workdir / "server") as server:
        client = dataset.s3_client(server.endpoint_url, pool=40)
        dataset.ensure_bucket(client, BUCKET)
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda n: client.put_object(Bucket=BUCKET, Key=n, Body=random.Random(n).randbytes(
                args.file_size)), names))
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for i in range(args.runs * 2):
            hedging = (i % 2 == 1) != args.on_first
            result = one_run(args, server.endpoint_url, order, hedging, i)
            runs[hedging].append(result)
            print(f"run {i}: hedging {'on ' if hedging else 'off'} p99 {pct(result['latencies'], 99) * 1000:.1f} ms, "
                  f"max {max(result['latencies']) * 1000:.1f} ms, {result['gets']} GETs, hedges "
                  f"{result['hedges_won']}/{result['hedges_lost']}, stragglers {result['stragglers']}, "
                  f"load {result['load']:.1f}", flush=True)
    off, on = summary(runs[False], args.files), summary(runs[True], args.files)
    setup = (f"{args.files} files x {args.file_size} B, {args.readers} readers, {args.server} behind the proxy "
             f"({args.latency_ms:g} ms, {args.straggler_fraction:.0%} of requests +{args.straggler_ms:g} ms, "
             f"seed {args.seed}), {args.runs} cold runs per mode alternated; {platform.node()}, "
             f"{os.cpu_count()} CPUs")
    print(setup)
    print(table(off, on))
    ratio = on["p99_ms"] / off["p99_ms"]
    extra = on["gets_per_file"] / off["gets_per_file"] - 1
    print(f"p99 on/off = {ratio:.2f} (target <= 0.5); extra GETs = {extra:+.1%} (target <= 5%)")
    if args.json:
        args.json.write_text(json.dumps({"setup": setup, "off": off, "on": on, "p99_ratio": ratio,
                                         "extra_gets": extra, "runs": {
                                             k: [{x: v for x, v in r.items() if x != "latencies"} for r in rs]
                                             for k, rs in (("off", runs[False]), ("on", runs[True]))}}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
