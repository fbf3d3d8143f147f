"""The peers of the packed benchmark, each run in its own virtualenv (``bench_packed.py --setup``).

    PEER_VENV/bin/python -m benchmarks.packed_peers PEER convert JOB.json
    PEER_VENV/bin/python -m benchmarks.packed_peers PEER epoch JOB.json

Runs one peer's converter on the local copy of the dataset (its documented way in: a loop over
the files writing into the peer's writer, the output going to the S3 server), then its first
epoch with ``workers`` DataLoader workers (raw bytes, no decode), from a fresh local cache, in a
second process. Each prints one JSON line: version and converter seconds, or epoch seconds, files,
bytes, size mismatches, missing paths. Imports only the standard library, torch, boto3 and the peer, none of cachefs.

JOB.json: {"endpoint_url", "bucket", "src_prefix", "dst_prefix", "root", "files": [[path, size], ...],
"workers", "batch_size" (0: one sample per DataLoader item), "seed", "scratch"}; ``endpoint_url``
is the latency proxy: the converters' uploads and the epochs' reads both pass it, as `cachefs
pack`'s GETs and PUTs do.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.cpu_meter import CpuMeter  # stdlib only: importable in every peer's venv

SHARD_BYTES = 64 * 1000 * 1000     # the peers' own default shard/chunk size (MDS, LitData: 64 MB)
PEERS = ("streaming", "litdata", "webdataset", "s3torch")
PACKAGES = {"streaming": "mosaicml-streaming", "litdata": "litdata", "webdataset": "webdataset",
            "s3torch": "s3torchconnector"}


def version(peer: str) -> str:
    from importlib.metadata import version as v
    return v(PACKAGES[peer])


def boto3_client(url: str):
    import boto3
    from botocore.config import Config
    config = Config(s3={"addressing_style": "path"}, max_pool_connections=32,
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required")
    return boto3.client("s3", endpoint_url=url, config=config)


def read_local(job: dict):
    root = Path(job["root"])
    for path, _size in job["files"]:
        yield path, (root / path).read_bytes()


def s3_url(job: dict) -> str:
    return f"s3://{job['bucket']}/{job['dst_prefix']}"


# ---- MosaicML Streaming (MDS) --------------------------------------------------------------------
def _torchvision_or_stub() -> None:
    """`import streaming` imports torchvision (for its vision datasets, unused here); the PyPI wheel
    of torchvision is the CUDA build and cannot load against the CPU torch: stub the three names."""
    try:
        import torchvision  # noqa: F401
        return
    except (ImportError, OSError, RuntimeError):
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    import importlib.machinery
    import types
    stubs = {name: types.ModuleType(name) for name in
             ("torchvision", "torchvision.datasets", "torchvision.transforms", "torchvision.transforms.functional")}
    for name, module in stubs.items():
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    stubs["torchvision.datasets"].VisionDataset = type("VisionDataset", (), {})
    stubs["torchvision.datasets"].CIFAR10 = type("CIFAR10", (), {})
    stubs["torchvision.transforms.functional"].to_tensor = lambda x: x
    sys.modules.update(stubs)


def streaming_convert(job: dict) -> None:
    _torchvision_or_stub()
    from streaming import MDSWriter
    with MDSWriter(out=s3_url(job), columns={"path": "str", "data": "bytes"},
                   size_limit=SHARD_BYTES, max_workers=8) as writer:
        for path, data in read_local(job):
            writer.write({"path": path, "data": data})


def streaming_dataset(job: dict, cache: Path):
    _torchvision_or_stub()
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    clean_stale_shared_memory()
    return StreamingDataset(remote=s3_url(job), local=str(cache), shuffle=True, shuffle_seed=job["seed"],
                            batch_size=job.get("batch_size") or 1)   # MDS partitions by the DataLoader's batch


def streaming_sample(item) -> tuple[str, bytes]:
    return item["path"], item["data"]


# ---- LitData -------------------------------------------------------------------------------------
def _litdata_item(entry: list) -> dict:
    path, root = entry
    return {"path": path, "data": (Path(root) / path).read_bytes()}


def _litdata_allow_http() -> None:
    """LitData 0.2.76 moves chunks with obstore, whose client refuses http:// endpoints unless told
    (no environment variable reaches its fixed client options): add allow_http to them."""
    from litdata.streaming import downloader
    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(options, dict):
        options["allow_http"] = "true"


def litdata_convert(job: dict) -> None:
    _litdata_allow_http()
    from litdata import optimize
    inputs = [[path, job["root"]] for path, _ in job["files"]]
    optimize(fn=_litdata_item, inputs=inputs, output_dir=s3_url(job), chunk_bytes=SHARD_BYTES,
             num_workers=os.cpu_count() or 1, storage_options={"endpoint_url": job["endpoint_url"]},
             mode="overwrite")


def litdata_dataset(job: dict, cache: Path):
    _litdata_allow_http()
    from litdata import StreamingDataset
    from litdata.streaming.resolver import Dir
    return StreamingDataset(Dir(path=str(cache), url=s3_url(job)), shuffle=True, seed=job["seed"],
                            storage_options={"endpoint_url": job["endpoint_url"]})


def litdata_sample(item) -> tuple[str, bytes]:
    return item["path"], item["data"]


# ---- WebDataset ----------------------------------------------------------------------------------
def webdataset_convert(job: dict) -> None:
    import webdataset as wds
    out = Path(job["scratch"]) / "wds"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxsize=SHARD_BYTES, maxcount=10**9,
                         verbose=0) as sink:
        for i, (path, data) in enumerate(read_local(job)):
            sink.write({"__key__": f"{i:08d}", "txt": path, "bin": data})
    client = boto3_client(job["endpoint_url"])
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: client.upload_file(str(p), job["bucket"], f"{job['dst_prefix']}/{p.name}"),
                      sorted(out.glob("*.tar"))))
    shutil.rmtree(out, ignore_errors=True)


_S3 = {}


def _s3_open(url: str, mode: str = "rb", bufsize: int = 8192, **_kw):
    """webdataset's gopen handler for s3:// (one boto3 client per worker process)."""
    client = _S3.get(os.getpid())
    if client is None:
        client = _S3[os.getpid()] = boto3_client(_S3["endpoint_url"])
    bucket, key = url.removeprefix("s3://").split("/", 1)
    return client.get_object(Bucket=bucket, Key=key)["Body"]


def webdataset_dataset(job: dict, cache: Path):
    import webdataset as wds
    gopen = sys.modules["webdataset.gopen"]      # the package exports a function of the same name
    _S3["endpoint_url"] = job["endpoint_url"]
    gopen.gopen_schemes["s3"] = _s3_open
    listing = boto3_client(job["endpoint_url"]).list_objects_v2(Bucket=job["bucket"],
                                                                Prefix=job["dst_prefix"] + "/")
    urls = sorted(f"s3://{job['bucket']}/{o['Key']}" for o in listing.get("Contents", []) if o["Key"].endswith(".tar"))
    return (wds.WebDataset(urls, shardshuffle=len(urls), seed=job["seed"], empty_check=False)
            .to_tuple("txt", "bin"))


def webdataset_sample(item) -> tuple[str, bytes]:
    path, data = item
    return path.decode(), data


# ---- s3torchconnector (no converter: it reads the unpacked objects) ------------------------------
def s3torch_convert(job: dict) -> None:
    return None


def _s3torch_transform(obj) -> tuple[str, bytes]:
    return obj.key, obj.read()


def s3torch_dataset(job: dict, cache: Path):
    from s3torchconnector import S3ClientConfig, S3MapDataset
    return S3MapDataset.from_prefix(f"s3://{job['bucket']}/{job['src_prefix']}/", region="us-east-1",
                                    endpoint=job["endpoint_url"], transform=_s3torch_transform,
                                    s3client_config=S3ClientConfig(force_path_style=True))


def s3torch_sample(item) -> tuple[str, bytes]:
    key, data = item
    return key, data


# ---- the epoch -----------------------------------------------------------------------------------
def _raw(path, data) -> tuple[str, bytes]:
    return str(path), data if isinstance(data, bytes) else bytes(data)


def epoch(job: dict, peer: str, dataset) -> dict:
    import torch
    from torch.utils.data import DataLoader
    sample = globals()[f"{peer}_sample"]
    sizes = dict((p, s) for p, s in job["files"])
    prefix = job["src_prefix"] + "/"
    map_style = hasattr(dataset, "__getitem__") and not isinstance(dataset, torch.utils.data.IterableDataset)
    kwargs = {"shuffle": True, "generator": torch.Generator().manual_seed(job["seed"])} if map_style else {}
    # fork, the Linux default, as in the cachefs rows (LitData's optimize() sets the global start method
    # to spawn for its own workers; the epoch must not inherit that)
    # collate_fn: each peer's sample as (path, bytes) in the worker. The default (default_convert) would
    # turn a memoryview (LitData's bytes) into a list of 110,000 ints, one per byte.
    # batch_size > 0: batches collated as lists of (path, bytes), as the cachefs rows take them.
    batch = job.get("batch_size") or 0
    if batch > 0:
        kwargs.update(batch_size=batch, collate_fn=lambda items: [_raw(*sample(i)) for i in items])
    else:
        kwargs.update(batch_size=None, collate_fn=lambda item: [_raw(*sample(item))])
    loader = DataLoader(dataset, num_workers=job["workers"], multiprocessing_context="fork", **kwargs)
    seen, files, nbytes, bad = set(), 0, 0, 0
    for path, data in (one for items in loader for one in items):
        path = path.removeprefix(prefix)
        files += 1
        nbytes += len(data)
        seen.add(path)
        bad += sizes.get(path) != len(data)
    return {"files": files, "bytes": nbytes, "bad_size": bad, "missing": len(sizes.keys() - seen)}


def run(peer: str, job: dict, step: str) -> dict:
    """``step`` "convert" or "epoch": each in a process of its own (a user converts once, then trains
    in a new process; LitData's obstore runtime is not fork-safe once a process has used it)."""
    os.environ["S3_ENDPOINT_URL"] = job["endpoint_url"]   # MDS reads its endpoint from here
    os.environ.setdefault("DISABLE_S5CMD", "1")
    os.environ.setdefault("AWS_ALLOW_HTTP", "true")               # LitData's obstore path: http endpoint
    out = {"peer": peer, "version": version(peer)}
    if step == "convert":
        start = time.monotonic()
        globals()[f"{peer}_convert"](job)
        out["convert_s"] = None if peer == "s3torch" else round(time.monotonic() - start, 3)
        return out
    cache = Path(tempfile.mkdtemp(prefix=f"{peer}-cache-", dir=job["scratch"]))
    try:
        start = time.monotonic()
        with CpuMeter(store=job.get("store_pids", [])) as cpu:   # the DataLoader's workers are joined in it
            dataset = globals()[f"{peer}_dataset"](job, cache)
            out.update(epoch(job, peer, dataset))
        out["epoch_s"] = round(time.monotonic() - start, 3)
        out["cpu"] = cpu.per_file(out["files"])
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return out


def main(argv: list[str]) -> int:
    peer, step, job_file = argv
    if peer not in PEERS or step not in ("convert", "epoch"):
        print(f"packed_peers: usage: PEER ({', '.join(PEERS)}) convert|epoch JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(job_file).read_text())
    print(json.dumps(run(peer, job, step)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
