"""S3Store against moto's server on loopback, plus its error mapping and GET checks in isolation."""

import io
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError, ResponseStreamingError

from cachefs.errors import AccessDenied, BadResponse, NoSuchBucket, NoSuchKey, StoreError, Unreachable, VersionChanged
from cachefs.metrics import Metrics
from cachefs.store.s3.answer import ShortBody
from cachefs.store.s3.store import S3Options, S3Store, is_temp_failure, map_error
from testing.s3 import free_port, s3_client

BLOCK = 64 * 1024


@pytest.fixture
def client(s3_server):
    return s3_client(s3_server.endpoint_url)


@pytest.fixture
def metrics():
    return Metrics()


@pytest.fixture(params=[True, False], ids=["lean-requests", "boto3-get"])
def make_store(s3_server, metrics, request):
    """Stores on the moto server, once with the lean GET path (requests) and once with boto3's."""
    stores = []

    def make(bucket: str, prefix: str = "", **options) -> S3Store:
        options.setdefault("lean_requests", request.param)
        store = S3Store(bucket, prefix, metrics=metrics,
                        options=S3Options(endpoint_url=s3_server.endpoint_url, **options))
        stores.append(store)
        return store
    yield make
    for store in stores:
        store.close()


def put_many(client, bucket: str, keys: list[str], body: bytes = b"x") -> None:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda key: client.put_object(Bucket=bucket, Key=key, Body=body), keys))


def requests(metrics: Metrics, op: str, status: str) -> float:
    return metrics.counter_value("cachefs_store_requests_total", op=op, status=status)


# --- listing --------------------------------------------------------------------------------------

BIG_FILES = [f"big/f{i:04d}" for i in range(2500)]
BIG_OTHERS = ["big/", "big/empty/", "big/sub/x", "big/sub/deeper/y", "big/./dot", "big//double", "top"]


@pytest.fixture(scope="module")
def big_bucket(s3_server):
    """2,500 objects in one directory (moto pages at 1,000) plus nested dirs and markers; built once."""
    name = f"test-big-{uuid.uuid4().hex[:12]}"
    client = s3_client(s3_server.endpoint_url)
    client.create_bucket(Bucket=name)
    put_many(client, name, BIG_FILES + BIG_OTHERS)
    return name


def test_list_dir_pages_through_2500_objects_with_dirs_and_markers(big_bucket, make_store, metrics):
    listing = make_store(big_bucket).list_dir("big/")
    assert sorted(f.path for f in listing.files) == BIG_FILES
    assert sorted(listing.dirs) == ["empty", "sub"]
    assert requests(metrics, "list", "200") == 3
    info = listing.files[0]
    assert info.size == 1 and len(info.etag) == 32 and '"' not in info.etag
    assert abs(info.mtime - time.time()) < 600


def test_list_all_is_flat_paginated_and_skips_markers(big_bucket, make_store, metrics):
    paths = [info.path for info in make_store(big_bucket).list_all("big/")]
    assert sorted(paths) == sorted(BIG_FILES + ["big/sub/x", "big/sub/deeper/y", "big/./dot", "big//double"])
    assert requests(metrics, "list", "200") == 3


def test_list_tree_gives_each_directory_what_list_dir_gives_it(big_bucket, make_store, metrics):
    """One recursive listing yields every reachable directory (markers, nesting and the names a
    lookup cannot reach included) with exactly ``list_dir``'s listing, from 3 pages."""
    store = make_store(big_bucket)
    tree = dict(store.list_tree("", 1 << 20))
    assert requests(metrics, "list", "200") == 3
    assert sorted(tree) == ["", "big/", "big/empty/", "big/sub/", "big/sub/deeper/"]
    for prefix, listing in tree.items():
        direct = store.list_dir(prefix)
        assert sorted(listing.files, key=str) == sorted(direct.files, key=str), prefix
        assert sorted(listing.dirs) == sorted(direct.dirs), prefix
    assert sorted(tree[""].dirs) == ["big"] and [f.path for f in tree[""].files] == ["top"]


def test_list_tree_stops_at_its_limit_and_yields_only_complete_directories(big_bucket, make_store):
    store = make_store(big_bucket)
    tree = dict(store.list_tree("", 1000))       # "big/" is still open after 1,000 keys
    assert sorted(tree) == ["big/empty/"]
    assert tree["big/empty/"] == store.list_dir("big/empty/")


def test_list_tree_refuses_keys_out_of_order(make_store, bucket):
    """Completeness rests on sorted keys: a server that breaks the order is an error, not a listing
    that silently misses files."""
    import datetime
    store = make_store(bucket)
    now = datetime.datetime.now(datetime.UTC)
    page = {"Contents": [{"Key": k, "Size": 1, "ETag": '"e"', "LastModified": now} for k in ("b/x", "a/y")]}
    store._pages = lambda full, delimiter: iter([page])
    with pytest.raises(BadResponse, match="out of order"):
        dict(store.list_tree("", 100))


ODD_KEYS = ["odd/a b.jpg", "odd/plus+sign", "odd/100%.txt", "odd/été/ünï.bin", "odd/q?x=1&y", "odd/tab\tname",
            "odd/amp&lt;", "odd/sub dir/x"]


def test_listing_keeps_odd_keys_exact_and_same_as_boto3(s3_server, client, bucket, metrics):
    """The lean ListObjectsV2 path (URL-encoded keys, ElementTree, fromisoformat) gives what
    boto3's does, field by field, for keys with spaces, '+', '%', non-ASCII and XML specials."""
    put_many(client, bucket, ODD_KEYS, b"12345")
    lean = S3Store(bucket, "", metrics=metrics, options=S3Options(endpoint_url=s3_server.endpoint_url))
    plain = S3Store(bucket, "", metrics=Metrics(),
                    options=S3Options(endpoint_url=s3_server.endpoint_url, lean_requests=False))
    try:
        assert lean._requests is not None and plain._requests is None
        assert sorted(lean.list_all("odd/"), key=str) == sorted(plain.list_all("odd/"), key=str)
        assert sorted(i.path for i in lean.list_all("odd/")) == sorted(ODD_KEYS)
        assert lean.list_dir("odd/") == plain.list_dir("odd/")
        assert sorted(lean.list_dir("odd/").dirs) == ["sub dir", "été"]
        info = lean.list_dir("odd/").files[0]
        assert info.size == 5 and len(info.etag) == 32 and abs(info.mtime - time.time()) < 600
        assert lean.list_dir("odd/sub dir/").files[0].path == "odd/sub dir/x"
    finally:
        lean.close()
        plain.close()


def test_list_page_parser_reads_s3_xml_without_encoding():
    from cachefs.store.s3.requests import parse_list_page
    body = b"""<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name><Prefix>p/</Prefix>
<KeyCount>2</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>true</IsTruncated>
<NextContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=</NextContinuationToken>
<Contents><Key>p/a+b &amp; c</Key><LastModified>2026-11-22T09:00:01.000Z</LastModified>
<ETag>&quot;d41d8cd98f00b204e9800998ecf8427e&quot;</ETag><Size>0</Size><StorageClass>STANDARD</StorageClass></Contents>
<CommonPrefixes><Prefix>p/sub/</Prefix></CommonPrefixes></ListBucketResult>"""
    page = parse_list_page(body)
    assert page["IsTruncated"] is True and page["NextContinuationToken"].endswith("bOwM=")
    [obj] = page["Contents"]
    assert obj["Key"] == "p/a+b & c"            # no EncodingType: taken as it is, '+' kept
    assert obj["ETag"] == '"d41d8cd98f00b204e9800998ecf8427e"' and obj["Size"] == 0
    assert obj["LastModified"].timestamp() == 1795338001.0
    assert page["CommonPrefixes"] == [{"Prefix": "p/sub/"}]


def test_a_malformed_list_answer_is_an_error_not_an_empty_directory():
    import xml.etree.ElementTree as ET

    from cachefs.store.s3.requests import parse_list_page
    with pytest.raises(ET.ParseError):
        parse_list_page(b"<ListBucketResult><Contents><Key>k</Key></Contents")     # cut short
    with pytest.raises(ValueError):
        parse_list_page(b"<ListBucketResult><Contents><Key>k</Key><Size>x</Size></Contents></ListBucketResult>")


def test_list_dir_root_and_absent_prefix(client, bucket, make_store):
    put_many(client, bucket, ["a", "d/b"])
    store = make_store(bucket)
    root = store.list_dir("")
    assert [f.path for f in root.files] == ["a"] and root.dirs == ["d"]
    assert store.list_dir("nothing/") == type(root)()


def test_mount_prefix_makes_paths_relative(client, bucket, make_store):
    put_many(client, bucket, ["data/train/a", "data/train/sub/b", "data/other", "elsewhere"], b"hello")
    store = make_store(bucket, "data/train")
    store.check()
    listing = store.list_dir("")
    assert [f.path for f in listing.files] == ["a"] and listing.dirs == ["sub"]
    assert [f.path for f in store.list_dir("sub/").files] == ["sub/b"]
    assert sorted(i.path for i in store.list_all()) == ["a", "sub/b"]
    info = store.head("sub/b")
    assert (info.path, info.size) == ("sub/b", 5)
    assert store.get("sub/b", 1, 3, info.etag, 5) == b"el"


# --- get ------------------------------------------------------------------------------------------

@pytest.fixture
def blob(client, bucket):
    data = os.urandom(3 * BLOCK + 1234)
    client.put_object(Bucket=bucket, Key="blob", Body=data)
    return data


def test_get_whole_range_and_last_partial_block(bucket, make_store, metrics, blob):
    store = make_store(bucket)
    info = store.head("blob")
    assert info.size == len(blob)
    assert store.get("blob", 0, info.size, info.etag, info.size) == blob
    assert store.get("blob", BLOCK, 2 * BLOCK, info.etag, info.size) == blob[BLOCK:2 * BLOCK]
    assert store.get("blob", 3 * BLOCK, info.size, info.etag, info.size) == blob[3 * BLOCK:]
    assert store.get("blob", 5, 5, info.etag, info.size) == b""
    assert requests(metrics, "get", "200") == 1
    assert requests(metrics, "get", "206") == 2
    assert requests(metrics, "head", "200") == 1
    assert metrics.counter_value("cachefs_store_read_bytes_total") == len(blob) + BLOCK + 1234
    assert metrics.counter_value("cachefs_store_request_seconds_count", op="get") == 3


def test_get_rejects_a_range_outside_the_object(bucket, make_store, blob):
    store = make_store(bucket)
    info = store.head("blob")
    with pytest.raises(ValueError):
        store.get("blob", 10, info.size + 1, info.etag, info.size)


@pytest.mark.parametrize("start, end", [(0, None), (10, 20)], ids=["whole", "range"])
def test_get_with_old_etag_after_overwrite_is_version_changed(client, bucket, make_store, metrics, blob,
                                                              start, end):
    store = make_store(bucket)
    old = store.head("blob")
    client.put_object(Bucket=bucket, Key="blob", Body=blob[::-1])
    with pytest.raises(VersionChanged, match="get s3://.*/blob"):
        store.get("blob", start, end or old.size, old.etag, old.size)
    assert requests(metrics, "get", "412") == 1        # not retried
    new = store.head("blob")
    assert store.get("blob", 0, 4, new.etag, new.size) == blob[::-1][:4]


def test_missing_key_is_no_such_key(bucket, make_store, metrics):
    store = make_store(bucket)
    with pytest.raises(NoSuchKey, match=f"head s3://{bucket}/nope"):
        store.head("nope")
    with pytest.raises(NoSuchKey, match=f"get s3://{bucket}/nope"):
        store.get("nope", 0, 10, "0123", 100)
    assert requests(metrics, "head", "404") == 1
    assert requests(metrics, "get", "404") == 1


# --- check ----------------------------------------------------------------------------------------

def test_check_missing_bucket_and_prefix(client, bucket, make_store):
    with pytest.raises(NoSuchBucket, match="s3://no-such-bucket-here"):
        make_store("no-such-bucket-here").check()
    make_store(bucket).check()                      # an empty bucket is fine without a prefix
    with pytest.raises(NoSuchKey, match=f"no objects under s3://{bucket}/data"):
        make_store(bucket, "data").check()
    client.put_object(Bucket=bucket, Key="data/x", Body=b"1")
    make_store(bucket, "data").check()


def test_unreachable_endpoint_fails_fast_naming_the_object(metrics):
    endpoint = f"http://127.0.0.1:{free_port()}"
    store = S3Store("bkt", "root", metrics=metrics,
                    options=S3Options(endpoint_url=endpoint, connect_timeout=0.5, read_timeout=0.5, max_attempts=2))
    started = time.monotonic()
    with pytest.raises(Unreachable, match="get s3://bkt/root/some/key") as info:
        store.get("some/key", 0, 10, "etag", 100)
    assert time.monotonic() - started < 5           # refusals are retried for min(5 s, read timeout) only
    assert "testing" not in str(info.value)         # no credentials in messages
    retries = metrics.counter_value("cachefs_store_retries_total", op="get")
    assert retries >= 1 and requests(metrics, "get", "error") == retries + 1
    store.close()


def test_identity_names_endpoint_bucket_and_prefix(s3_server, make_store):
    assert make_store("b1", "x/y/").identity == f"s3|{s3_server.endpoint_url}|b1|x/y"
    assert S3Store("b1", "", metrics=Metrics()).identity == "s3|aws|b1|"


# --- retries and GET checks with a faked client ----------------------------------------------------

def client_error(code: str, status: int, op: str = "GetObject") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, op)


def answer(body: bytes, status: int = 206, etag: str = "e1", content_range: str | None = None) -> dict:
    response = {"ResponseMetadata": {"HTTPStatusCode": status}, "ETag": f'"{etag}"', "Body": io.BytesIO(body)}
    if content_range:
        response["ContentRange"] = content_range
    return response


class FakeGet:
    """Stands in for client.get_object: plays back answers (dicts) or raises errors, in turn."""

    def __init__(self, *outcomes) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[dict] = []

    def __call__(self, **kwargs) -> dict:
        self.calls.append(kwargs)
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


@pytest.fixture
def fake_store(metrics):
    # these tests stub the boto3 client's get_object: the botocore GET path
    store = S3Store("bkt", "", metrics=metrics, options=S3Options(endpoint_url="http://127.0.0.1:9", lean_requests=False))
    yield store
    store.close()


def test_get_sends_if_match_and_range(fake_store):
    fake_store._client.get_object = fake = FakeGet(answer(b"abc", content_range="bytes 10-12/100"))
    assert fake_store.get("k", 10, 13, "e1", 100) == b"abc"
    assert fake.calls == [{"Bucket": "bkt", "Key": "k", "IfMatch": '"e1"', "Range": "bytes=10-12"}]


def test_get_retries_503_and_a_reset_mid_body(fake_store, metrics):
    reset = answer(b"")
    reset["Body"] = BrokenBody()
    fake_store._client.get_object = fake = FakeGet(
        client_error("SlowDown", 503), reset, answer(b"abc", content_range="bytes 0-2/100"))
    assert fake_store.get("k", 0, 3, "e1", 100) == b"abc"
    assert len(fake.calls) == 3
    assert requests(metrics, "get", "503") == 1
    assert requests(metrics, "get", "error") == 1
    assert metrics.counter_value("cachefs_store_retries_total", op="get") == 2


class BrokenBody(io.BytesIO):
    def read(self, *args):
        raise ResponseStreamingError(error="connection reset by peer")


@pytest.mark.allow_warnings
def test_server_ignoring_range_is_sliced(fake_store, metrics, caplog):
    fake_store._client.get_object = FakeGet(*(answer(b"0123456789", status=200) for _ in range(2)))
    assert fake_store.get("k", 2, 5, "e1", 10) == b"234"
    assert fake_store.get("k", 5, 9, "e1", 10) == b"5678"
    assert metrics.counter_value("cachefs_store_range_fallbacks_total", kind="whole_object") == 2
    assert [r.levelname for r in caplog.records] == ["WARNING"]           # once per store


class CountingBody(io.BytesIO):
    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.taken = 0

    def read(self, size=-1):
        data = super().read(size)
        self.taken += len(data)
        return data


@pytest.mark.allow_warnings
def test_boto3_path_reads_a_whole_big_object_only_up_to_the_range(fake_store, metrics, monkeypatch):
    import cachefs.store.s3.answer
    monkeypatch.setattr(cachefs.store.s3.answer, "MAX_WASTE", 100)
    data = bytes(range(256)) * 40
    response = answer(b"", status=200)
    response["Body"] = body = CountingBody(data)
    response["ContentLength"] = len(data)
    fake_store._client.get_object = FakeGet(response)
    assert fake_store.get("k", 1000, 1500, "e1", len(data)) == data[1000:1500]
    assert body.taken == 1500 and body.closed
    assert metrics.counter_value("cachefs_store_range_fallbacks_total", kind="whole_object") == 1


@pytest.mark.parametrize("etag", ['e1"\r\nX-Injected: 1', "e1\n", "e\x00"])
def test_an_etag_with_control_characters_never_reaches_the_wire(fake_store, etag):
    fake_store._client.get_object = fake = FakeGet()
    with pytest.raises(BadResponse, match="control character"):
        fake_store.get("k", 2, 5, etag, 10)
    assert fake.calls == []


@pytest.mark.parametrize("response, error", [
    (answer(b"abc", status=200, etag=""), BadResponse),                 # 200 of the length, nothing proves it
    (answer(b"abc", content_range="bytes 0-2/10"), BadResponse),         # wrong range
    (answer(b"abc"), BadResponse),                                       # 206 without Content-Range
    (answer(b"abc", content_range="bytes 2-4/11"), VersionChanged),      # size moved
    (answer(b"abc", content_range="bytes 2-4/10", etag="e2"), VersionChanged),   # If-Match ignored
])
def test_get_detects_wrong_answers(fake_store, response, error):
    body = response["Body"].read()           # a wrong range is retried, then refused
    fake_store._client.get_object = FakeGet(*({**response, "Body": io.BytesIO(body)} for _ in range(5)))
    with pytest.raises(error, match="get s3://bkt/k"):
        fake_store.get("k", 2, 5, "e1", 10)


def test_short_body_is_retried_then_bad_response(fake_store, metrics):
    fake_store._client.get_object = fake = FakeGet(*(answer(b"ab", content_range="bytes 2-4/10") for _ in range(5)))
    with pytest.raises(BadResponse, match="got 2 bytes"):
        fake_store.get("k", 2, 5, "e1", 10)
    assert len(fake.calls) == 5
    assert metrics.counter_value("cachefs_store_retries_total", op="get") == 4


# --- error mapping (moto accepts any credentials, so denial is tested here) ----------------------------

URL = "s3://bkt/some/key"


@pytest.mark.parametrize("code, status, expected", [
    ("NoSuchBucket", 404, NoSuchBucket),
    ("NoSuchKey", 404, NoSuchKey),
    ("404", 404, NoSuchKey),
    ("AccessDenied", 403, AccessDenied),
    ("403", 403, AccessDenied),
    ("InvalidAccessKeyId", 403, AccessDenied),
    ("SignatureDoesNotMatch", 403, AccessDenied),
    ("ExpiredToken", 400, AccessDenied),
    ("PreconditionFailed", 412, VersionChanged),
    ("412", 412, VersionChanged),
    ("SlowDown", 503, Unreachable),
    ("InternalError", 500, Unreachable),
    ("ServiceUnavailable", 503, Unreachable),
    ("RequestTimeout", 400, Unreachable),
    ("Throttling", 400, Unreachable),
    ("502", 502, Unreachable),
    ("504", 504, Unreachable),
    ("InvalidArgument", 400, StoreError),
])
def test_client_errors_map_to_the_vocabulary(code, status, expected):
    error = map_error(client_error(code, status), op="get", url=URL)
    assert type(error) is expected
    assert str(error).startswith(f"get {URL}")


@pytest.mark.parametrize("code, status, temporary", [
    ("SlowDown", 503, True), ("InternalError", 500, True), ("RequestTimeout", 400, True),
    ("Throttling", 400, True), ("AccessDenied", 403, False), ("PreconditionFailed", 412, False),
    ("NoSuchKey", 404, False), ("ExpiredToken", 400, False),
])
def test_which_client_errors_are_retried(code, status, temporary):
    assert is_temp_failure(client_error(code, status)) is temporary


def test_head_bucket_404_maps_to_no_such_bucket():
    error = map_error(client_error("404", 404, "HeadBucket"), op="head_bucket", url="s3://bkt/", missing=NoSuchBucket)
    assert isinstance(error, NoSuchBucket)


def test_connection_and_credential_errors_map():
    refused = EndpointConnectionError(endpoint_url="http://127.0.0.1:1/bkt/some/key")
    assert is_temp_failure(refused) and is_temp_failure(ShortBody("x"))
    assert isinstance(map_error(refused, op="get", url=URL), Unreachable)
    denied = map_error(NoCredentialsError(), op="head", url=URL)
    assert isinstance(denied, AccessDenied) and str(denied).startswith(f"head {URL}")
    assert not is_temp_failure(NoCredentialsError())


def test_local_server_stops_by_its_own_pid():
    from testing.s3 import LocalS3Server
    with LocalS3Server() as server:
        proc = server._proc
        s3_client(server.endpoint_url).list_buckets()
    assert proc.poll() is not None
    with pytest.raises(EndpointConnectionError):
        s3_client(server.endpoint_url).list_buckets()
