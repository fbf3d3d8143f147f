"""testing/latency_proxy.py against a real moto server: latency, bandwidth, faults, CLI.

Timing assertions are lower bounds (an emulated delay can only add time), except
the pipelining test, whose upper bound is many times the expected duration.
"""

import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import boto3
import botocore.exceptions
import pytest
from botocore.config import Config

from testing.latency_proxy import (
    LatencyProxy,
    error_response,
    is_final_response,
    is_request_start,
)
from testing.s3 import LocalS3Server, local_credentials_env, make_bucket
from tests.mounts import wait_for

REPO = Path(__file__).resolve().parents[2]

SMALL = b"s" * 1000
MEDIUM = bytes(range(256)) * 1200          # 300 KiB


@pytest.fixture(scope="module")
def moto():
    with LocalS3Server() as server:
        bucket = f"proxy-{uuid.uuid4().hex[:12]}"
        make_bucket(server.endpoint_url, bucket)
        client = client_for(server.endpoint_url)
        client.put_object(Bucket=bucket, Key="small", Body=SMALL)
        client.put_object(Bucket=bucket, Key="medium", Body=MEDIUM)
        yield server, bucket


@pytest.fixture
def proxy(moto):
    server, _ = moto
    port = int(server.endpoint_url.rsplit(":", 1)[1])
    with LatencyProxy("127.0.0.1", port, latency=0.010) as p:
        yield p


def client_for(endpoint_url: str, attempts: int = 1, read_timeout: float = 10.0):
    creds = local_credentials_env()
    return boto3.client(
        "s3", endpoint_url=endpoint_url, region_name=creds["AWS_DEFAULT_REGION"],
        aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
        config=Config(s3={"addressing_style": "path"}, connect_timeout=2, read_timeout=read_timeout,
                      retries={"mode": "standard", "total_max_attempts": attempts}))


def timed_get(client, bucket: str, key: str) -> tuple[float, bytes]:
    start = time.monotonic()
    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    return time.monotonic() - start, body


# ---- the request-boundary heuristic --------------------------------------------------------------
def test_request_start_and_final_response_heuristics():
    assert is_request_start(b"GET /bucket/key HTTP/1.1\r\nHost: x\r\n\r\n")
    assert is_request_start(b"PUT /b/k HTTP/1.1\r\n")
    assert not is_request_start(b"\x89PNG binary body bytes")
    assert not is_final_response(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert is_final_response(b"HTTP/1.1 200 OK\r\n")
    assert is_final_response(b"HTTP/1.1 503 Slow Down\r\n")
    answer = error_response("503")
    assert answer.startswith(b"HTTP/1.1 503 Slow Down\r\n")
    assert b"<Code>SlowDown</Code>" in answer and b"Connection: close" in answer


# ---- latency, bandwidth, stragglers --------------------------------------------------------------
def test_latency_is_added_to_every_request(moto, proxy):
    _, bucket = moto
    client = client_for(proxy.endpoint_url)
    times = [timed_get(client, bucket, "small") for _ in range(5)]
    assert all(body == SMALL for _, body in times)
    assert min(t for t, _ in times) >= 0.010
    assert proxy.stats()["requests"] == 5


def test_bandwidth_caps_downloads(moto):
    server, bucket = moto
    port = int(server.endpoint_url.rsplit(":", 1)[1])
    with LatencyProxy("127.0.0.1", port, latency=0.0, bandwidth=1_000_000) as slow:
        seconds, body = timed_get(client_for(slow.endpoint_url), bucket, "medium")
    assert body == MEDIUM
    assert seconds >= 0.25            # 307 kB at 1 MB/s is >= 0.3 s


def test_streaming_upload_pays_latency_once(moto):
    """8 MiB is ~32 chunks: per-chunk delays in sequence would take >= 32 x 50 ms."""
    server, bucket = moto
    port = int(server.endpoint_url.rsplit(":", 1)[1])
    with LatencyProxy("127.0.0.1", port, latency=0.050) as p:
        client = client_for(p.endpoint_url)
        start = time.monotonic()
        client.put_object(Bucket=bucket, Key="upload", Body=b"u" * (8 << 20))
        seconds = time.monotonic() - start
    assert 0.050 <= seconds < 1.2


def test_stragglers_get_extra_delay(moto, proxy):
    _, bucket = moto
    client = client_for(proxy.endpoint_url)
    proxy.stragglers(1.0, 0.2)
    slow, _ = timed_get(client, bucket, "small")
    proxy.stragglers(0.0, 0.0)
    fast, _ = timed_get(client, bucket, "small")
    assert slow >= 0.2
    assert proxy.stats()["stragglers"] == 1
    assert fast < slow


# ---- faults --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "status", "code"), [("503", 503, "SlowDown"),
                                                      ("500", 500, "InternalError")])
def test_http_error_then_recovery(moto, proxy, kind, status, code):
    _, bucket = moto
    client = client_for(proxy.endpoint_url)
    proxy.fail_next(1, kind)
    with pytest.raises(botocore.exceptions.ClientError) as info:
        client.get_object(Bucket=bucket, Key="small")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
    assert info.value.response["Error"]["Code"] == code
    assert timed_get(client, bucket, "small")[1] == SMALL
    assert proxy.stats()["faults"] == {kind: 1}


def test_retrying_client_rides_over_503s(moto, proxy):
    _, bucket = moto
    proxy.fail_next(2, "503")
    assert timed_get(client_for(proxy.endpoint_url, attempts=3), bucket, "small")[1] == SMALL
    stats = proxy.stats()
    assert stats["requests"] == 3 and stats["faults_total"] == 2


def test_reset_breaks_the_request(moto, proxy):
    _, bucket = moto
    client = client_for(proxy.endpoint_url)
    proxy.fail_next(1, "reset")
    with pytest.raises(botocore.exceptions.ConnectionClosedError):
        client.get_object(Bucket=bucket, Key="small")
    assert timed_get(client, bucket, "small")[1] == SMALL
    assert proxy.stats()["faults"] == {"reset": 1}


def test_hang_times_out(moto, proxy):
    _, bucket = moto
    client = client_for(proxy.endpoint_url, read_timeout=0.5)
    proxy.fail_next(1, "hang")
    start = time.monotonic()
    with pytest.raises(botocore.exceptions.ReadTimeoutError):
        client.get_object(Bucket=bucket, Key="small")
    assert time.monotonic() - start >= 0.5
    assert timed_get(client, bucket, "small")[1] == SMALL


REFUSED = {  # "close" resets an accepted connection: before or after the request went out
    "stop": botocore.exceptions.EndpointConnectionError,
    "close": (botocore.exceptions.ConnectionError, botocore.exceptions.ConnectionClosedError),
}


@pytest.mark.parametrize("mode", ["stop", "close"])
def test_refuse_then_restore(moto, proxy, mode):
    _, bucket = moto
    client = client_for(proxy.endpoint_url)
    proxy.refuse(True, mode=mode)
    with pytest.raises(REFUSED[mode]):
        client.get_object(Bucket=bucket, Key="small")
    proxy.refuse(False)
    assert timed_get(client, bucket, "small")[1] == SMALL


def test_fail_next_rejects_unknown_kinds(proxy):
    with pytest.raises(ValueError):
        proxy.fail_next(1, "teapot")


# ---- CLI -----------------------------------------------------------------------------------------
def test_cli_prints_its_port_and_proxies(moto):
    server, bucket = moto
    upstream = server.endpoint_url.split("://", 1)[1]
    proc = subprocess.Popen([sys.executable, str(REPO / "testing" / "latency_proxy.py"),
                             "--upstream", upstream, "--listen", "127.0.0.1:0", "--latency-ms", "10"],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline().strip().removeprefix("port="))
        _, body = timed_get(client_for(f"http://127.0.0.1:{port}"), bucket, "small")
        assert body == SMALL
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
        proc.stdout.close()


# ---- faults in the server's answer, random schedules, restarts ------------------------------------
STREAM_ERRORS = (botocore.exceptions.IncompleteReadError, botocore.exceptions.ResponseStreamingError,
                 botocore.exceptions.ReadTimeoutError)


def test_503_carries_retry_after(moto, proxy):
    _, bucket = moto
    proxy.fail_next(1, "503")
    with pytest.raises(botocore.exceptions.ClientError) as info:
        client_for(proxy.endpoint_url).get_object(Bucket=bucket, Key="small")
    assert info.value.response["ResponseMetadata"]["HTTPHeaders"]["retry-after"] == "1"


@pytest.mark.parametrize("kind", ["reset-body", "truncate"])
def test_mid_body_faults_break_the_body_after_the_head(moto, proxy, kind):
    _, bucket = moto
    client = client_for(proxy.endpoint_url)
    proxy.fail_next(1, kind)
    answer = client.get_object(Bucket=bucket, Key="medium")       # the head arrives whole
    assert answer["ContentLength"] == len(MEDIUM)
    with pytest.raises(STREAM_ERRORS):
        answer["Body"].read()
    assert timed_get(client, bucket, "medium")[1] == MEDIUM
    assert proxy.stats()["faults"] == {kind: 1}


def test_truncated_body_is_short_by_half(moto, proxy):
    """A raw socket sees exactly head + half the body, then a clean end of stream."""
    import socket
    _, bucket = moto
    client = client_for(proxy.endpoint_url)
    url = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "medium"})
    path = url.split(str(proxy.port), 1)[1]
    proxy.fail_next(1, "truncate")
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{proxy.port}\r\n\r\n".encode())
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert b"Content-Length: %d" % len(MEDIUM) in head
    assert body == MEDIUM[:len(MEDIUM) // 2]


def test_stall_mid_body_times_out(moto, proxy):
    _, bucket = moto
    client = client_for(proxy.endpoint_url, read_timeout=0.5)
    proxy.fail_next(1, "stall-body")
    answer = client.get_object(Bucket=bucket, Key="medium")
    start = time.monotonic()
    with pytest.raises(STREAM_ERRORS):
        answer["Body"].read()
    assert time.monotonic() - start >= 0.45
    assert timed_get(client, bucket, "medium")[1] == MEDIUM


def test_slow_first_byte_delays_then_answers_whole(moto, proxy):
    _, bucket = moto
    proxy.set_slow_first_byte(0.4)
    proxy.fail_next(1, "slow-first-byte")
    seconds, body = timed_get(client_for(proxy.endpoint_url), bucket, "medium")
    assert body == MEDIUM and seconds >= 0.4


def test_wrong_content_range_moves_the_header_not_the_body(moto, proxy):
    _, bucket = moto
    client = client_for(proxy.endpoint_url)
    proxy.fail_next(1, "wrong-range")
    answer = client.get_object(Bucket=bucket, Key="medium", Range="bytes=100-199")
    assert answer["ContentRange"] == f"bytes 101-200/{len(MEDIUM)}"
    assert answer["Body"].read() == MEDIUM[100:200]
    again = client.get_object(Bucket=bucket, Key="medium", Range="bytes=100-199")
    assert again["ContentRange"] == f"bytes 100-199/{len(MEDIUM)}"


def test_random_fault_schedule_is_seeded_and_counted(moto, proxy):
    _, bucket = moto
    client = client_for(proxy.endpoint_url)
    proxy.random_faults(0.5, ("503", "500"))
    failures = 0
    for _ in range(40):
        try:
            client.get_object(Bucket=bucket, Key="small")["Body"].read()
        except botocore.exceptions.ClientError:
            failures += 1
    stats = proxy.stats()
    assert stats["faults_total"] == failures and 8 <= failures <= 32
    assert set(stats["faults"]) <= {"503", "500"}
    proxy.clear_faults()
    assert timed_get(client, bucket, "small")[1] == SMALL
    assert proxy.stats()["faults_total"] == failures
    with pytest.raises(ValueError):
        proxy.random_faults(0.1, ("teapot",))


def test_restart_refuses_then_serves_again(moto, proxy):
    _, bucket = moto
    client = client_for(proxy.endpoint_url)
    proxy.restart(0.5)
    with pytest.raises(botocore.exceptions.EndpointConnectionError):
        client.get_object(Bucket=bucket, Key="small")
    time.sleep(0.8)
    assert timed_get(client, bucket, "small")[1] == SMALL
    assert proxy.stats()["restarts"] == 1


# ---- splice: answers moved in the kernel (the benchmarks' proxy) -----------------------------------
@pytest.fixture
def spliced(moto):
    server, _ = moto
    port = int(server.endpoint_url.rsplit(":", 1)[1])
    with LatencyProxy("127.0.0.1", port, latency=0.010, splice=True) as p:
        yield p


def splice_threads() -> int:
    return sum(t.name == "proxy-splice" for t in threading.enumerate())


def test_splice_carries_every_byte_and_adds_latency(moto, spliced):
    _, bucket = moto
    client = client_for(spliced.endpoint_url)
    big = bytes(range(251)) * (40 << 10)                     # 10 MiB, through 1 MiB pipes
    client.put_object(Bucket=bucket, Key="big", Body=big)
    times = [timed_get(client, bucket, key) for key in ("small", "medium", "big", "small")]
    assert [body for _, body in times] == [SMALL, MEDIUM, big, SMALL]
    assert min(t for t, _ in times) >= 0.010
    assert spliced.stats()["requests"] == 5                  # one connection, every request counted


def test_splice_keeps_request_faults_and_ends_its_threads(moto, spliced):
    _, bucket = moto
    client = client_for(spliced.endpoint_url, read_timeout=0.5)
    for kind, error in (("503", botocore.exceptions.ClientError),
                        ("reset", botocore.exceptions.ConnectionClosedError),
                        ("hang", botocore.exceptions.ReadTimeoutError)):
        spliced.fail_next(1, kind)
        with pytest.raises(error):
            client.get_object(Bucket=bucket, Key="small")
        assert timed_get(client, bucket, "small")[1] == SMALL
    spliced.refuse(True)
    with pytest.raises(botocore.exceptions.EndpointConnectionError):
        client.get_object(Bucket=bucket, Key="small")
    spliced.refuse(False)
    assert timed_get(client, bucket, "small")[1] == SMALL
    with pytest.raises(ValueError):                          # answers are not parsed: no answer faults
        spliced.fail_next(1, "truncate")
    assert spliced.stats()["faults"] == {"503": 1, "reset": 1, "hang": 1}
    spliced.close()
    wait_for(lambda: splice_threads() == 0, timeout=5)


def test_splice_refuses_a_bandwidth_cap(moto):
    with pytest.raises(ValueError):
        LatencyProxy("127.0.0.1", 1, bandwidth=1e6, splice=True)


def test_cli_splice(moto):
    server, bucket = moto
    upstream = server.endpoint_url.split("://", 1)[1]
    proc = subprocess.Popen([sys.executable, str(REPO / "testing" / "latency_proxy.py"), "--upstream", upstream,
                             "--latency-ms", "10", "--splice"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline().strip().removeprefix("port="))
        assert timed_get(client_for(f"http://127.0.0.1:{port}"), bucket, "medium")[1] == MEDIUM
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
        proc.stdout.close()
