"""An ImageNet-like benchmark dataset: written once locally, uploaded to S3, with a manifest.

Layout (deterministic: the same options give the same names, sizes and bytes):
    train/n{class:05d}/img_{i:06d}.JPEG   ``files`` small files spread over ``classes`` folders,
                                          ``file_size`` +-``jitter`` (incompressible bytes)
    large/shard_{k}.bin                   ``large`` files of ``large_size`` bytes

``OUT/data/`` holds the tree (the local-disk baseline), ``OUT/manifest.tsv`` one line per
file (path, size, xxh3_64 hex) and ``OUT/params.json`` the options, so a second run with
the same options reuses the tree instead of writing it again.

    python benchmarks/dataset.py --out /var/tmp/ds --files 10000 --large 2 \
        [--endpoint-url http://127.0.0.1:PORT --bucket bench --prefix imagenet]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

MiB = 1 << 20
KiB = 1 << 10
WRITE_CHUNK = 4 * MiB
_UNITS = {"": 1, "K": KiB, "KI": KiB, "M": MiB, "MI": MiB, "G": 1 << 30, "GI": 1 << 30}


def parse_size(text: str | int) -> int:
    """'110KiB' -> 112640, '512M' -> 536870912 (powers of 1024); ints are bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().removesuffix("B")
    digits = s.rstrip("KMGI")
    return int(float(digits) * _UNITS[s[len(digits):]])


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    files: int = 10_000
    classes: int = 100
    file_size: int = 110 * KiB
    jitter: float = 0.20
    large: int = 2
    large_size: int = 512 * MiB
    seed: int = 0

    def entries(self) -> list[tuple[str, int]]:
        """(path, size) of every file, small ones first."""
        rng = random.Random(self.seed)
        small = [(small_path(i, self.classes), self._jittered(rng)) for i in range(self.files)]
        large = [(f"large/shard_{k}.bin", self.large_size) for k in range(self.large)]
        return small + large

    def _jittered(self, rng: random.Random) -> int:
        return max(1, round(self.file_size * (1 + rng.uniform(-self.jitter, self.jitter))))


@dataclasses.dataclass(frozen=True)
class Entry:
    path: str
    size: int
    xxh3: str

    @property
    def is_large(self) -> bool:
        return self.path.startswith("large/")


def small_path(i: int, classes: int) -> str:
    return f"train/n{i % classes:05d}/img_{i:06d}.JPEG"


def file_bytes(path: str, size: int, seed: int):
    """Yield the deterministic, incompressible content of ``path`` in chunks."""
    rng = random.Random(zlib.crc32(path.encode()) ^ seed)
    left = size
    while left:
        n = min(left, WRITE_CHUNK)
        yield rng.randbytes(n)
        left -= n


def write_file(root: Path, path: str, size: int, seed: int) -> Entry:
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = xxhash.xxh3_64()
    with open(target, "wb") as fh:
        for chunk in file_bytes(path, size, seed):
            digest.update(chunk)
            fh.write(chunk)
    return Entry(path, size, digest.hexdigest())


# ---- the local copy and its manifest -------------------------------------------------------------
def build_local(out: Path, spec: DatasetSpec, workers: int = 4) -> list[Entry]:
    """Write the tree under ``out/data`` (or reuse it) and return the manifest."""
    params = out / "params.json"
    if params.exists() and json.loads(params.read_text()) == dataclasses.asdict(spec):
        return read_manifest(out / "manifest.tsv")
    params.unlink(missing_ok=True)
    root = out / "data"
    shutil.rmtree(root, ignore_errors=True)
    with ThreadPoolExecutor(workers) as pool:
        entries = list(pool.map(lambda e: write_file(root, e[0], e[1], spec.seed), spec.entries()))
    os.sync()
    write_manifest(out / "manifest.tsv", entries)
    params.write_text(json.dumps(dataclasses.asdict(spec)))
    return entries


def write_manifest(path: Path, entries: list[Entry]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{e.path}\t{e.size}\t{e.xxh3}\n" for e in entries))
    tmp.rename(path)


def read_manifest(path: Path) -> list[Entry]:
    entries = []
    for line in Path(path).read_text().splitlines():
        name, size, digest = line.split("\t")
        entries.append(Entry(name, int(size), digest))
    return entries


# ---- upload --------------------------------------------------------------------------------------
def s3_client(endpoint_url: str, pool: int = 32):
    import boto3
    from botocore.config import Config
    config = Config(s3={"addressing_style": "path"}, max_pool_connections=pool,
                    retries={"mode": "standard", "max_attempts": 5},
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required")
    return boto3.client("s3", endpoint_url=endpoint_url, config=config)


def upload(root: Path, entries: list[Entry], endpoint_url: str, bucket: str, prefix: str,
           workers: int = 16) -> float:
    """Upload the tree to s3://bucket/prefix (creating the bucket); return seconds taken."""
    from boto3.s3.transfer import TransferConfig
    client = s3_client(endpoint_url, pool=workers + 8)
    ensure_bucket(client, bucket)
    multipart = TransferConfig(multipart_threshold=64 * MiB, multipart_chunksize=64 * MiB,
                               max_concurrency=4)
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        small = [e for e in entries if not e.is_large]
        list(pool.map(lambda e: client.put_object(Bucket=bucket, Key=object_key(prefix, e.path),
                                                  Body=(root / e.path).read_bytes()), small))
    for e in entries:
        if e.is_large:
            client.upload_file(str(root / e.path), bucket, object_key(prefix, e.path),
                               Config=multipart)
    return time.perf_counter() - start


def object_key(prefix: str, path: str) -> str:
    prefix = prefix.strip("/")
    return f"{prefix}/{path}" if prefix else path


def ensure_bucket(client, bucket: str) -> None:
    try:
        client.head_bucket(Bucket=bucket)
    except client.exceptions.ClientError:
        client.create_bucket(Bucket=bucket)


# ---- CLI -----------------------------------------------------------------------------------------
def add_spec_options(parser: argparse.ArgumentParser) -> None:
    d = DatasetSpec()
    parser.add_argument("--files", type=int, default=d.files, help="small files")
    parser.add_argument("--classes", type=int, default=d.classes, help="class folders")
    parser.add_argument("--file-size", type=parse_size, default=d.file_size,
                        help="mean small-file size (default 110KiB)")
    parser.add_argument("--jitter", type=float, default=d.jitter, help="size jitter, +-fraction")
    parser.add_argument("--large", type=int, default=d.large, help="large files")
    parser.add_argument("--large-size", type=parse_size, default=d.large_size,
                        help="size of each large file (default 512MiB)")
    parser.add_argument("--seed", type=int, default=d.seed)


def spec_from_args(args: argparse.Namespace) -> DatasetSpec:
    return DatasetSpec(files=args.files, classes=args.classes, file_size=args.file_size,
                       jitter=args.jitter, large=args.large, large_size=args.large_size,
                       seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate (and upload) the benchmark dataset.")
    parser.add_argument("--out", required=True, type=Path, help="directory for data/ and manifest")
    add_spec_options(parser)
    parser.add_argument("--endpoint-url", help="upload to this S3 endpoint (credentials: AWS env)")
    parser.add_argument("--bucket", default="bench")
    parser.add_argument("--prefix", default="imagenet")
    parser.add_argument("--workers", type=int, default=16, help="parallel uploads")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    entries = build_local(args.out, spec_from_args(args))
    total = sum(e.size for e in entries)
    print(f"local: {len(entries)} files, {total / MiB:.0f} MiB in {args.out / 'data'} "
          f"({time.perf_counter() - start:.1f} s)")
    if args.endpoint_url:
        seconds = upload(args.out / "data", entries, args.endpoint_url, args.bucket, args.prefix,
                         args.workers)
        print(f"uploaded to s3://{args.bucket}/{args.prefix} in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
