"""GETs as trio tasks (``cachefs.store.s3.http``) through ``S3Store.get_async``.

Against moto's server on loopback for S3 behaviour, and against a scripted HTTP server on
loopback (real sockets, one thread) for what moto never does: chunked and close-delimited
bodies, keep-alive connections the server dropped while idle, truncated bodies, silence,
5xx answers. Signatures are checked for real by Ceph RGW in test_rgw.py (every read there
takes this path).
"""

import datetime
import ipaddress
import ssl
import time
import uuid
from pathlib import Path

import pytest
import trio
from mounts import wait_for
from scripted_http import ScriptedServer

from cachefs.errors import BadResponse, NoSuchKey, Unreachable, VersionChanged
from cachefs.metrics import Metrics
from cachefs.store.metrics import StoreMetrics
from cachefs.store.s3.http import AsyncGetter
from cachefs.store.s3.store import S3Options, S3Store
from testing.s3 import s3_client

BODY = bytes(range(256)) * 700       # 179,200 bytes: several receives


def requests(metrics: Metrics, op: str, status: str) -> float:
    return metrics.counter_value("cachefs_store_requests_total", op=op, status=status)


def run_gets(store: S3Store, calls: list[tuple], limit: int = 8) -> list:
    """Run store.get_async for each (path, start, end, etag, size) concurrently; results or errors."""
    results: list = [None] * len(calls)

    async def main() -> None:
        limiter = trio.CapacityLimiter(limit)

        async def one(i: int, call: tuple) -> None:
            try:
                results[i] = await store.get_async(*call, limiter=limiter)
            except Exception as exc:       # noqa: BLE001 - the test inspects it
                results[i] = exc
        async with trio.open_nursery() as nursery:
            for i, call in enumerate(calls):
                nursery.start_soon(one, i, call)
    trio.run(main)
    return results


# --- against moto ---------------------------------------------------------------------------------

@pytest.fixture
def moto_store(s3_server):
    name = f"test-aget-{uuid.uuid4().hex[:12]}"
    client = s3_client(s3_server.endpoint_url)
    client.create_bucket(Bucket=name)
    for i in range(20):
        client.put_object(Bucket=name, Key=f"data/f{i:02d}", Body=BODY[i:])
    metrics = Metrics()
    store = S3Store(name, "data", metrics=metrics, options=S3Options(endpoint_url=s3_server.endpoint_url))
    assert store._async_getter is not None
    infos = {info.path: info for info in store.list_all()}
    yield store, infos, metrics, client
    store.close()


def test_whole_and_ranged_gets_return_the_exact_bytes(moto_store):
    store, infos, metrics, _ = moto_store
    calls = []
    for i in range(20):
        info = infos[f"f{i:02d}"]
        calls.append((info.path, 0, info.size, info.etag, info.size))
        calls.append((info.path, 1000 + i, 70_000 + 3 * i, info.etag, info.size))
    results = run_gets(store, calls)
    for i in range(20):
        whole, ranged = results[2 * i], results[2 * i + 1]
        assert whole == BODY[i:]
        assert ranged == BODY[i:][1000 + i:70_000 + 3 * i]
    assert requests(metrics, "get", "200") == 20 and requests(metrics, "get", "206") == 20
    assert metrics.counter_value("cachefs_store_read_bytes_total") == sum(map(len, results))


def test_a_changed_object_and_a_missing_one_raise_the_store_errors(moto_store):
    store, infos, metrics, client = moto_store
    info = infos["f00"]
    client.put_object(Bucket=store.bucket, Key="data/f00", Body=b"new content")
    changed, missing = run_gets(store, [(info.path, 0, 100, info.etag, info.size),
                                        ("absent", 0, 10, "x", 10)])
    assert isinstance(changed, VersionChanged) and "s3://" in str(changed)
    assert isinstance(missing, NoSuchKey)
    assert requests(metrics, "get", "412") == 1 and requests(metrics, "get", "404") == 1


def test_empty_range_needs_no_request(moto_store):
    store, infos, metrics, _ = moto_store
    info = infos["f01"]
    assert run_gets(store, [(info.path, 5, 5, info.etag, info.size)]) == [b""]
    assert requests(metrics, "get", "200") == 0


def test_without_lean_requests_the_get_runs_in_a_worker_thread(s3_server, moto_store):
    _, infos, _, _ = moto_store
    metrics = Metrics()
    store = S3Store(moto_store[0].bucket, "data", metrics=metrics,
                    options=S3Options(endpoint_url=s3_server.endpoint_url, lean_requests=False))
    try:
        assert store._async_getter is None
        info = infos["f03"]
        assert run_gets(store, [(info.path, 0, info.size, info.etag, info.size)]) == [BODY[3:]]
    finally:
        store.close()


# --- against a scripted server --------------------------------------------------------------------

def ok(body: bytes, *extra: str) -> bytes:
    head = ["HTTP/1.1 200 OK", f"Content-Length: {len(body)}", 'ETag: "v1"', *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def getter(server: ScriptedServer, read_timeout: float = 5.0) -> AsyncGetter:
    store = S3Store("bkt", "", metrics=Metrics(),
                    options=S3Options(endpoint_url=f"http://127.0.0.1:{server.port}", read_timeout=read_timeout))
    assert store._async_getter is not None
    return store._async_getter


def gets(getter_: AsyncGetter, n: int) -> list:
    """n sequential GETs of key "k" in one trio run: bodies, or the exception raised."""
    out = []

    async def main() -> None:
        for _ in range(n):
            try:
                out.append((await getter_.get("bkt", "k", {}))[1])
            except Exception as exc:      # noqa: BLE001
                out.append(exc)
    trio.run(main)
    return out


def test_keep_alive_reuses_one_connection_and_signs_every_request(scripted):
    server = scripted(lambda n, req: ok(b"hello"))
    assert gets(getter(server), 5) == [b"hello"] * 5
    assert server.connections == 1 and len(server.requests) == 5
    for request in server.requests:
        assert request.startswith(b"GET /bkt/k HTTP/1.1\r\n")
        assert f"Host: 127.0.0.1:{server.port}\r\n".encode() in request
        assert b"Authorization: AWS4-HMAC-SHA256 Credential=" in request
        assert b"x-amz-date: " in request.lower()


def test_a_connection_idle_too_long_is_not_reused(scripted, monkeypatch):
    import cachefs.store.s3.http
    monkeypatch.setattr(cachefs.store.s3.http, "_IDLE_MAX_S", 0.2)
    server = scripted(lambda n, req: ok(b"hello"))
    aget = getter(server)

    async def main() -> list:
        bodies = [(await aget.get("bkt", "k", {}))[1], (await aget.get("bkt", "k", {}))[1]]
        await trio.sleep(0.3)
        return bodies + [(await aget.get("bkt", "k", {}))[1]]
    assert trio.run(main) == [b"hello"] * 3
    assert server.connections == 2          # reused once, then replaced after 0.3 s idle


def test_chunked_and_close_delimited_bodies(scripted):
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nX-Trailer: t\r\n\r\n")
    replies = {1: chunked, 2: b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end<close>"}
    server = scripted(lambda n, req: replies[min(len(server.requests), 2)])
    assert gets(getter(server), 2) == [b"hello, world", b"until the end"]
    assert server.connections == 1      # the chunked answer left the connection reusable


def test_a_connection_closed_while_idle_is_replaced_without_an_error(scripted):
    server = scripted(lambda n, req: ok(b"x" * 1000) + b"<close>")    # no Connection: close header
    results = gets(getter(server), 3)
    assert results == [b"x" * 1000] * 3
    assert server.connections == 3


def test_a_truncated_body_is_a_connection_error_and_the_store_retries_it(scripted):
    answers = iter([ok(BODY)[:5000] + b"<close>", ok(BODY)])
    server = scripted(lambda n, req: next(answers))
    metrics = Metrics()
    store = S3Store("bkt", "", metrics=metrics, options=S3Options(endpoint_url=f"http://127.0.0.1:{server.port}"))
    assert run_gets(store, [("k", 0, len(BODY), "v1", len(BODY))]) == [BODY]
    assert metrics.counter_value("cachefs_store_retries_total", op="get") == 1
    assert server.connections == 2


def test_5xx_answers_are_retried_then_reported(scripted):
    error_body = b"<Error><Code>SlowDown</Code><Message>go slow</Message></Error>"
    slow = b"HTTP/1.1 503 Slow Down\r\nContent-Length: %d\r\n\r\n%s" % (len(error_body), error_body)
    server = scripted(lambda n, req: slow)
    metrics = Metrics()
    store = S3Store("bkt", "", metrics=metrics,
                    options=S3Options(endpoint_url=f"http://127.0.0.1:{server.port}", max_attempts=3))
    [error] = run_gets(store, [("k", 0, 10, "v1", 10)])
    assert isinstance(error, Unreachable) and "SlowDown" in str(error)
    assert len(server.requests) == 3 and server.connections == 1
    assert requests(metrics, "get", "503") == 3


def test_a_server_that_says_nothing_times_out(scripted):
    server = scripted(lambda n, req: b"<silent>")
    [error] = gets(getter(server, read_timeout=0.3), 1)
    assert isinstance(error, TimeoutError)


def test_a_body_that_stops_midway_times_out(scripted):
    server = scripted(lambda n, req: ok(BODY)[:60_000] + b"<stall>")
    [error] = gets(getter(server, read_timeout=0.3), 1)
    assert isinstance(error, TimeoutError)


def test_a_slow_body_that_keeps_coming_is_not_a_timeout(scripted):
    server = scripted(lambda n, req: ok(BODY) + b"<trickle>")      # 0.8 s in all, never 0.3 s silent
    assert gets(getter(server, read_timeout=0.3), 1) == [BODY]


def test_garbage_instead_of_http_is_an_error_not_a_hang(scripted):
    server = scripted(lambda n, req: b"SSH-2.0-OpenSSH\r\n\r\n")
    metrics = Metrics()
    store = S3Store("bkt", "", metrics=metrics,
                    options=S3Options(endpoint_url=f"http://127.0.0.1:{server.port}", max_attempts=2))
    [error] = run_gets(store, [("k", 0, 10, "v1", 10)])
    assert isinstance(error, Unreachable) and "not an HTTP/1.x response" in str(error)


def test_a_wrong_etag_in_the_answer_is_a_version_change(scripted):
    server = scripted(lambda n, req: ok(b"0123456789").replace(b'"v1"', b'"v2"'))
    store = S3Store("bkt", "", metrics=Metrics(), options=S3Options(endpoint_url=f"http://127.0.0.1:{server.port}"))
    [error] = run_gets(store, [("k", 0, 10, "v1", 10)])
    assert isinstance(error, VersionChanged)
    server2 = scripted(lambda n, req: ok(b"01234"))
    store2 = S3Store("bkt", "", metrics=Metrics(),
                     options=S3Options(endpoint_url=f"http://127.0.0.1:{server2.port}", max_attempts=1))
    [short] = run_gets(store2, [("k", 0, 10, "v1", 10)])
    assert isinstance(short, BadResponse)


def test_a_cancelled_get_closes_its_connection(scripted):
    def script(n: int, req: bytes) -> bytes:
        return b"<silent>" if n == 1 else ok(b"fresh")
    server = scripted(script)
    aget = getter(server)

    async def main() -> list:
        with trio.move_on_after(0.3):
            await aget.get("bkt", "k", {})
        return [(await aget.get("bkt", "k", {}))[1]]
    assert trio.run(main) == [b"fresh"]
    assert server.connections == 2


def test_a_get_sent_early_leaves_at_once_and_its_get_reads_the_answer(scripted):
    server = scripted(lambda n, req: ok(req.split(b" ")[1]))     # the body names the target asked
    aget = getter(server)
    early = {"Range": "bytes=0-4", "If-Match": '"v1"'}

    async def main() -> tuple:
        first = (await aget.get("bkt", "a", {}))[1]              # leaves one idle connection
        assert aget.send_early("bkt", "b", early)
        assert aget.sent_at("bkt", "b", early) is not None
        # no await since: the request is on the wire, and the server answers it by itself
        wait_for(lambda: len(server.requests) == 2, timeout=5.0)
        other = (await aget.get("bkt", "b", {}))[1]              # other headers: not the early GET
        mine = (await aget.get("bkt", "b", early))[1]
        return first, other, mine, aget.sent_at("bkt", "b", early)
    first, other, mine, after = trio.run(main)
    assert (first, other, mine) == (b"/bkt/a", b"/bkt/b", b"/bkt/b")
    assert len(server.requests) == 3 and server.connections == 2    # the early answer read, not asked again
    assert b"range: bytes=0-4" in server.requests[1].lower()
    assert after is None


def test_no_idle_connection_no_early_get(scripted):
    server = scripted(lambda n, req: ok(b"x"))
    aget = getter(server)

    async def main() -> tuple[bool, bytes]:
        sent = aget.send_early("bkt", "k", {})
        return sent, (await aget.get("bkt", "k", {}))[1]
    assert trio.run(main) == (False, b"x")
    assert len(server.requests) == 1


def test_an_early_get_on_a_connection_closed_while_idle_is_sent_again(scripted):
    server = scripted(lambda n, req: ok(b"y" * 100) + b"<close>")    # every connection answers once
    aget = getter(server)

    async def main() -> list:
        out = [(await aget.get("bkt", "k", {}))[1]]
        wait_for(lambda: server.connections == 1 and not server._threads[-1].is_alive(), timeout=5.0)
        aget.send_early("bkt", "k", {})      # may be sent into the closed connection
        out.append((await aget.get("bkt", "k", {}))[1])
        return out
    assert trio.run(main) == [b"y" * 100] * 2
    assert server.connections == 2


def test_unasked_early_gets_are_dropped_past_max_idle(scripted):
    server = scripted(lambda n, req: ok(req.split(b" ")[1]))
    aget = getter(server)
    aget._max_idle = 3

    async def main() -> tuple:
        async with trio.open_nursery() as nursery:        # three idle connections
            for key in "abc":
                nursery.start_soon(aget.get, "bkt", key, {})
        aget._max_idle = 2
        sent = [aget.send_early("bkt", key, {}) for key in "xyz"]
        waiting = [aget.sent_at("bkt", key, {}) is not None for key in "xyz"]
        return sent, waiting, [(await aget.get("bkt", key, {}))[1] for key in "xyz"]
    sent, waiting, bodies = trio.run(main)
    assert sent == [True, True, True] and waiting == [False, True, True]    # the oldest dropped
    assert bodies == [b"/bkt/x", b"/bkt/y", b"/bkt/z"]       # x asked again, y and z read
    assert sorted(r.split(b" ")[1] for r in server.requests[3:]) == [b"/bkt/x", b"/bkt/x", b"/bkt/y", b"/bkt/z"]


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made with cryptography (a moto dependency)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cachefs test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_https_endpoint_verified_by_aws_ca_bundle(scripted, tmp_path, monkeypatch):
    cert, key = self_signed(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server = scripted(lambda n, req: ok(BODY), tls)
    url = f"https://127.0.0.1:{server.port}"
    monkeypatch.setenv("AWS_CA_BUNDLE", str(cert))
    store = S3Store("bkt", "", metrics=Metrics(), options=S3Options(endpoint_url=url))
    assert run_gets(store, [("k", 0, len(BODY), "v1", len(BODY))] * 3, limit=1) == [BODY] * 3
    assert server.connections == 1 and server.requests[0].startswith(b"GET /bkt/k HTTP/1.1")
    assert f"Host: 127.0.0.1:{server.port}".encode() in server.requests[0]
    monkeypatch.delenv("AWS_CA_BUNDLE")                # an unknown issuer is refused, never trusted
    untrusting = S3Store("bkt", "", metrics=Metrics(), options=S3Options(endpoint_url=url, max_attempts=1))
    [error] = run_gets(untrusting, [("k", 0, len(BODY), "v1", len(BODY))])
    assert isinstance(error, Unreachable) and "certificate" in str(error).lower()


def test_nothing_listening_is_unreachable_after_the_retries():
    from testing.s3 import free_port
    metrics = Metrics()
    store = S3Store("bkt", "", metrics=metrics,
                    options=S3Options(endpoint_url=f"http://127.0.0.1:{free_port()}", max_attempts=2,
                                      read_timeout=1.0))
    started = time.monotonic()
    [error] = run_gets(store, [("k", 0, 10, "v1", 10)])
    assert isinstance(error, Unreachable) and "cannot connect" in str(error)
    # refused connections are retried past max_attempts for min(5 s, read timeout): a restart
    assert 1.0 <= time.monotonic() - started < 4.0
    assert metrics.counter_value("cachefs_store_retries_total", op="get") >= 2


# --- ranged GETs answered 200, on both lean paths ----------------------------------------------

OBJECT = bytes(range(256)) * 400      # 102,400 bytes
RANGE = (10_000, 30_000)


def range_reply(mode: str):
    """A script answering a ranged GET of OBJECT the way ``mode`` says a server does."""
    def script(n: int, request: bytes) -> bytes:
        start, end = RANGE
        asked = OBJECT[start:end]
        head = {"206": ["HTTP/1.1 206 Partial Content", f"Content-Range: bytes {start}-{end - 1}/{len(OBJECT)}",
                        'ETag: "v1"'],
                "whole": ["HTTP/1.1 200 OK", 'ETag: "v1"'],
                "range_cr": ["HTTP/1.1 200 OK", f"Content-Range: bytes {start}-{end - 1}/{len(OBJECT)}",
                             'ETag: "v1"'],
                "range_etag": ["HTTP/1.1 200 OK", 'ETag: "v1"'],
                "range_nothing": ["HTTP/1.1 200 OK"],
                "range_wrong_cr": ["HTTP/1.1 200 OK", f"Content-Range: bytes 0-{end - start - 1}/{len(OBJECT)}",
                                   'ETag: "v1"'],
                "other_length": ["HTTP/1.1 200 OK", 'ETag: "v1"']}[mode]
        body = {"whole": OBJECT, "other_length": asked[:-1]}.get(mode, asked)
        return ("\r\n".join([*head, f"Content-Length: {len(body)}"]) + "\r\n\r\n").encode() + body
    return script


def read_range(store: S3Store, threaded: bool) -> bytes | Exception:
    call = ("k", *RANGE, "v1", len(OBJECT))
    if not threaded:
        return run_gets(store, [call])[0]
    try:
        return store.get(*call)
    except Exception as exc:      # noqa: BLE001 - the test inspects it
        return exc


def scripted_store(server: ScriptedServer, metrics: Metrics) -> S3Store:
    store = S3Store("bkt", "", metrics=metrics, options=S3Options(endpoint_url=f"http://127.0.0.1:{server.port}"))
    assert store._async_getter is not None and store._requests is not None
    return store


def fallbacks(metrics: Metrics, kind: str) -> float:
    return metrics.counter_value("cachefs_store_range_fallbacks_total", kind=kind)


@pytest.mark.allow_warnings
@pytest.mark.parametrize("threaded", [False, True], ids=["trio", "threaded"])
@pytest.mark.parametrize("mode,kind", [("206", None), ("whole", "whole_object"),
                                       ("range_cr", "range_200_content_range"), ("range_etag", "range_200_etag")])
def test_answers_that_prove_their_bytes_are_accepted_counted_and_warned_once(scripted, caplog, threaded, mode,
                                                                            kind):
    server = scripted(range_reply(mode))
    metrics = Metrics()
    store = scripted_store(server, metrics)
    try:
        assert [read_range(store, threaded) for _ in range(3)] == [OBJECT[RANGE[0]:RANGE[1]]] * 3
    finally:
        store.close()
    assert b"Range: bytes=10000-29999" in server.requests[0] and b'If-Match: "v1"' in server.requests[0]
    warnings = [r for r in caplog.records if "range" in r.getMessage() and r.levelname == "WARNING"]
    if kind is None:
        assert not warnings and all(fallbacks(metrics, k) == 0 for k in ("whole_object", "range_200_etag"))
    else:
        assert fallbacks(metrics, kind) == 3
        assert len(warnings) == 1 and "127.0.0.1" in warnings[0].getMessage()       # once per store


@pytest.mark.parametrize("threaded", [False, True], ids=["trio", "threaded"])
@pytest.mark.parametrize("mode,error,attempts", [("range_nothing", "neither Content-Range nor the pinned ETag", 1),
                                                 ("range_wrong_cr", "got Content-Range", 5),
                                                 ("other_length", "got 200 with 19999 bytes", 5)])
def test_answers_that_prove_nothing_are_errors_never_bytes(scripted, threaded, mode, error, attempts):
    server = scripted(range_reply(mode))
    metrics = Metrics()
    store = scripted_store(server, metrics)
    try:
        result = read_range(store, threaded)
    finally:
        store.close()
    assert isinstance(result, BadResponse) and error in str(result), result
    assert len(server.requests) == attempts          # a length or range mismatch is retried, then EIO
    assert result.errno == 5


@pytest.mark.allow_warnings
@pytest.mark.parametrize("threaded", [False, True], ids=["trio", "threaded"])
def test_a_whole_big_object_for_a_range_is_read_only_up_to_the_range_then_dropped(scripted, monkeypatch,
                                                                                threaded):
    import cachefs.store.s3.answer
    monkeypatch.setattr(cachefs.store.s3.answer, "MAX_WASTE", 1000)      # OBJECT counts as big
    big = OBJECT * 40                                                  # 4 MB sent, 20 KB wanted
    server = scripted(lambda n, req: ok(big))
    metrics = Metrics()
    store = scripted_store(server, metrics)
    call = ("k", *RANGE, "v1", len(big))
    try:
        got = [run_gets(store, [call])[0] for _ in range(2)] if not threaded else [store.get(*call) for _ in range(2)]
    finally:
        store.close()
    assert got == [big[RANGE[0]:RANGE[1]]] * 2
    assert server.connections == 2                     # the rest of the body was not read: not reused
    assert fallbacks(metrics, "whole_object") == 2
    assert metrics.counter_value("cachefs_store_read_bytes_total") == 2 * (RANGE[1] - RANGE[0])


@pytest.mark.parametrize("threaded", [False, True], ids=["trio", "threaded"])
def test_a_whole_object_too_far_to_skip_fails_that_read_clearly(scripted, monkeypatch, threaded):
    import cachefs.store.s3.answer
    monkeypatch.setattr(cachefs.store.s3.answer, "MAX_WASTE", 1000)
    monkeypatch.setattr(cachefs.store.s3.answer, "MAX_SKIP", 5000)
    server = scripted(lambda n, req: ok(OBJECT))
    store = scripted_store(server, Metrics())
    try:
        result = read_range(store, threaded)
    finally:
        store.close()
    assert isinstance(result, BadResponse) and "ignores Range" in str(result) and len(server.requests) == 1


@pytest.mark.parametrize("threaded", [False, True], ids=["trio", "threaded"])
@pytest.mark.parametrize("etag", ['v1"\r\nX-Injected: yes', "v1\n", "v\x00"])
def test_an_etag_with_cr_lf_is_refused_and_nothing_is_sent(scripted, threaded, etag):
    server = scripted(lambda n, req: ok(b"0123456789"))
    store = scripted_store(server, Metrics())
    call = ("k", 0, 4, etag, 10)
    try:
        result = run_gets(store, [call])[0] if not threaded else read_call(store, call)
    finally:
        store.close()
    assert isinstance(result, BadResponse) and "control character" in str(result)
    assert server.requests == []


def read_call(store: S3Store, call: tuple) -> bytes | Exception:
    try:
        return store.get(*call)
    except Exception as exc:      # noqa: BLE001 - the test inspects it
        return exc


def test_start_get_is_a_hint_that_never_raises_and_sends_nothing_bad(scripted):
    server = scripted(lambda n, req: ok(b"0123456789"))
    store = scripted_store(server, Metrics())

    async def main() -> list:
        await store.get_async("k", 0, 10, "v1", 10, limiter=trio.CapacityLimiter(1))   # one idle connection
        store.start_get("k", 0, 4, 'v1"\r\nX-Injected: 1', 10)     # refused: nothing sent, nothing raised
        store.start_get("k", 5, 3, "v1", 10)                          # a bad range: the same
        store.start_get("k", 4, 4, "v1", 10)                          # empty: no request at all
        return [len(server.requests), await store.get_async("k", 0, 10, "v1", 10, limiter=trio.CapacityLimiter(1))]
    try:
        assert trio.run(main) == [1, b"0123456789"]
    finally:
        store.close()
    assert len(server.requests) == 2 and server.connections == 1


# --- a cancelled GET (a hedge that lost, a reader gone) is counted as cancelled, never an error ------

@pytest.mark.parametrize("size", [200_000, 3 << 20], ids=["in-trio", "in-a-receiving-thread"])
@pytest.mark.parametrize("answer", ["trickle", "silent"])
def test_a_cancelled_get_is_counted_cancelled_not_error(scripted, size, answer):
    body = bytes(range(256)) * (size // 256)

    def script(n: int, req: bytes) -> bytes:
        return ok(body) + b"<trickle>" if answer == "trickle" else b"<silent>"
    server = scripted(script)
    metrics = Metrics()
    store = S3Store("bkt", "", metrics=metrics, options=S3Options(endpoint_url=f"http://127.0.0.1:{server.port}"))

    async def main() -> None:
        with trio.move_on_after(0.25) as scope:
            await store.get_async("k", 0, len(body), "v1", len(body), limiter=trio.CapacityLimiter(4))
        assert scope.cancelled_caught
    trio.run(main)
    counts = {s.labels["status"]: s.value for m in metrics.group(StoreMetrics).store_requests.collect() for s in m.samples
              if s.name.endswith("_total") and s.labels["op"] == "get"}
    assert counts == {"cancelled": 1.0}


def test_a_get_cancelled_while_connecting_is_counted_cancelled(scripted, monkeypatch):
    """trio.open_tcp_stream runs its attempts in a nursery: a cancellation while connecting comes
    out of it wrapped in an exception group. It is still a cancellation, not a failed GET."""
    server = scripted(lambda n, req: ok(b"x"))

    async def connecting(host, port):
        async with trio.open_nursery() as nursery:     # two attempts in flight, as happy eyeballs has
            nursery.start_soon(trio.sleep_forever)
            nursery.start_soon(trio.sleep_forever)
    monkeypatch.setattr(trio, "open_tcp_stream", connecting)
    metrics = Metrics()
    store = S3Store("bkt", "", metrics=metrics, options=S3Options(endpoint_url=f"http://127.0.0.1:{server.port}"))

    async def main() -> None:
        with trio.move_on_after(0.1) as scope:
            await store.get_async("k", 0, 1, "v1", 1, limiter=trio.CapacityLimiter(4))
        assert scope.cancelled_caught
    trio.run(main)
    counts = {s.labels["status"]: s.value for m in metrics.group(StoreMetrics).store_requests.collect() for s in m.samples
              if s.name.endswith("_total") and s.labels["op"] == "get"}
    assert counts == {"cancelled": 1.0}
