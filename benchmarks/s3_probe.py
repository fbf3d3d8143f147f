"""Probe local S3 servers: the behaviours cachefs relies on, and small-GET throughput.

For each server: Range -> 206 + Content-Range, If-Match mismatch -> 412, ``dir/``
markers kept as keys, multipart ETag stable between Complete and HEAD; then GETs
of ``--object-size`` objects by N concurrent boto3 clients (threads spread over
``--procs`` processes), direct and through the latency proxy, with the CPU time
each party spent per GET (server, proxy, clients).

    .venv/bin/python benchmarks/s3_probe.py --servers moto,seaweedfs,rclone \
        --concurrency 8,32 --latency-ms 10
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import dataset, readers
from benchmarks.dataset import Entry
from testing.s3_servers import ProxyProcess, start_server

BUCKET = "probe"
OBJECTS = 200


# ---- behaviours ----------------------------------------------------------------------------------
def probe_behaviour(client) -> dict[str, bool]:
    body = bytes(range(256)) * 400
    etag = client.put_object(Bucket=BUCKET, Key="b/obj", Body=body)["ETag"]
    ranged = client.get_object(Bucket=BUCKET, Key="b/obj", Range="bytes=100-199")
    client.put_object(Bucket=BUCKET, Key="b/dir/", Body=b"")
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix="b/", Delimiter="/")
    return {
        "range_206": ranged["ResponseMetadata"]["HTTPStatusCode"] == 206,
        "range_bytes": ranged["Body"].read() == body[100:200],
        "content_range": ranged.get("ContentRange") == f"bytes 100-199/{len(body)}",
        "if_match_412": if_match_refused(client, "b/obj"),
        "if_match_ok": client.get_object(Bucket=BUCKET, Key="b/obj", IfMatch=etag)[
            "ResponseMetadata"]["HTTPStatusCode"] == 200,
        "dir_marker_kept": [p["Prefix"] for p in listing.get("CommonPrefixes", [])] == ["b/dir/"],
        "multipart_etag_stable": multipart_etag_stable(client),
    }


def if_match_refused(client, key: str) -> bool:
    try:
        client.get_object(Bucket=BUCKET, Key=key, IfMatch='"0123456789abcdef0123456789abcdef"')
    except client.exceptions.ClientError as exc:
        return exc.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    return False


def multipart_etag_stable(client) -> bool:
    upload = client.create_multipart_upload(Bucket=BUCKET, Key="mpu")["UploadId"]
    parts = [{"PartNumber": n, "ETag": client.upload_part(
        Bucket=BUCKET, Key="mpu", UploadId=upload, PartNumber=n, Body=b"p" * (5 << 20))["ETag"]}
        for n in (1, 2)]
    done = client.complete_multipart_upload(Bucket=BUCKET, Key="mpu", UploadId=upload,
                                            MultipartUpload={"Parts": parts})
    return done.get("ETag") == client.head_object(Bucket=BUCKET, Key="mpu")["ETag"]


# ---- throughput ----------------------------------------------------------------------------------
def cpu_seconds(pid: int | None) -> float:
    if not pid:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client_proc(endpoint, entries, threads, barrier, results) -> None:
    client = dataset.s3_client(endpoint, pool=threads + 2)
    client.head_bucket(Bucket=BUCKET)
    barrier.wait()
    cpu0 = sum(os.times()[:2])
    result = readers.read_s3("probe", client, BUCKET, "", entries, threads)
    results.put((result.seconds, result.tally.files, result.tally.bytes,
                 sum(os.times()[:2]) - cpu0, result.ok))


def get_throughput(endpoint: str, entries: list[Entry], concurrency: int, procs: int,
                   pids: dict[str, int | None]) -> dict:
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(procs + 1), ctx.Queue()
    threads = max(1, concurrency // procs)
    workers = [ctx.Process(target=_client_proc, daemon=True,
                           args=(endpoint, entries[i::procs], threads, barrier, results))
               for i in range(procs)]
    for w in workers:
        w.start()
    barrier.wait(timeout=120)
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    outcomes = [results.get(timeout=600) for _ in workers]   # bounded: 10 min per measurement
    cpu = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
    readers.reap(workers)
    seconds = max(o[0] for o in outcomes)
    gets = sum(o[1] for o in outcomes)
    cpu["clients"] = sum(o[3] for o in outcomes)
    return {"gets_per_s": gets / seconds, "mb_per_s": sum(o[2] for o in outcomes) / seconds / 1e6,
            "ok": all(o[4] for o in outcomes),
            **{f"{k}_cpu_ms_per_get": 1000 * v / gets for k, v in cpu.items()}}


# ---- one server ----------------------------------------------------------------------------------
def probe_server(backend: str, args: argparse.Namespace, workdir: Path) -> list[dict]:
    rows = []
    with start_server(backend, workdir / backend) as server:
        client = dataset.s3_client(server.endpoint_url)
        dataset.ensure_bucket(client, BUCKET)
        print(f"{backend}: {probe_behaviour(client)}", flush=True)
        entries = put_objects(client, args.object_size)
        with ProxyProcess(server.endpoint_url, args.latency_ms) as proxy:
            for conc in args.concurrency:
                for path, url in (("direct", server.endpoint_url),
                                  (f"proxy {args.latency_ms:g} ms", proxy.endpoint_url)):
                    pids = {"server": server.pid, "proxy": proxy.pid if url != server.endpoint_url
                            else None}
                    work = entries * max(1, args.requests // len(entries))
                    row = {"server": backend, "concurrency": conc, "path": path,
                           **get_throughput(url, work, conc, args.procs, pids)}
                    print(format_row(row), flush=True)
                    rows.append(row)
    return rows


def put_objects(client, size: int) -> list[Entry]:
    body = os.urandom(size)
    for i in range(OBJECTS):
        client.put_object(Bucket=BUCKET, Key=f"obj/{i:04d}", Body=body)
    return [Entry(f"obj/{i:04d}", size, "") for i in range(OBJECTS)]


def format_row(r: dict) -> str:
    return (f"{r['server']:<10} {r['concurrency']:>4} {r['path']:<14} {r['gets_per_s']:>8.0f} GET/s "
            f"{r['mb_per_s']:>7.1f} MB/s  CPU ms/GET: server {r['server_cpu_ms_per_get']:.2f} "
            f"proxy {r['proxy_cpu_ms_per_get']:.2f} clients {r['clients_cpu_ms_per_get']:.2f}"
            + ("" if r["ok"] else "  ERRORS"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="moto,seaweedfs,rclone")
    parser.add_argument("--concurrency", default="8,32",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--procs", type=int, default=1, help="client processes (threads split)")
    parser.add_argument("--requests", type=int, default=2000, help="GETs per measurement")
    parser.add_argument("--object-size", type=dataset.parse_size, default=110 * 1024)
    parser.add_argument("--latency-ms", type=float, default=10.0)
    args = parser.parse_args(argv)
    from testing.s3 import local_credentials_env
    for name, value in local_credentials_env().items():
        os.environ.setdefault(name, value)
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="s3probe-") as tmp:
        for backend in args.servers.split(","):
            probe_server(backend, args, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
