"""`cachefs mount` of a packed dataset (`cachefs pack` output) on a moto bucket, through the proxy:
the original tree from the index, byte-identical reads through shard blocks (few GETs), crc32c
checks against a corrupted shard, warmup of whole shards, and refusals of bad manifests."""

import errno
import io
import json
import os
import random
import time
import urllib.request
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mounts import cachefs, is_mounted, put_tree

from cachefs.cli import main
from cachefs.data import PackedDataset, PackedIterableDataset
from cachefs.packfmt import PackExit
from cachefs.packfmt.index import SHARDS_SCHEMA, parquet_bytes
from cachefs.packfmt.store_index import open_local_index
from testing.latency_proxy import LatencyProxy
from testing.s3 import s3_client

pytestmark = pytest.mark.fuse

BLOCK = 256 * 1024
PACKED = ".cachefs-packed"


@pytest.fixture(autouse=True)
def pack_command(pack_cli):
    """Every test here runs `cachefs pack` in-process (conftest's ``pack_cli``)."""


@pytest.fixture
def proxied(s3_server, bucket):
    url = urlparse(s3_server.endpoint_url)
    with LatencyProxy(url.hostname, url.port, latency=0.0) as proxy:
        yield proxy, bucket, s3_client(s3_server.endpoint_url)


def make_files(n: int = 200, seed: int = 5) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {f"train/c{i % 4}/img_{i:04d}.jpg": rng.randbytes(rng.randint(1, 16_000)) for i in range(n)}
    files["train/empty.txt"] = b""
    files["val/big.bin"] = rng.randbytes(3 * BLOCK + 11)
    files["labels.csv"] = b"path,label\n"
    return files


def packed_bucket(server, bucket, client, files, *args) -> None:
    put_tree(client, bucket, "src", files)
    assert main(["pack", "--quiet", f"s3://{bucket}/src", f"s3://{bucket}/packed",
                 "--endpoint-url", server.endpoint_url, *args]) == 0


def mount(proxy, bucket, mount_factory, *extra, **kwargs):
    return mount_factory(f"s3://{bucket}/packed", "--endpoint-url", proxy.endpoint_url, "--block-size", str(BLOCK),
                         "--connect-timeout", "1", "--max-attempts", "2", *extra, **kwargs)


def tree_of(root) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, root)] = open(full, "rb").read()
    return out


def test_the_original_tree_reads_back_byte_identical_with_few_gets(s3_server, proxied, mount_factory):
    proxy, bucket, client = proxied
    files = make_files()
    packed_bucket(s3_server, bucket, client, files, "--shard-size", "2M")
    mnt = mount(proxy, bucket, mount_factory, "--block-size", "1M").start()     # ~90 files a block
    gets, lists = mnt.requests("get"), mnt.requests("list")

    assert sorted(os.listdir(mnt.path)) == ["labels.csv", "train", "val"]     # no shards, no manifest
    assert tree_of(mnt.path) == files
    epoch_gets = mnt.requests("get") - gets
    assert epoch_gets <= len(files) / 20, epoch_gets
    assert mnt.requests("list") == lists                    # the index is the listing
    for path in ("train/c1/img_0001.jpg", "val/big.bin", "train/empty.txt"):
        head = client.head_object(Bucket=bucket, Key=f"src/{path}")
        st = os.stat(mnt / path)
        assert st.st_size == len(files[path])
        assert int(st.st_mtime) == int(head["LastModified"].timestamp())
        assert st.st_mode == 0o100644

    with open(mnt / "val/big.bin", "rb") as f:                # random access inside a record
        f.seek(BLOCK - 5)
        assert f.read(100) == files["val/big.bin"][BLOCK - 5:BLOCK + 95]

    # the raw layout is found by name, and the native loader reads it through the mount
    assert json.loads((mnt / PACKED / "manifest.json").read_bytes())["files"] == len(files)
    assert "shards" in os.listdir(mnt / PACKED)
    for root in (mnt / PACKED, mnt.path):      # the loader finds the layout of a mount by itself
        with PackedDataset(root) as ds:
            assert len(ds) == len(files) and ds.get("val/big.bin") == files["val/big.bin"]

    with pytest.raises(OSError) as info:
        open(mnt / "labels.csv", "wb")
    assert info.value.errno == errno.EROFS
    with pytest.raises(OSError) as info:
        (mnt / "train/new.txt").write_bytes(b"x")
    assert info.value.errno == errno.EROFS
    mnt.umount()


def corrupt_record(client, bucket, path: str) -> None:
    """Flip a byte in the data of ``path``'s record and publish the shard's new ETag in the shards
    table (as a bad disk or a bad copy would, below an index that still trusts it)."""
    manifest = json.loads(client.get_object(Bucket=bucket, Key="packed/manifest.json")["Body"].read())
    files = pq.read_table(io.BytesIO(client.get_object(Bucket=bucket, Key=f"packed/{manifest['index_files']}")
                                     ["Body"].read())).to_pylist()
    row = next(r for r in files if r["path"] == path)
    key = f"packed/shards/{row['shard']:05d}.tfrecord"
    shard = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    shard[row["data_offset"] + row["data_length"] // 2] ^= 0x40
    etag = client.put_object(Bucket=bucket, Key=key, Body=bytes(shard))["ETag"].strip('"')
    table_key = f"packed/{manifest['index_shards']}"
    shards = pq.read_table(io.BytesIO(client.get_object(Bucket=bucket, Key=table_key)["Body"].read())).to_pylist()
    shards[row["shard"]]["etag"] = etag
    client.put_object(Bucket=bucket, Key=table_key, Body=parquet_bytes(pa.Table.from_pylist(shards, SHARDS_SCHEMA)))


@pytest.mark.allow_warnings
def test_a_corrupted_record_is_eio_never_wrong_bytes(s3_server, proxied, mount_factory):
    proxy, bucket, client = proxied
    files = make_files(n=60)
    packed_bucket(s3_server, bucket, client, files, "--shard-size", "1M")
    bad = "train/c2/img_0010.jpg"
    corrupt_record(client, bucket, bad)
    mnt = mount(proxy, bucket, mount_factory).start()
    with pytest.raises(OSError) as info:
        (mnt / bad).read_bytes()
    assert info.value.errno == errno.EIO
    assert mnt.status()["packed_crc_errors"] >= 1
    for path, data in files.items():                        # every other record of the shard is right
        if path != bad:
            assert (mnt / path).read_bytes() == data, path
    gets = mnt.requests("get")
    with pytest.raises(OSError):
        (mnt / bad).read_bytes()                            # still refused: refetched, still wrong
    assert mnt.requests("get") > gets                       # the bad block was evicted and fetched again
    mnt.umount()


def test_warmup_fetches_whole_shards_then_reads_come_from_the_cache(s3_server, proxied, mount_factory):
    proxy, bucket, client = proxied
    files = make_files()
    packed_bucket(s3_server, bucket, client, files, "--shard-size", "1M")
    mnt = mount(proxy, bucket, mount_factory).start()
    manifest = json.loads((mnt / PACKED / "manifest.json").read_bytes())
    shards = pq.read_table(mnt / PACKED / manifest["index_shards"]).column("bytes").to_pylist()
    gets = mnt.requests("get")
    result = cachefs("warmup", "--json", str(mnt / "train/c1"))
    assert result.returncode == 0, result.stderr
    done = [json.loads(line) for line in result.stdout.splitlines()][-1]
    assert done["failed_files"] == 0 and done["fetched_files"] == done["files"] >= 1    # shards
    assert done["bytes"] == done["done_bytes"] > sum(len(v) for k, v in files.items() if k.startswith("train/c1/"))
    result = cachefs("warmup", "--json", str(mnt.path))
    assert result.returncode == 0, result.stderr
    done = [json.loads(line) for line in result.stdout.splitlines()][-1]
    assert done["files"] == manifest["shards"] and done["bytes"] == manifest["shard_bytes"]
    assert mnt.requests("get") - gets == sum(-(-size // BLOCK) for size in shards)   # each block once
    proxy.refuse(True)
    assert tree_of(mnt.path) == files
    proxy.refuse(False)
    mnt.umount()


def test_a_packed_mount_reads_blocks_of_one_multipart_part(s3_server, proxied, mount_factory):
    """Unless --block-size says otherwise, a packed mount's cache blocks are the packer's 8 MiB
    parts, so each block GET reads one part (an unpacked mount keeps 4 MiB blocks)."""
    from cachefs.config import DEFAULT_BLOCK_SIZE, PACKED_BLOCK_SIZE
    from packer.options import PART_SIZE
    assert PART_SIZE == PACKED_BLOCK_SIZE == 2 * DEFAULT_BLOCK_SIZE
    proxy, bucket, client = proxied
    rng = random.Random(3)
    files = {f"d/f{i:02d}.bin": rng.randbytes(700_000) for i in range(30)}      # one 20 MiB shard
    packed_bucket(s3_server, bucket, client, files, "--shard-size", "64M")
    shard = client.list_objects_v2(Bucket=bucket, Prefix="packed/shards/")["Contents"][0]
    assert client.head_object(Bucket=bucket, Key=shard["Key"], PartNumber=1)["ContentLength"] == PART_SIZE
    mnt = mount_factory(f"s3://{bucket}/packed", "--endpoint-url", proxy.endpoint_url).start()
    assert mnt.status()["block_size"] == PACKED_BLOCK_SIZE
    assert "blocks of 8.0 MiB" in cachefs("status", str(mnt.path)).stdout
    gets = mnt.requests("get")
    assert cachefs("warmup", str(mnt.path)).returncode == 0
    assert mnt.requests("get") - gets == -(-shard["Size"] // PART_SIZE) == 3   # a GET per part
    assert tree_of(mnt.path) == files
    mnt.umount()
    plain = mount_factory(f"s3://{bucket}/src", "--endpoint-url", proxy.endpoint_url, name="plain").start()
    assert plain.status()["block_size"] == DEFAULT_BLOCK_SIZE
    plain.umount()
    small = mount_factory(f"s3://{bucket}/packed", "--endpoint-url", proxy.endpoint_url, "--block-size", "1M",
                          name="set").start()
    assert small.status()["block_size"] == 1 << 20                                # what the user set
    small.umount()


def shards_of(mnt) -> dict[int, list[str]]:
    """shard number -> the paths of the files it holds, from the index (read through the mount)."""
    manifest = json.loads((mnt / PACKED / "manifest.json").read_bytes())
    out: dict[int, list[str]] = {}
    for row in pq.read_table(mnt / PACKED / manifest["index_files"], columns=["path", "shard"]).to_pylist():
        out.setdefault(row["shard"], []).append(row["path"])
    return out


def wait_shard_warms(mnt, shards: int, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = mnt.status()["warmup"]["shard_warm"]
        if state["shards"] >= shards and state["running"] == 0 and state["queued"] == 0 \
                and not mnt.status()["warmup"]["running"]:
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.05)


def test_the_first_read_of_a_shard_warms_all_of_it(s3_server, proxied, mount_factory):
    proxy, bucket, client = proxied
    files = make_files(400)
    packed_bucket(s3_server, bucket, client, files, "--shard-size", "1M")
    mnt = mount(proxy, bucket, mount_factory).start()
    by_shard = shards_of(mnt)
    assert len(by_shard) >= 3
    sizes = pq.read_table(mnt / PACKED / json.loads((mnt / PACKED / "manifest.json").read_bytes())
                          ["index_shards"]).column("bytes").to_pylist()
    gets, heads = mnt.requests("get"), mnt.requests("head")
    first = sorted(by_shard[1])[0]
    assert (mnt / first).read_bytes() == files[first]           # one file of shard 1 ...
    state = wait_shard_warms(mnt, 1)
    assert state["shards"] == 1 and state["bytes"] == sizes[1]
    # in the memory tier too: readers are reading that shard now (not read back from disk)
    assert mnt.status()["tiers"]["memory"]["blocks"] == -(-sizes[1] // BLOCK)
    shown = cachefs("status", str(mnt.path))
    assert shown.returncode == 0 and "  shards  1 read, " in shown.stdout, shown.stdout
    assert mnt.requests("get") - gets == -(-sizes[1] // BLOCK)    # ... fetched all of it, each block once
    assert mnt.requests("head") == heads                        # (its ETag is in the shards table)
    proxy.refuse(True)                                          # every file of shard 1 from the cache
    assert all((mnt / p).read_bytes() == files[p] for p in by_shard[1])
    with pytest.raises(OSError) as info:                        # the other shards were left alone
        (mnt / sorted(by_shard[2])[0]).read_bytes()
    assert info.value.errno == errno.EIO
    proxy.refuse(False)
    mnt.umount()

    small = mount(proxy, bucket, mount_factory, "--prefetch-budget", "4K", name="small").start()
    gets = small.requests("get")
    assert (small / first).read_bytes() == files[first]
    time.sleep(0.5)
    state = small.status()["warmup"]["shard_warm"]
    assert state["over_budget"] == 1 and state["bytes"] == 0
    assert small.requests("get") - gets < -(-sizes[1] // BLOCK)  # a block and its readahead, not the shard
    small.umount()
    off = mount(proxy, bucket, mount_factory, "--no-shard-warm", name="off").start()
    assert off.status()["warmup"]["shard_warm"] is None
    off.umount()


def test_the_loader_fetches_the_next_shards_ahead(s3_server, proxied, mount_factory):
    proxy, bucket, client = proxied
    files = make_files(400)
    packed_bucket(s3_server, bucket, client, files, "--shard-size", "512K")
    mnt = mount(proxy, bucket, mount_factory).start()
    with PackedIterableDataset(mnt.path, seed=3, lookahead=2) as ds:
        shards = ds.files.shard[ds.order()].tolist()
        ahead = list(dict.fromkeys(shards))[:3]        # the shard read first and the next two in its order
        assert len(dict.fromkeys(shards)) > 3
        samples = iter(ds)
        path, data = next(samples)
        assert data == files[path]
        wait_shard_warms(mnt, 3)
        check = cachefs("warmup", "--check", "--json", *(str(mnt / PACKED / "shards" / f"{s:05d}.tfrecord")
                                                         for s in ahead))
        assert check.returncode == 0, check.stdout + check.stderr
        report = json.loads(check.stdout.splitlines()[-1])
        assert report["files"] == 3 and report["cached_bytes"] == report["bytes"] > 0, report
        proxy.refuse(True)               # the first three shards' samples come from the cache alone;
        seen = 1                         # the fourth's first is an OSError (never SIGBUS, never wrong bytes)
        with pytest.raises(OSError) as info:
            for path, data in samples:
                assert ds.files.shard[ds.index.find(path)] in ahead and data == files[path]
                seen += 1
        assert info.value.errno == errno.EIO
        assert seen == sum(1 for s in shards if s in ahead)
        proxy.refuse(False)
    mnt.umount()


def bytes_served(port: int) -> float:
    """Bytes of files the daemon returned to readers (control-file replies not counted)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    found = [ln for ln in text.splitlines() if ln.startswith("cachefs_read_bytes_total ")]
    return float(found[0].split()[-1]) if found else 0.0


def block_files(cache_dir) -> list:
    return [p for p in cache_dir.rglob("*") if p.is_file() and p.stat().st_size > 4096
            and p.read_bytes()[:4] == b"CFSB"]


def test_the_loader_reads_cached_shards_from_the_daemons_files_not_through_fuse(s3_server, proxied,
                                                                                  mount_factory):
    """A daemon on this machine hands the loader its cache files (packed/channel.py): once the
    shards are on the disk tier, an epoch reads no byte through the mount and sends no GET, even
    with the store gone, and every sample is byte-identical."""
    from testing.s3 import free_port
    proxy, bucket, client = proxied
    files = make_files()
    packed_bucket(s3_server, bucket, client, files, "--shard-size", "1M")
    port = free_port()
    mnt = mount(proxy, bucket, mount_factory, "--metrics-port", str(port)).start()
    assert cachefs("warmup", str(mnt.path)).returncode == 0
    channel = mnt.status()["loader_fds"]
    assert channel["socket"] == str(mnt.cache_dir / "loader.sock") and channel["served"] == 0
    assert oct(os.stat(channel["socket"]).st_mode & 0o777) == oct(0o600)
    with PackedIterableDataset(mnt.path, seed=1) as ds:
        proxy.refuse(True)
        gets = mnt.requests("get")
        served = bytes_served(port)
        got = dict(iter(ds))
        assert bytes_served(port) == served and mnt.requests("get") == gets
    proxy.refuse(False)
    assert got == files
    manifest = json.loads((mnt / PACKED / "manifest.json").read_bytes())
    served = mnt.status()["loader_fds"]["served"]
    assert served >= manifest["shards"]
    shown = cachefs("status", str(mnt.path))
    assert f"local loaders: {served} cache files handed over" in shown.stdout
    assert "writes O_DIRECT" in shown.stdout and mnt.status()["tiers"]["disk"]["writes"] == "O_DIRECT"
    mnt.umount()
    assert not os.path.exists(channel["socket"])


def test_the_loader_asks_for_a_shard_warm_on_the_channel(s3_server, proxied, mount_factory):
    """Touching a shard (the iterable dataset does it for the shards ahead) asks the daemon's
    shard warm on the channel, not by reading a byte through the mount: the whole shard is then
    cached with no FUSE read at all."""
    from cachefs.data.shards import ShardFiles
    from testing.s3 import free_port
    proxy, bucket, client = proxied
    files = make_files()
    packed_bucket(s3_server, bucket, client, files, "--shard-size", "1M")
    port = free_port()
    mnt = mount(proxy, bucket, mount_factory, "--metrics-port", str(port)).start()
    shards = ShardFiles(mnt / PACKED, open_local_index(mnt / PACKED)[1])
    try:
        assert shards.direct is not None and shards.direct._socket is not None
        served = bytes_served(port)
        shards.touch(0)
        deadline = time.monotonic() + 30
        while not (warm := mnt.status()["warmup"]["shard_warm"]) or warm["shards"] < 1 or warm["running"] \
                or warm["queued"]:
            assert time.monotonic() < deadline, "the shard warm never ran"
            time.sleep(0.05)
        assert mnt.status()["loader_fds"]["warms"] == 1
        assert bytes_served(port) == served                        # nothing read through the mount
        assert shards.direct.complete(0, shards.names[0], shards.sizes[0])     # all of it on disk now
    finally:
        shards.close()


def test_dataloader_workers_use_the_channel_the_parent_found(s3_server, proxied, mount_factory, monkeypatch):
    """The dataset looks the channel up once, where it is built: forked DataLoader workers use
    that answer and do not each ask the daemon for its status as they start (which would delay
    every worker's first sample). Here a worker's status request would fail, turning its channel
    off; the cache files are read directly all the same."""
    torch_data = pytest.importorskip("torch.utils.data")
    from cachefs.control import client
    proxy, bucket, client_s3 = proxied
    files = make_files()
    packed_bucket(s3_server, bucket, client_s3, files, "--shard-size", "1M")
    mnt = mount(proxy, bucket, mount_factory).start()
    assert cachefs("warmup", str(mnt.path)).returncode == 0
    with PackedIterableDataset(mnt.path, seed=3) as ds:
        def no_status(*args, **kwargs):
            raise OSError("a worker asked the daemon for its status")
        monkeypatch.setattr(client, "request", no_status)     # inherited by the forked workers
        got = dict(torch_data.DataLoader(ds, batch_size=None, num_workers=2))
        monkeypatch.undo()
    assert got == files
    manifest = json.loads((mnt / PACKED / "manifest.json").read_bytes())
    assert mnt.status()["loader_fds"]["served"] >= manifest["shards"]
    mnt.umount()


def test_a_sample_is_read_back_from_the_file_the_worker_read_it_from(s3_server, proxied, mount_factory,
                                                                       monkeypatch):
    """A sample a worker read through the mount (its block was not on the disk tier yet) sits in the
    page cache of the mount's shard file: the main process reads it back there, even where it holds
    the daemon's cache file by then (a disk read). One read directly is read back directly."""
    import gc
    import pickle

    from cachefs.data import dataset as dataset_module
    from cachefs.data.direct import DirectShards
    proxy, bucket, client = proxied
    files = make_files()
    packed_bucket(s3_server, bucket, client, files, "--shard-size", "1M")
    mnt = mount(proxy, bucket, mount_factory).start()
    monkeypatch.setattr(dataset_module, "_in_worker", lambda: True)     # samples go by reference
    cold = PackedDataset(mnt.path)
    path, data = cold[0]                                     # cold: nothing on the disk tier yet
    assert data == files[path] and not cold.files.last_direct
    through_mount = pickle.dumps(data)
    cold.close()
    del cold, data
    gc.collect()                                             # the reader by reference is the next dataset's
    assert cachefs("warmup", str(mnt.path)).returncode == 0
    with PackedDataset(mnt.path) as warm:
        again = warm[0][1]
        assert again == files[path] and warm.files.last_direct   # the cache file, handed over
        directly = pickle.dumps(again)
        calls = []
        read = DirectShards.read
        monkeypatch.setattr(DirectShards, "read", lambda self, *args: calls.append(args) or read(self, *args))
        assert pickle.loads(through_mount) == files[path] and calls == []
        assert pickle.loads(directly) == files[path] and len(calls) == 1
    mnt.umount()


def test_a_corrupt_cache_file_read_directly_falls_back_to_the_mount(s3_server, proxied, mount_factory):
    """A cache file damaged on disk: the loader's crc check catches it, drops the shard's files and
    reads through the mount, whose own check drops the block and fetches it again: right bytes."""
    proxy, bucket, client = proxied
    files = make_files()
    packed_bucket(s3_server, bucket, client, files, "--shard-size", "1M")
    mnt = mount(proxy, bucket, mount_factory).start()
    assert cachefs("warmup", str(mnt.path)).returncode == 0
    damaged = 0
    for path in block_files(mnt.cache_dir):
        with open(path, "r+b") as f:              # one byte in the middle of each block's data
            size = os.fstat(f.fileno()).st_size
            f.seek(size - 4000)
            byte = f.read(1)
            f.seek(size - 4000)
            f.write(bytes([byte[0] ^ 0xFF]))
            damaged += 1
    assert damaged >= 2       # written through the page cache: the daemon's own reads see it too
    with PackedIterableDataset(mnt.path, seed=2) as ds:
        got = dict(iter(ds))
    assert got == files
    status = mnt.status()
    assert status["loader_fds"]["served"] >= 1 and status["corrupt_blocks"] >= 1
    mnt.umount()


def test_modes_come_from_the_index(s3_server, bucket, mount_factory, tmp_path):
    src = tmp_path / "src"
    (src / "bin").mkdir(parents=True)
    (src / "bin/run.sh").write_bytes(b"#!/bin/sh\n")
    (src / "bin/run.sh").chmod(0o750)
    (src / "data.txt").write_bytes(b"x")
    (src / "data.txt").chmod(0o640)
    assert main(["pack", "--quiet", str(src), f"s3://{bucket}/packed", "--endpoint-url", s3_server.endpoint_url]) == 0
    mnt = mount_factory(f"s3://{bucket}/packed", "--endpoint-url", s3_server.endpoint_url).start()
    assert os.stat(mnt / "bin/run.sh").st_mode == 0o100750
    assert os.stat(mnt / "data.txt").st_mode == 0o100640
    assert os.stat(mnt / "bin").st_mode & 0o170000 == 0o040000
    mnt.umount()


def test_a_foreign_manifest_json_is_just_a_file(s3_server, bucket, mount_factory):
    client = s3_client(s3_server.endpoint_url)
    files = {"manifest.json": b'{"images": 3}', "shards/a.txt": b"not a shard", "x.txt": b"x"}
    put_tree(client, bucket, "plain", files)
    mnt = mount_factory(f"s3://{bucket}/plain", "--endpoint-url", s3_server.endpoint_url).start()
    assert tree_of(mnt.path) == files
    mnt.umount()


@pytest.mark.parametrize("damage, code", [("version", PackExit.UNKNOWN_VERSION), ("index", PackExit.CORRUPT)])
def test_a_bad_manifest_or_index_refuses_the_mount(s3_server, bucket, mount_factory, damage, code):
    client = s3_client(s3_server.endpoint_url)
    packed_bucket(s3_server, bucket, client, make_files(n=8))
    manifest = json.loads(client.get_object(Bucket=bucket, Key="packed/manifest.json")["Body"].read())
    if damage == "version":
        client.put_object(Bucket=bucket, Key="packed/manifest.json",
                          Body=json.dumps(manifest | {"version": 99}).encode())
    else:
        client.put_object(Bucket=bucket, Key=f"packed/{manifest['index_files']}", Body=b"PAR1 truncated")
    mnt = mount_factory(f"s3://{bucket}/packed", "--endpoint-url", s3_server.endpoint_url)
    result = mnt.try_start()
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cachefs: error:") and "Traceback" not in result.stderr
    assert ("version 99" in lines[0]) if damage == "version" else ("Parquet" in lines[0])
    assert not is_mounted(mnt.path)


# ---- the read path without a kernel: PackedView over a fake tiers -------------------------------
class FakeTiers:
    """The shard's bytes as the tiers would serve them; ``heal`` fixes them when a block is evicted
    (the refetch from the store then brings the right bytes)."""

    block_size = 1024
    readahead_size = 4096

    def __init__(self, shard: bytes, heal: bool) -> None:
        self.shard = bytearray(shard)
        self.good = bytes(shard)
        self.heal = heal
        self.evicted: set = set()

    def evict_range(self, f, offset, length) -> None:
        bs = self.block_size
        self.evicted.update(range(offset // bs, (offset + max(length, 1) - 1) // bs + 1))
        if self.heal:
            self.shard[:] = self.good

    def blocks_ahead(self, stream, f, stop):
        return stream.blocks_ahead(stop, f.size, self.block_size, self.readahead_size)

    def continue_stream(self, stream, offset) -> None:
        stream.next_offset = offset

    async def read(self, f, offset, size, stream=None) -> bytes:
        return bytes(self.shard[offset:offset + size])


def packed_view(files: dict[str, bytes], heal: bool, corrupt: str):
    from cachefs.metrics import Metrics
    from cachefs.packed.view import PackedView
    from cachefs.packfmt import FILES_SCHEMA, PackedIndex
    from cachefs.packfmt.shard import ShardBuilder
    builder = ShardBuilder(0)
    shard = b"".join(builder.add(p, files[p], mtime=1.0, mode=0o100755, etag="e") for p in sorted(files))
    index = PackedIndex(pa.Table.from_pylist(builder.rows, FILES_SCHEMA),
                        pa.Table.from_pylist([builder.shard_row("shard-etag")], SHARDS_SCHEMA))
    tiers = FakeTiers(shard, heal)
    row = next(r for r in builder.rows if r["path"] == corrupt)
    tiers.shard[row["data_offset"] + row["data_length"] - 1] ^= 1
    metrics = Metrics()
    return PackedView(None, None, index, tiers, metrics), tiers, metrics


def run(fn, *args):
    import trio
    return trio.run(fn, *args)


@pytest.mark.allow_warnings
@pytest.mark.parametrize("heal", [True, False])
def test_a_small_record_is_checked_whole_and_refetched_once(heal):
    from cachefs.packfmt import CorruptRecord
    from cachefs.tiers.cache import Stream
    files = {"a.bin": bytes(range(256)) * 3, "b.bin": b"b" * 2000, "c.bin": b"c" * 10}
    view, tiers, metrics = packed_view(files, heal, corrupt="b.bin")
    ref = view.ref("b.bin", 2000, "g0")
    if heal:       # the store had the right bytes: the refetch serves them, the mismatch is counted
        assert run(view.read, ref, Stream(), 100, 50) == files["b.bin"][100:150]
    else:
        with pytest.raises(CorruptRecord) as info:
            run(view.read, ref, Stream(), 100, 50)
        assert info.value.errno == errno.EIO
    assert metrics.counter_value("cachefs_packed_crc_errors_total") == 1
    assert tiers.evicted == set(range(ref.offset // 1024, (ref.offset + ref.size - 1) // 1024 + 1))
    assert run(view.read, view.ref("c.bin", 10, "g0"), Stream(), 0, 4096) == b"c" * 10
    assert run(view.preload, view.ref("a.bin", 768, "g0"), Stream()) == files["a.bin"]


def test_a_listed_file_carries_its_index_row_to_lookup_and_open(monkeypatch):
    """Lookup (the mode) and open (the ref) take the row the listing found: no index search per
    file. A file known only by path is searched for; the raw layout has no row."""
    from cachefs.namespace.nodes import FsError
    from cachefs.store import ObjectInfo
    files = {"a.bin": b"a" * 10, "b.bin": b"b" * 20, "c.bin": b"c" * 30}
    view, _, _ = packed_view(files, heal=False, corrupt="a.bin")
    by_path = {p: view.ref(p, len(d), "g0") for p, d in files.items()}
    listed = view.list_dir("").files
    monkeypatch.setattr(view.index, "find", lambda path: pytest.fail(f"searched the index for {path}"))
    assert sorted(i.path for i in listed) == sorted(files)
    for info in listed:
        row, mode = view.locate(info.path, info)
        assert (row, mode) == (by_path[info.path].row, 0o100755)
        assert view.ref(info.path, info.size, info.etag, row) == by_path[info.path]
    assert view.locate(".cachefs-packed/manifest.json", None) == (-1, None)
    monkeypatch.undo()
    assert view.locate("b.bin", ObjectInfo("b.bin", 20, 1.0, "g0")) == (by_path["b.bin"].row, 0o100755)
    with pytest.raises(FsError):
        view.locate("gone.bin", None)


@pytest.mark.allow_warnings
def test_records_are_checked_when_their_block_comes_from_the_store(monkeypatch):
    """A block that arrives from the store has every record wholly inside it checked: a read of one
    that passed computes no crc of its own. A record across two blocks, one that failed, and one in
    a block this mount never fetched (a cache file from before it) are checked when read."""
    from cachefs.packed import view as packed
    from cachefs.packfmt import CorruptRecord
    from cachefs.tiers.cache import Stream
    files = {f"f{i}.bin": bytes([i]) * 300 for i in range(8)}
    view, tiers, metrics = packed_view(files, heal=False, corrupt="f6.bin")
    crcs = []
    real = packed._crc32c
    monkeypatch.setattr(packed, "_crc32c", lambda data, value=0: crcs.append(len(data)) or real(data, value))
    refs = {p: view.ref(p, 300, "g0") for p in files}
    shard = view.shard_version(0)
    inside = [p for p, r in refs.items() if r.offset // 1024 == (r.offset + 299) // 1024]
    across = [p for p in refs if p not in inside]
    assert inside and across and "f6.bin" in inside
    for index in range(-(-shard.size // 1024)):          # every block "arrives", as a GET brings it
        view._check_block(shard, index * 1024, bytes(tiers.shard[index * 1024:(index + 1) * 1024]))
    assert len(crcs) == len(inside)                       # one check per record wholly in a block
    crcs.clear()
    for p in inside:
        if p != "f6.bin":
            assert run(view.preload, refs[p], Stream()) == files[p]
    assert crcs == []                                     # checked on arrival: not again when read
    for p in across:
        assert run(view.preload, refs[p], Stream()) == files[p]
    assert crcs == [300] * len(across)
    with pytest.raises(CorruptRecord):                    # failed on arrival: checked, refused
        run(view.read, refs["f6.bin"], Stream(), 0, 300)
    assert metrics.counter_value("cachefs_packed_crc_errors_total") == 1
    other, _, _ = packed_view(files, heal=False, corrupt="f6.bin")    # a mount that fetched nothing
    crcs.clear()
    assert run(other.preload, other.ref("f1.bin", 300, "g0"), Stream()) == files["f1.bin"]
    assert crcs == [300]
    view._check_block(packed.FileVersion(shard.path, "another-etag", shard.size), 0, bytes(1024))
    assert view._checked[refs["f1.bin"].row]               # a block of another version: ignored


@pytest.mark.allow_warnings
@pytest.mark.parametrize("corrupt", ["big.bin", "a.bin"])
def test_a_large_record_is_checked_as_it_is_read_in_order(monkeypatch, corrupt):
    from cachefs.packed import view as packed
    from cachefs.packfmt import CorruptRecord
    from cachefs.tiers.cache import Stream
    monkeypatch.setattr(packed, "VERIFY_WHOLE_MAX", 1000)
    big = random.Random(1).randbytes(5000)
    view, tiers, metrics = packed_view({"a.bin": b"a" * 100, "big.bin": big}, heal=False, corrupt=corrupt)
    ref = view.ref("big.bin", len(big), "g0")
    got = [run(view.read, ref, Stream(), offset, 1024) for offset in range(0, 4096, 1024)]
    assert b"".join(got) == big[:4096]                      # served as read: the crc needs the end
    assert run(view.read, ref, Stream(), 100, 10) == big[100:110]   # a reread inside: not checked again
    if corrupt == "big.bin":
        with pytest.raises(CorruptRecord):
            run(view.read, ref, Stream(), 4096, 1024)       # the read that completes it fails
        assert metrics.counter_value("cachefs_packed_crc_errors_total") == 1 and tiers.evicted
    else:
        assert run(view.read, ref, Stream(), 4096, 1024) == big[4096:]
        assert ref.verified and metrics.counter_value("cachefs_packed_crc_errors_total") == 0


def test_a_file_of_more_than_two_blocks_is_read_with_its_handles_stream(monkeypatch):
    """A large packed file (a checkpoint in a shard of its own) is read ahead, and its blocks
    dropped behind, as an unpacked file is: with its handle's stream. Smaller files share the
    shard's stream, which keeps its blocks for the files beside them."""
    from cachefs.packed import view as packed
    from cachefs.tiers.cache import Stream
    monkeypatch.setattr(packed, "VERIFY_WHOLE_MAX", 1000)
    files = {"a.bin": b"a" * 100, "big.bin": random.Random(2).randbytes(5000), "c.bin": b"c" * 2000}
    view, tiers, _ = packed_view(files, heal=False, corrupt="a.bin")
    streams = []
    real = tiers.read
    monkeypatch.setattr(tiers, "read", lambda f, offset, size, stream=None: streams.append(stream) or real(
        f, offset, size, stream))
    mine = Stream()
    big = view.ref("big.bin", 5000, "g0")
    assert b"".join(run(view.read, big, mine, offset, 1024) for offset in range(0, 5000, 1024)) == files["big.bin"]
    assert streams and all(s is mine for s in streams)
    streams.clear()
    small = Stream()
    assert run(view.read, view.ref("c.bin", 2000, "g0"), small, 0, 2000) == files["c.bin"]
    assert streams and all(s is not small and (s is None or not s.drop_behind) for s in streams)
