"""Real FUSE mounts of buckets on a real Ceph RGW (16.2, single-node cluster from ``ceph_rgw``).

moto is the faithful server for most behaviour tests; these check what differs on the object
store cachefs is built for: If-Match on ranged GETs, RGW's empty CompleteMultipartUpload ETag,
its listing pagination, warm remounts, and the packer end to end. The cluster starts once for
the module (~6 s). Skipped when the ceph binaries are missing, except under CI=true, where
`make deps` installs them.
"""

import errno
import hashlib
import io
import json
import os
import random
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from ceph_rgw import CephRGW
from mounts import cachefs, overwrite_while_open
from rgw_fixtures import BLOCK, bucket, ceph_rgw, client, mount_args, rgw  # noqa: F401  (fixtures)

pytestmark = pytest.mark.fuse

MIB = 1 << 20


def put_all(client, bucket: str, files: dict[str, bytes]) -> None:
    def put(item):
        client.put_object(Bucket=bucket, Key=item[0], Body=item[1])
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, files.items()))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree_digests(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            full = Path(dirpath) / name
            out[str(full.relative_to(root))] = sha(full.read_bytes())
    return out


def drop_page_cache() -> None:
    subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=False)


def dataset() -> dict[str, bytes]:
    rng = random.Random(11)
    files = {f"train/c{c}/img_{i}.jpg": rng.randbytes(rng.randint(1, 30_000)) for c in range(3) for i in range(6)}
    files["train/empty.txt"] = b""
    files["big.bin"] = rng.randbytes(9 * BLOCK + 4321)         # 10 blocks, the last one partial
    return files


@pytest.fixture
def loaded(client, bucket):
    files = dataset()
    put_all(client, bucket, {f"ds/{path}": data for path, data in files.items()})
    return bucket, files


# ---- reads ---------------------------------------------------------------------------------------

def test_tree_and_multi_block_file_read_intact(rgw, loaded, mount_factory):
    bucket, files = loaded
    mnt = mount_factory(f"s3://{bucket}/ds", *mount_args(rgw)).start()
    assert tree_digests(mnt.path) == {path: sha(data) for path, data in files.items()}
    data = files["big.bin"]
    rng = random.Random(5)
    fd = os.open(mnt / "big.bin", os.O_RDONLY)
    try:
        for _ in range(60):
            off = rng.randrange(0, len(data) + 10)
            size = rng.choice([1, 4096, BLOCK - 1, BLOCK + 1, 3 * BLOCK + 17])
            assert os.pread(fd, size, off) == data[off:off + size], (off, size)
    finally:
        os.close(fd)


def test_warm_remount_makes_zero_gets(rgw, loaded, mount_factory):
    bucket, files = loaded
    expected = {path: sha(data) for path, data in files.items()}
    mnt = mount_factory(f"s3://{bucket}/ds", *mount_args(rgw)).start()
    assert tree_digests(mnt.path) == expected
    assert mnt.requests("get") >= len([d for d in files.values() if d])
    mnt.umount()
    drop_page_cache()
    mnt.start()
    assert tree_digests(mnt.path) == expected
    assert mnt.requests("get") == 0, mnt.status()["store_requests"]


@pytest.mark.parametrize("ahead", [False, True], ids=["per-folder", "list-ahead"])
def test_listing_of_more_than_1000_keys_is_paginated(rgw, client, bucket, mount_factory, ahead):
    """Per folder (two delimited pages) and ahead at mount (two recursive pages, --list-ahead):
    RGW's pages at 1,000 keys give the same 1,100 names, the recursive ones with no LIST later."""
    names = [f"f{i:05d}" for i in range(1100)]
    put_all(client, bucket, {f"many/{name}": name.encode() for name in names})
    first = client.list_objects_v2(Bucket=bucket, Prefix="many/", Delimiter="/")
    assert first["IsTruncated"] and len(first["Contents"]) == 1000      # RGW pages at 1,000 keys
    mnt = mount_factory(f"s3://{bucket}", *mount_args(rgw), "--list-ahead", "100000" if ahead else "0").start()
    if ahead:
        mnt.wait_listed_ahead()
    assert (mnt / "many").is_dir()
    lists = mnt.requests("list")
    assert sorted(os.listdir(mnt / "many")) == names
    assert mnt.requests("list") - lists == (0 if ahead else 2)          # two pages, continuation token
    assert (mnt / "many/f01099").read_bytes() == b"f01099"


# ---- version pinning: RGW honours If-Match ---------------------------------------------------------

def test_overwrite_while_open_gives_an_error_never_mixed_bytes(rgw, client, bucket, mount_factory):
    size, small = 4 * MIB, 64 * 1024
    v1, v2 = random.Random(1).randbytes(size), random.Random(2).randbytes(size)
    client.put_object(Bucket=bucket, Key="obj", Body=v1)
    mnt = mount_factory(f"s3://{bucket}", "--endpoint-url", rgw.endpoint_url, "--block-size", str(small),
                        "--metadata-ttl", "1").start()
    overwrite_while_open(client, bucket, mnt, v1, v2, small)      # an uncached block: 412 from RGW
    assert mnt.requests("get") >= 2
    time.sleep(1.5)                                        # past the metadata TTL: the new version
    assert sha((mnt / "obj").read_bytes()) == sha(v2)


# ---- write-back: multipart on RGW --------------------------------------------------------------

def test_multipart_write_back_round_trip(rgw, client, bucket, mount_factory):
    """A checkpoint bigger than --upload-part-size goes up as a multipart upload. RGW 16.2 answers
    CompleteMultipartUpload with an empty ETag: cachefs must pin the object's real `md5-N` ETag
    (from a HEAD), so its ranged GETs carry a matching If-Match, and a later overwrite in the
    bucket is refused (412 -> EIO) instead of read as new bytes under an old open file."""
    size = 12 * MIB + 333                                  # 3 parts of 5 MiB (RGW's minimum part size)
    data, other = random.Random(9).randbytes(size), random.Random(10).randbytes(size)
    mnt = mount_factory(f"s3://{bucket}", "--endpoint-url", rgw.endpoint_url, "--block-size", str(BLOCK),
                        "--upload-part-size", "5M", "--metadata-ttl", "3600").start()
    (mnt / "model.pt").write_bytes(data)
    result = cachefs("sync", str(mnt.path), "--wait", "--timeout", "60")
    assert result.returncode == 0, result.stdout + result.stderr
    wb = mnt.status()["writeback"]
    assert wb["staged_files"] == 0 and not wb["failing"], wb
    head = client.head_object(Bucket=bucket, Key="model.pt")
    assert head["ETag"].strip('"').endswith("-3"), head["ETag"]
    assert sha(client.get_object(Bucket=bucket, Key="model.pt")["Body"].read()) == sha(data)
    drop_page_cache()
    gets = mnt.requests("get")
    fd = os.open(mnt / "model.pt", os.O_RDONLY)
    try:
        assert os.pread(fd, BLOCK, 0) == data[:BLOCK]      # a GET whose If-Match RGW accepts
        assert mnt.requests("get") > gets
        client.put_object(Bucket=bucket, Key="model.pt", Body=other)
        with pytest.raises(OSError) as info:               # an uncached block of the old version
            os.pread(fd, BLOCK, size - BLOCK)
        assert info.value.errno in (errno.EIO, errno.ESTALE)
    finally:
        os.close(fd)


# ---- packed datasets on RGW ------------------------------------------------------------------------

@pytest.fixture
def packer(rgw: CephRGW, pack_cli):
    """`cachefs pack` / `unpack` in-process (conftest's ``pack_cli``) against the cluster."""
    return lambda command, *args: pack_cli(command, *args, "--endpoint-url", rgw.endpoint_url)


def test_pack_mount_append_verify_and_unpack_on_rgw(rgw, client, bucket, mount_factory, packer, tmp_path):
    """The whole packer on RGW: shards streamed out as multipart uploads (8 MiB parts; RGW's
    completion ETag is empty, so the shards table must hold the HEAD's `md5-N`, which the packed
    mount pins with If-Match), the original tree read back through the mount, an append generation
    with a tombstone, --verify, and unpack."""
    rng = random.Random(21)
    files = {f"train/c{i % 3}/img_{i:03d}.jpg": rng.randbytes(rng.randint(1, 40_000)) for i in range(120)}
    files |= {f"raw/{i}.bin": rng.randbytes(3 * MIB + i) for i in range(6)} | {"train/empty.txt": b""}
    put_all(client, bucket, {f"src/{path}": data for path, data in files.items()})
    src, dst = f"s3://{bucket}/src", f"s3://{bucket}/packed"
    assert packer("pack", src, dst, "--shard-size", "12M") == 0
    manifest = json.loads(client.get_object(Bucket=bucket, Key="packed/manifest.json")["Body"].read())
    assert manifest["files"] == len(files) and manifest["shards"] >= 2
    head = client.head_object(Bucket=bucket, Key="packed/shards/00000.tfrecord")
    assert head["ETag"].strip('"').endswith("-2"), head["ETag"]          # streamed out in two parts
    table = client.get_object(Bucket=bucket, Key=f"packed/{manifest['index_shards']}")["Body"].read()
    etags = {row["shard"]: row["etag"] for row in pq.read_table(io.BytesIO(table)).to_pylist()}
    assert etags[0].strip('"') == head["ETag"].strip('"')               # the HEAD's, not the empty answer

    mnt = mount_factory(dst, "--endpoint-url", rgw.endpoint_url, "--block-size", "1M").start()
    assert tree_digests(mnt.path) == {path: sha(data) for path, data in files.items()}
    assert 0 < mnt.requests("get") <= 40, mnt.status()["store_requests"]  # shard blocks, not 127 files
    mnt.umount()

    gone, changed = "train/c0/img_000.jpg", "raw/2.bin"
    client.delete_object(Bucket=bucket, Key=f"src/{gone}")
    client.put_object(Bucket=bucket, Key=f"src/{changed}", Body=b"changed on rgw")
    files.pop(gone)
    files[changed] = b"changed on rgw"
    assert packer("pack", src, dst, "--append") == 0
    assert packer("pack", "--verify", dst) == 0
    drop_page_cache()
    mnt.start()
    assert tree_digests(mnt.path) == {path: sha(data) for path, data in files.items()}
    mnt.umount()
    assert packer("unpack", dst, str(tmp_path / "out")) == 0
    assert tree_digests(tmp_path / "out") == {path: sha(data) for path, data in files.items()}
