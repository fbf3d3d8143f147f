"""Store writes against moto and memory://: put, multipart (visible only when complete),
delete, copy and directory markers, with the same error mapping as reads."""

import random

import pytest
from memory_stores import MemoryBucket

from cachefs.errors import NoSuchKey
from cachefs.metrics import Metrics
from cachefs.store.fsspec_store import FsspecStore
from cachefs.store.s3.store import S3Options, S3Store
from testing.s3 import s3_client

MIB = 1 << 20


@pytest.fixture
def s3(s3_server, bucket):
    store = S3Store(bucket, "root", metrics=Metrics(), options=S3Options(endpoint_url=s3_server.endpoint_url))
    yield store, s3_client(s3_server.endpoint_url), bucket
    store.close()


def test_put_head_get_delete(s3):
    store, client, bucket = s3
    info = store.put("a/b.txt", b"hello")
    assert info.size == 5 and info.etag
    assert store.head("a/b.txt").etag == info.etag
    assert store.get("a/b.txt", 0, 5, info.etag, 5) == b"hello"
    store.delete("a/b.txt")
    store.delete("a/b.txt")                  # deleting a missing object succeeds
    with pytest.raises(NoSuchKey):
        store.head("a/b.txt")


def test_multipart_object_appears_only_when_complete(s3):
    store, client, bucket = s3
    data = random.Random(1).randbytes(11 * MIB)
    upload = store.start_upload("big.bin")
    parts = [(1, store.upload_part("big.bin", upload, 1, data[:5 * MIB])),
             (2, store.upload_part("big.bin", upload, 2, data[5 * MIB:10 * MIB]))]
    assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix="root/")
    parts.append((3, store.upload_part("big.bin", upload, 3, data[10 * MIB:])))
    info = store.finish_upload("big.bin", upload, parts, len(data))
    assert info.size == len(data) and info.etag.endswith("-3")
    assert client.get_object(Bucket=bucket, Key="root/big.bin")["Body"].read() == data


def test_aborted_upload_leaves_nothing(s3):
    store, client, bucket = s3
    upload = store.start_upload("gone.bin")
    store.upload_part("gone.bin", upload, 1, b"x" * (5 * MIB))
    store.abort_upload("gone.bin", upload)
    store.abort_upload("gone.bin", upload)   # twice is fine
    assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix="root/")
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_copy_and_directory_markers(s3):
    store, client, bucket = s3
    store.put("src", b"payload")
    assert store.copy("src", "dst").size == 7
    store.make_dir("d/e")
    listing = store.list_dir("d/")
    assert listing.dirs == ["e"]
    store.remove_dir("d/e")
    assert store.list_dir("d/").dirs == []


def test_fsspec_store_writes():
    bucket = MemoryBucket()
    try:
        store = FsspecStore(bucket.url, metrics=Metrics())
        assert store.put("x/y", b"abc").size == 3
        upload = store.start_upload("m")
        parts = [(2, store.upload_part("m", upload, 2, b"world")), (1, store.upload_part("m", upload, 1, b"hello "))]
        info = store.finish_upload("m", upload, parts, 11)
        assert store.get("m", 0, 11, info.etag, 11) == b"hello world"
        assert store.copy("m", "n").size == 11
        store.delete("m")
        store.delete("m")
        assert sorted(i.path for i in store.list_all()) == ["n", "x/y"]
    finally:
        bucket.remove()


def test_puts_and_parts_carry_a_signed_sha256_of_the_body_not_md5(s3):
    """Every request of an upload goes through our transport, and each body is hashed once
    (SHA-256, signed: AWS and Ceph RGW refuse a body that does not match it) instead of
    Content-MD5 plus the payload hash; the completion's XML body too."""
    import hashlib
    store, client, bucket = s3
    sent = []
    urlopen = store._requests._pool.urlopen

    def spy(method, url, body=None, headers=None, **kwargs):
        sent.append((method, url, body, {k.lower(): v for k, v in headers.items()}))
        return urlopen(method, url, body=body, headers=headers, **kwargs)

    store._requests._pool.urlopen = spy
    data = random.Random(4).randbytes(6 * MIB)
    store.put("odd key+&=%.txt", b"small")
    upload = store.start_upload("odd key+&=%.bin")
    parts = [(1, store.upload_part("odd key+&=%.bin", upload, 1, data[:5 * MIB])),
             (2, store.upload_part("odd key+&=%.bin", upload, 2, data[5 * MIB:]))]
    store.finish_upload("odd key+&=%.bin", upload, parts, len(data))
    assert [m for m, *_ in sent] == ["PUT", "POST", "PUT", "PUT", "POST", "HEAD"]
    assert "partNumber=2&uploadId=" in sent[3][1] and "?uploads=" in sent[1][1]
    for _method, _url, body, headers in sent:
        assert headers["x-amz-content-sha256"] == hashlib.sha256(body or b"").hexdigest()
        assert "content-md5" not in headers and headers["authorization"].startswith("AWS4-HMAC-SHA256 ")
    assert b"<PartNumber>2</PartNumber>" in sent[4][2]
    assert client.get_object(Bucket=bucket, Key="root/odd key+&=%.bin")["Body"].read() == data
    assert client.get_object(Bucket=bucket, Key="root/odd key+&=%.txt")["Body"].read() == b"small"


def test_part_size_grows_so_no_upload_needs_more_than_10000_parts():
    from cachefs.writeback.policy import MAX_PARTS, part_size_for
    mib = 1 << 20
    assert part_size_for(100 * mib, 16 * mib) == 16 * mib
    assert part_size_for(20_000, 1000) == 1000                      # small configured parts stay
    for size in (MAX_PARTS * 16 * mib, MAX_PARTS * 16 * mib + 1, 200 << 30, 5 << 40):
        part = part_size_for(size, 16 * mib)
        assert part % mib == 0 and part >= 16 * mib
        assert -(-size // part) <= MAX_PARTS, size
