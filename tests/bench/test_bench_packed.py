"""The packed benchmark's harness (benchmarks/bench_packed.py, packed_rows.py) computes what it says:
the copy and pack rows count the files and bytes they moved, the pack row's peak RSS is the
subprocess's, a DataLoader epoch counts every file once and flags wrong sizes and missing files,
the mount rows' GET counts equal the GET requests the server got, and the ratio table says met /
not met / n/a. Tiny sizes on the moto server: seconds, no timing asserted."""

import os
import random
import time
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from benchmarks import bench_packed, packed_rows, readers
from benchmarks.cachefs_mount import CachefsMount
from benchmarks.dataset import Entry
from cachefs.data import PackedIterableDataset
from testing.latency_proxy import LatencyProxy
from testing.s3 import make_bucket

MiB = 1 << 20


def client_for(url: str):
    return boto3.client("s3", endpoint_url=url, config=Config(s3={"addressing_style": "path"}))


def put_files(client, bucket: str, prefix: str, n: int = 30) -> list[Entry]:
    rng = random.Random(7)
    entries = []
    for i in range(n):
        path, data = f"train/c{i % 3}/img_{i:03d}.JPEG", rng.randbytes(rng.randint(20_000, 120_000))
        client.put_object(Bucket=bucket, Key=f"{prefix}/{path}", Body=data)
        entries.append(Entry(path, len(data), ""))
    return entries


@pytest.fixture(scope="module")
def packed(s3_server):
    """40 files in s3://BUCKET/src, packed once into s3://BUCKET/packed (1 MiB shards); the pack run."""
    bucket = "bench-packed-harness"
    make_bucket(s3_server.endpoint_url, bucket)
    client = client_for(s3_server.endpoint_url)
    entries = put_files(client, bucket, "src", n=40)
    run = packed_rows.pack_run(f"s3://{bucket}/src", f"s3://{bucket}/packed", s3_server.endpoint_url, 4, "1M",
                               dict(os.environ))
    assert run["returncode"] == 0, run["stderr"]
    return bucket, client, entries, run


def test_copy_and_pack_rows_count_what_they_moved(packed):
    bucket, client, entries, run = packed
    total = sum(e.size for e in entries)

    copy = packed_rows.boto3_copy("copy", client, bucket, "src", "copy", entries, threads=4)
    assert (copy.tally.files, copy.tally.bytes, copy.ok) == (len(entries), total, True)
    for e in entries[:5]:
        assert (client.get_object(Bucket=bucket, Key=f"copy/{e.path}")["Body"].read()
                == client.get_object(Bucket=bucket, Key=f"src/{e.path}")["Body"].read())

    summary = run["summary"]
    assert (summary["total_files"], summary["total_bytes"]) == (len(entries), total)
    shards = client.list_objects_v2(Bucket=bucket, Prefix="packed/shards/")["Contents"]
    assert len([s for s in shards if s["Key"].endswith(".tfrecord")]) == summary["total_shards"] >= 2
    # the peak RSS is the pack subprocess's (a Python process with pyarrow: tens of MiB, not ours)
    assert 20 * MiB < run["peak_rss"] < 1024 * MiB
    assert run["vm_hwm_sampled"] <= run["peak_rss"] == max(run["vm_hwm_sampled"], run["vm_hwm_at_end"])
    assert run["vm_hwm_at_end"] == run["summary"]["peak_rss_bytes"] > 20 * MiB


def test_loader_epoch_counts_every_file_once_and_flags_wrong_sizes(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "packed"
    rng = random.Random(3)
    entries = []
    for i in range(24):
        path = f"d{i % 2}/f{i:02d}.bin"
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        (src / path).write_bytes(rng.randbytes(1000 + 37 * i))
        entries.append(Entry(path, 1000 + 37 * i, ""))
    run = packed_rows.pack_run(str(src), str(dst), "", 2, "8K", dict(os.environ))
    assert run["returncode"] == 0, run["stderr"]
    total = sum(e.size for e in entries)

    results = []
    for batch in (0, 5):          # one sample per item, and batches (5 does not divide 24 or a worker's 12)
        with PackedIterableDataset(dst, seed=1) as ds:
            results.append(packed_rows.loader_epoch("packed", ds, entries, workers=2, batch_size=batch))
        results.append(packed_rows.loader_epoch("local", packed_rows.FileDataset(src, [e.path for e in entries]),
                                                entries, 2, batch_size=batch))
    for result in results:
        assert (result.tally.files, result.tally.bytes, result.ok) == (len(entries), total, True)

    wrong = [Entry(e.path, e.size + (i == 0), "") for i, e in enumerate(entries)] + [Entry("never/there", 1, "")]
    for batch in (0, 5):
        with PackedIterableDataset(dst, seed=1) as ds:
            bad = packed_rows.loader_epoch("packed", ds, wrong, workers=2, batch_size=batch)
        assert bad.tally.bad_size == 1 and bad.tally.errors == 1 and not bad.ok   # one wrong size, one missing


@pytest.mark.fuse
def test_a_mount_rows_get_count_is_the_gets_the_server_got(s3_server, packed, tmp_path):
    bucket, _, entries, _ = packed
    host, port = s3_server.endpoint_url.removeprefix("http://").split(":")
    with LatencyProxy(host, int(port), latency=0.0) as proxy, \
            CachefsMount(f"s3://{bucket}/packed", tmp_path / "mnt", endpoint_url=proxy.endpoint_url,
                         cache_dir=tmp_path / "cache", mem_cache_size="64M", cache_size="1G") as mnt:
        if not (mnt.mountpoint / entries[0].path).exists():
            pytest.skip("the packed view is not in this tree yet")
        for e in entries:                    # lookups and opens first: the epoch then only reads data
            os.stat(mnt.mountpoint / e.path)
        before, requests = bench_packed.gets(mnt), proxy.stats()["requests"]
        result = readers.read_files("packed", mnt.mountpoint, entries, 4)
        deadline = time.monotonic() + 30          # the shard warms the epoch started: finished
        while mnt.status()["warmup"]["running"] or (mnt.status()["warmup"]["shard_warm"] or {}).get("queued"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        got = bench_packed.gets(mnt) - before
        assert (result.tally.files, result.tally.bytes, result.ok) == (40, sum(e.size for e in entries), True)
        assert got == proxy.stats()["requests"] - requests
        assert 1 <= got <= 40 // 2          # shards of 1 MiB hold ~10 files: a GET serves many
        assert bench_packed.packed_root(mnt.mountpoint) is not None


def test_ratios_say_met_not_met_and_na():
    def row(files_per_s, ok=True, **extra):
        return {"name": "x", "files_per_s": files_per_s, "mb_per_s": 1.0, "seconds": 1.0, "ok": ok, **extra}

    rows = {"boto3": row(100.0), "packed_cold": row(600.0, gets=400), "unpacked_disk": row(1000.0),
            "local_loader": row(1000.0), "loader_warm": row(900.0), "copy": row(50.0), "pack": row(40.0),
            "streaming_epoch": row(200.0), "s3torch_epoch": row(300.0, ok=False),
            "loader_cold": {"name": "loader cold", "ok": True, "note": "n/a (packed view not available)"}}
    rats = {r["label"].split(" (")[0]: r for r in bench_packed.ratios(rows, files=10_000)}
    assert rats["packed mount cold / boto3"]["value"] == 6.0 and rats["packed mount cold / boto3"]["pass"]
    assert rats["packed mount cold / unpacked disk tier"]["pass"] is False
    assert rats["loader warm / local disk"]["pass"] is True
    assert rats["cachefs pack / boto3 copy"]["pass"] is False
    assert rats["loader cold / best peer"]["value"] is None and rats["loader cold / best peer"]["pass"] is None
    assert "streaming" in next(r["label"] for r in bench_packed.ratios(rows, 10_000) if "best peer" in r["label"])
    gets = next(r for r in bench_packed.ratios(rows, 10_000) if "packed cold" in r["label"])
    assert gets["pass"] is True and gets["target"] == 500
    table = bench_packed.render(rows, bench_packed.ratios(rows, 10_000), "header")
    assert "n/a (packed view not available)" in table and "NOT MET" in table


def test_a_rerun_baseline_counts_as_the_mean_of_both_rows():
    def row(files_per_s, ok=True):
        return {"name": "x", "files_per_s": files_per_s, "mb_per_s": 1.0, "seconds": 1.0, "ok": ok}

    rows = {"boto3": row(100.0), "boto3_again": row(300.0), "packed_cold": row(1000.0),
            "unpacked_disk": row(1000.0), "unpacked_disk_again": row(1500.0),
            "local_loader": row(1000.0), "local_loader_again": row(500.0, ok=False), "loader_warm": row(900.0)}
    rats = {r["label"].split(" (")[0]: r for r in bench_packed.ratios(rows, files=10_000)}
    assert rats["packed mount cold / boto3"]["value"] == 5.0       # 1000 / mean(100, 300)
    assert rats["packed mount cold / unpacked disk tier"]["value"] == 0.8   # 1000 / mean(1000, 1500)
    assert "mean of the rows before and after" in rats["packed mount cold / unpacked disk tier"]["label"]
    assert "mean of the rows before and after" in rats["packed mount cold / boto3"]["label"]
    assert rats["loader warm / local disk"]["value"] == 0.9         # a failed rerun is left out
    assert "mean" not in rats["loader warm / local disk"]["label"]


def test_baselines_rerun_only_around_the_rows_compared_with_them():
    assert bench_packed.wanted("boto3_again", ["boto3", "packed_mount"])
    assert not bench_packed.wanted("boto3_again", ["boto3", "pack"])
    assert not bench_packed.wanted("boto3_again", ["packed_mount"])
    assert bench_packed.wanted("local_again", ["local", "loader"])
    assert not bench_packed.wanted("local_again", ["local"])
    assert bench_packed.wanted("unpacked_disk_again", ["packed_mount", "unpacked_mount"])
    assert not bench_packed.wanted("unpacked_disk_again", ["unpacked_mount"])
    assert not bench_packed.wanted("unpacked_disk_again", ["packed_mount"])
    assert bench_packed.wanted("pack", ["pack"]) and not bench_packed.wanted("pack", ["local"])


def test_the_disk_tier_baseline_reruns_only_over_the_cache_its_first_row_left(tmp_path):
    bench = bench_packed.Bench(bench_packed.parse_args(["--workdir", str(tmp_path)]), [])
    mounted = []
    bench.mount = lambda *args: mounted.append(args) or pytest.fail("mounted without a disk tier to read")
    bench.unpacked_mount_rows("http://127.0.0.1:1", again=True)          # no first row: nothing runs
    bench.rows["unpacked_disk"] = {"ok": False}
    bench.unpacked_mount_rows("http://127.0.0.1:1", again=True)          # a failed one: neither
    assert mounted == [] and "unpacked_disk_again" not in bench.rows


def test_packed_root_finds_the_layout(tmp_path):
    assert bench_packed.packed_root(tmp_path) is None
    (tmp_path / ".cachefs-packed").mkdir()
    (tmp_path / ".cachefs-packed" / "manifest.json").write_text("{}")
    assert bench_packed.packed_root(tmp_path) == tmp_path / ".cachefs-packed"
    (tmp_path / "manifest.json").write_text("{}")
    assert bench_packed.packed_root(Path(tmp_path)) == tmp_path


def test_a_metered_row_says_where_its_cpu_went(tmp_path, capsys):
    """A row recorded with a CpuMeter carries CPU ms per file by group, busy CPUs and the CPU cap;
    a busy child the row waited for is client CPU; the table shows the columns for that row only."""
    import argparse
    import subprocess
    import sys

    args = argparse.Namespace(workdir=tmp_path, seed=0)
    bench = bench_packed.Bench(args, [Entry("a", 1, "")])
    with bench.meter() as cpu:
        subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                        "while time.process_time() - t < 0.3: pass"], check=True)
    tally = readers.Tally(files=100, bytes=100 * 1000)
    row = bench.record("boto3", readers.Result("metered row", 0.5, tally), cpu)
    assert row["cpu_client_ms"] >= 2.5          # >= 0.3 CPU-s over 100 files
    assert row["cpu_daemon_ms"] == 0.0 and row["cpu_store_ms"] == 0.0
    assert row["cap_files_s"] > 0 and row["cpu_total_ms"] >= row["cpu_client_ms"] * 0.9
    assert "CPU ms/file: daemon 0.00 store 0.00 client" in capsys.readouterr().out
    bench.record("copy", readers.Result("plain row", 1.0, readers.Tally(files=10, bytes=10)))
    table = bench_packed.render(bench.rows, [], "header").splitlines()
    metered = next(line for line in table if line.startswith("metered row"))
    plain = next(line for line in table if line.startswith("plain row"))
    assert f"0.00 / 0.00 / {row['cpu_client_ms']:.2f}" in metered and f"{row['cap_files_s']:.0f}" in metered
    assert plain.rstrip().endswith("yes")


def test_a_failed_peer_is_reported_by_its_exception_first():
    stderr = ("Traceback (most recent call last):\n  File x\n"
              "litdata.exceptions.ChunkWaitTimeoutError: Timed out after 120s waiting for chunk "
              + "/var/tmp/" + "d" * 400 + "/chunk-1-3.bin. This is usually a hung download.\n")
    error = packed_rows._last_error(stderr)
    assert error.startswith("litdata.exceptions.ChunkWaitTimeoutError: Timed out after 120s")
    assert len(error) <= 303 and error.endswith("...")
    assert packed_rows._last_error("") == "failed"


def test_a_peer_epoch_counts_every_sample_once_batched_or_not():
    """packed_peers.epoch (run in each peer's venv): every sample of a map-style dataset counted
    once, its prefix stripped, with one sample per item and in batches, and a short one flagged."""
    from benchmarks import packed_peers
    rng = random.Random(5)
    files = [[f"c{i % 3}/f{i:02d}", 100 + i] for i in range(23)]
    samples = [(f"src/{path}", rng.randbytes(size)) for path, size in files]
    for batch in (0, 4):
        job = {"files": files, "src_prefix": "src", "seed": 2, "workers": 2, "batch_size": batch}
        assert packed_peers.epoch(job, "s3torch", samples) == {"files": 23, "bytes": sum(s for _, s in files),
                                                               "bad_size": 0, "missing": 0}
        short = [*samples[:-1], (samples[-1][0], b"x")]
        assert packed_peers.epoch(job, "s3torch", short)["bad_size"] == 1
