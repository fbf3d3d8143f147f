"""S3Store against moto's server on loopback, against a scripted HTTP server for answers moto never
gives, plus its error mapping in isolation."""

import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from botocore.exceptions import EndpointConnectionError

from cachefs.errors import AccessDenied, BadResponse, NoSuchBucket, NoSuchKey, StoreError, Unreachable, VersionChanged
from cachefs.metrics import Metrics
from cachefs.store.s3.answer import S3Error, ShortBody
from cachefs.store.s3.sigv4 import NoCredentials
from cachefs.store.s3.store import S3Options, S3Store, is_temp_failure, map_error
from testing.s3 import free_port, s3_client

BLOCK = 64 * 1024


@pytest.fixture
def client(s3_server):
    return s3_client(s3_server.endpoint_url)


@pytest.fixture
def metrics():
    return Metrics()


@pytest.fixture(params=[True, False], ids=["trio-get", "threaded-get"])
def make_store(s3_server, metrics, request):
    """Stores on the moto server, once with GETs as trio tasks and once from worker threads."""
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
    from cachefs.store.s3.requests import Listed, Page
    store = make_store(bucket)
    page = Page([Listed(k, 1, time.time(), "e") for k in ("b/x", "a/y")])
    store._pages = lambda full, delimiter: iter([page])
    with pytest.raises(BadResponse, match="out of order"):
        dict(store.list_tree("", 100))


ODD_KEYS = ["odd/a b.jpg", "odd/plus+sign", "odd/100%.txt", "odd/été/ünï.bin", "odd/q?x=1&y", "odd/tab\tname",
            "odd/amp&lt;", "odd/sub dir/x"]


def test_listing_keeps_odd_keys_exact_and_same_as_boto3(s3_server, client, bucket, metrics):
    """Our ListObjectsV2 (URL-encoded keys, ElementTree, fromisoformat) gives what boto3's gives
    (the reference), field by field, for keys with spaces, '+', '%', non-ASCII and XML specials."""
    put_many(client, bucket, ODD_KEYS, b"12345")
    store = S3Store(bucket, "", metrics=metrics, options=S3Options(endpoint_url=s3_server.endpoint_url))
    try:
        reference = client.list_objects_v2(Bucket=bucket, Prefix="odd/")["Contents"]
        expected = sorted((o["Key"], o["Size"], o["ETag"].strip('"'), o["LastModified"].timestamp())
                          for o in reference)
        assert sorted((i.path, i.size, i.etag, i.mtime) for i in store.list_all("odd/")) == expected
        assert sorted(i.path for i in store.list_all("odd/")) == sorted(ODD_KEYS)
        assert sorted(store.list_dir("odd/").dirs) == ["sub dir", "été"]
        info = store.list_dir("odd/").files[0]
        assert info.size == 5 and len(info.etag) == 32 and abs(info.mtime - time.time()) < 600
        assert store.list_dir("odd/sub dir/").files[0].path == "odd/sub dir/x"
        head = client.head_object(Bucket=bucket, Key=ODD_KEYS[0])
        assert store.head(ODD_KEYS[0]) == type(info)(path=ODD_KEYS[0], size=5, etag=head["ETag"].strip('"'),
                                                      mtime=head["LastModified"].timestamp())
    finally:
        store.close()


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
    assert page.truncated is True and page.token.endswith("bOwM=")
    [obj] = page.objects
    assert obj.key == "p/a+b & c"            # no EncodingType: taken as it is, '+' kept
    assert obj.etag == "d41d8cd98f00b204e9800998ecf8427e" and obj.size == 0
    assert obj.mtime == 1795338001.0
    assert page.prefixes == ["p/sub/"]


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


def test_an_endpoint_from_the_environment_is_used_and_named(s3_server, client, bucket, monkeypatch):
    """AWS_ENDPOINT_URL (as botocore reads it) is where requests go, and the cache's identity
    names it: two endpoints never share cached blocks."""
    client.put_object(Bucket=bucket, Key="e.txt", Body=b"env")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    store = S3Store(bucket, "", metrics=Metrics())
    try:
        assert store.identity == f"s3|{s3_server.endpoint_url}|{bucket}|"
        info = store.head("e.txt")
        assert store.get("e.txt", 0, 3, info.etag, 3) == b"env"
    finally:
        store.close()


# --- retries and GET checks from worker threads, against a scripted server ---------------------

def reply(status: str, body: bytes = b"", *headers: str) -> bytes:
    head = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def partial(body: bytes, start: int, size: int, etag: str = "e1") -> bytes:
    return reply("206 Partial Content", body, f"Content-Range: bytes {start}-{start + len(body) - 1}/{size}",
                 f'ETag: "{etag}"')


def s3_error(status: str, code: str) -> bytes:
    return reply(status, f"<Error><Code>{code}</Code><Message>m</Message></Error>".encode())


def turns(*answers: bytes):
    """A script answering the n-th request with the n-th answer (the last one again after that)."""
    seen = []

    def script(conn: int, request: bytes) -> bytes:
        seen.append(request)
        return answers[min(len(seen), len(answers)) - 1]
    return script


@pytest.fixture
def threaded_store(scripted, metrics):
    """(store, server): GETs from worker threads, every request to a scripted server."""
    made = []

    def make(script, **options) -> tuple[S3Store, object]:
        server = scripted(script)
        store = S3Store("bkt", "", metrics=metrics, options=S3Options(
            endpoint_url=f"http://127.0.0.1:{server.port}", lean_requests=False, **options))
        made.append(store)
        return store, server
    yield make
    for store in made:
        store.close()


def test_get_sends_if_match_and_range(threaded_store):
    store, server = threaded_store(turns(partial(b"abc", 10, 100)))
    assert store.get("k", 10, 13, "e1", 100) == b"abc"
    [request] = server.requests
    assert request.startswith(b"GET /bkt/k HTTP/1.1") and b'If-Match: "e1"' in request
    assert b"Range: bytes=10-12" in request and b"Authorization: AWS4-HMAC-SHA256" in request


def test_get_retries_503_and_a_reset_mid_body(threaded_store, metrics):
    cut = partial(b"abc", 0, 100)[:-2] + b"<close>"      # the body ends after one byte
    store, server = threaded_store(turns(s3_error("503 Slow Down", "SlowDown"), cut, partial(b"abc", 0, 100)))
    assert store.get("k", 0, 3, "e1", 100) == b"abc"
    assert len(server.requests) == 3
    assert requests(metrics, "get", "503") == 1
    assert requests(metrics, "get", "error") == 1
    assert metrics.counter_value("cachefs_store_retries_total", op="get") == 2


@pytest.mark.parametrize("etag", ['e1"\r\nX-Injected: 1', "e1\n", "e\x00"])
def test_an_etag_with_control_characters_never_reaches_the_wire(threaded_store, etag):
    store, server = threaded_store(turns(partial(b"234", 2, 10)))
    with pytest.raises(BadResponse, match="control character"):
        store.get("k", 2, 5, etag, 10)
    assert server.requests == []


@pytest.mark.parametrize("answer, error", [
    (reply("200 OK", b"abc"), BadResponse),                                  # 200 of the length, nothing proves it
    (partial(b"abc", 0, 10), BadResponse),                                   # wrong range
    (reply("206 Partial Content", b"abc", 'ETag: "e1"'), BadResponse),       # 206 without Content-Range
    (partial(b"abc", 2, 11), VersionChanged),                                # size moved
    (partial(b"abc", 2, 10, etag="e2"), VersionChanged),                     # If-Match ignored
])
def test_get_detects_wrong_answers(threaded_store, answer, error):
    store, _ = threaded_store(turns(answer))          # a wrong range is retried, then refused
    with pytest.raises(error, match="get s3://bkt/k"):
        store.get("k", 2, 5, "e1", 10)


def test_short_body_is_retried_then_bad_response(threaded_store, metrics):
    short = reply("206 Partial Content", b"ab", "Content-Range: bytes 2-4/10", 'ETag: "e1"')
    store, server = threaded_store(turns(short))
    with pytest.raises(BadResponse, match="got 2 bytes"):
        store.get("k", 2, 5, "e1", 10)
    assert len(server.requests) == 5
    assert metrics.counter_value("cachefs_store_retries_total", op="get") == 4


# --- every other operation, on the wire --------------------------------------------------------

def test_head_reads_size_etag_and_last_modified(threaded_store, metrics):
    store, server = threaded_store(turns(b'HTTP/1.1 200 OK\r\nContent-Length: 12\r\nETag: "e7"\r\n'
                                         b"Last-Modified: Sun, 22 Nov 2026 09:00:01 GMT\r\n\r\n"))
    info = store.head("a/b c")
    assert (info.path, info.size, info.etag, info.mtime) == ("a/b c", 12, "e7", 1795338001.0)
    assert server.requests[0].startswith(b"HEAD /bkt/a/b%20c HTTP/1.1")
    assert requests(metrics, "head", "200") == 1


def test_a_head_without_a_date_is_a_bad_response(threaded_store):
    store, _ = threaded_store(turns(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n"))
    with pytest.raises(BadResponse, match="Last-Modified"):
        store.head("k")


def test_a_multipart_upload_on_the_wire_and_a_completion_that_fails_after_its_200(threaded_store, metrics):
    """CreateMultipartUpload, UploadPart, then CompleteMultipartUpload answered 200 with an
    InternalError body (S3 sends the status before it has assembled the object): retried, not
    taken for success; the object's size is checked by a HEAD."""
    started = reply("200 OK", b"<InitiateMultipartUploadResult><Bucket>bkt</Bucket><Key>k</Key>"
                    b"<UploadId>up-1</UploadId></InitiateMultipartUploadResult>")
    part = reply("200 OK", b"", 'ETag: "p1"')
    failed = reply("200 OK", b'<?xml version="1.0"?>\n<Error><Code>InternalError</Code><Message>retry'
                   b"</Message></Error>")
    done = reply("200 OK", b"<CompleteMultipartUploadResult><ETag>&quot;x-1&quot;</ETag>"
                 b"</CompleteMultipartUploadResult>")
    head = b'HTTP/1.1 200 OK\r\nContent-Length: 5\r\nETag: "x-1"\r\nLast-Modified: Sun, 22 Nov 2026 09:00:01 GMT\r\n\r\n'
    store, server = threaded_store(turns(started, part, failed, done, head))
    upload = store.start_upload("k")
    assert upload == "up-1"
    assert store.upload_part("k", upload, 1, b"hello") == "p1"
    assert store.finish_upload("k", upload, [(1, "p1")], 5).etag == "x-1"
    first, second, complete, again, _ = server.requests
    assert first.startswith(b"POST /bkt/k?uploads= HTTP/1.1")
    assert second.startswith(b"PUT /bkt/k?partNumber=1&uploadId=up-1 HTTP/1.1") and second.endswith(b"hello")
    assert complete.startswith(b"POST /bkt/k?uploadId=up-1 HTTP/1.1")
    # sent again, the same request and body (its date and signature may be a second later)
    assert complete.split(b"\r\n", 1)[0] == again.split(b"\r\n", 1)[0]
    assert complete.partition(b"\r\n\r\n")[2] == again.partition(b"\r\n\r\n")[2] != b""
    assert b"<Part><PartNumber>1</PartNumber><ETag>\"p1\"</ETag></Part>" in complete
    assert metrics.counter_value("cachefs_store_retries_total", op="finish_upload") == 1


def test_a_copy_that_fails_after_its_200_is_an_error(threaded_store):
    store, server = threaded_store(turns(reply("200 OK", b"<Error><Code>AccessDenied</Code><Message>no"
                                               b"</Message></Error>")))
    with pytest.raises(AccessDenied, match="copy s3://bkt/b"):
        store.copy("a x", "b")
    [request] = server.requests
    assert request.startswith(b"PUT /bkt/b HTTP/1.1") and b"x-amz-copy-source: /bkt/a%20x" in request


def test_delete_and_abort_are_deletes_and_missing_is_fine(threaded_store, metrics):
    store, server = threaded_store(turns(reply("204 No Content"), s3_error("404 Not Found", "NoSuchUpload")))
    store.delete("k")
    store.abort_upload("k", "up-1")
    assert [r.split(b" HTTP")[0] for r in server.requests] == [b"DELETE /bkt/k", b"DELETE /bkt/k?uploadId=up-1"]
    assert requests(metrics, "delete", "204") == 1 and requests(metrics, "abort_upload", "404") == 1


def test_a_bucket_in_another_region_says_which(threaded_store):
    store, _ = threaded_store(turns(reply("301 Moved Permanently", b"", "x-amz-bucket-region: eu-west-3")))
    with pytest.raises(AccessDenied, match="region eu-west-3.*--region eu-west-3"):
        store.check()


def test_without_credentials_nothing_is_sent(scripted, metrics, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    server = scripted(turns(reply("200 OK")))
    store = S3Store("bkt", "", metrics=metrics, options=S3Options(endpoint_url=f"http://127.0.0.1:{server.port}"))
    try:
        with pytest.raises(AccessDenied, match="head_bucket s3://bkt/: no usable credentials"):
            store.check()
    finally:
        store.close()
    assert server.requests == []


def test_a_proxy_from_the_environment_carries_every_request(scripted, metrics, monkeypatch):
    """HTTP_PROXY is honoured (GETs then run in threads); NO_PROXY too."""
    proxy = scripted(turns(partial(b"abc", 0, 100), reply("200 OK")))
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    store = S3Store("bkt", "", metrics=metrics, options=S3Options(endpoint_url="http://s3.example.invalid:9000"))
    try:
        assert not store.cancellable_gets
        assert store.get("k", 0, 3, "e1", 100) == b"abc"
        store.check()
    finally:
        store.close()
    assert [r.split(b"\r\n")[0] for r in proxy.requests] == [
        b"GET http://s3.example.invalid:9000/bkt/k HTTP/1.1", b"HEAD http://s3.example.invalid:9000/bkt HTTP/1.1"]
    monkeypatch.setenv("NO_PROXY", "s3.example.invalid")
    bypass = S3Store("bkt", "", metrics=metrics, options=S3Options(endpoint_url="http://s3.example.invalid:9000"))
    try:
        assert bypass.cancellable_gets
    finally:
        bypass.close()


# --- error mapping (moto accepts any credentials, so denial is tested here) ----------------------------

URL = "s3://bkt/some/key"


def client_error(code: str, status: int, op: str = "GetObject") -> S3Error:
    return S3Error(op, status, code, "m")


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
    refused = ConnectionRefusedError(111, "Connection refused")
    assert is_temp_failure(refused) and is_temp_failure(ShortBody("x")) and is_temp_failure(TimeoutError())
    assert isinstance(map_error(refused, op="get", url=URL), Unreachable)
    denied = map_error(NoCredentials("none found"), op="head", url=URL)
    assert isinstance(denied, AccessDenied) and str(denied).startswith(f"head {URL}")
    assert not is_temp_failure(NoCredentials("none found"))


def test_local_server_stops_by_its_own_pid():
    from testing.s3 import LocalS3Server
    with LocalS3Server() as server:
        proc = server._proc
        s3_client(server.endpoint_url).list_buckets()
    assert proc.poll() is not None
    with pytest.raises(EndpointConnectionError):
        s3_client(server.endpoint_url).list_buckets()
