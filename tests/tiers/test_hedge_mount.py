"""Hedged GETs on a real mount: a read whose GET straggles (held by the latency proxy in front of
moto) is answered by the hedge in about the hedge delay plus one normal GET, not the straggler's
delay, and the metrics count it."""

import os
import random
import threading
import time
from urllib.parse import urlparse

import pytest
from mounts import put_tree

from testing.latency_proxy import LatencyProxy
from testing.s3 import s3_client

pytestmark = [pytest.mark.fuse]

STRAGGLE_S = 8.0
MIN_DELAY_S = 0.3         # well above a loopback GET, so only the straggler is hedged


def test_a_straggling_read_is_answered_by_the_hedge(s3_server, bucket, mount_factory):
    files = {f"f{i:02d}.bin": random.Random(i).randbytes(20_000 + i) for i in range(40)}
    put_tree(s3_client(s3_server.endpoint_url), bucket, "", files)
    url = urlparse(s3_server.endpoint_url)
    with LatencyProxy(url.hostname, url.port, latency=0.002) as proxy:
        mnt = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint_url, "--immutable",
                            "--hedge-min-delay", str(MIN_DELAY_S), "--hedge-budget", "0.05").start()
        names = sorted(os.listdir(mnt.path))
        for name in names[:30]:                  # enough GETs for the delay estimate and a budget token
            assert (mnt / name).read_bytes() == files[name]
        delay = mnt.status()["tiers"]["hedge"]["delay_ms"]["le64k"] / 1000
        assert MIN_DELAY_S <= delay < 2.0        # the floor, unless this machine's p95 is above it
        gets_before = mnt.requests("get")

        proxy.stragglers(1.0, STRAGGLE_S)         # the next request straggles ...
        seen = proxy.stats()["requests"]
        result: dict = {}

        def read() -> None:
            started = time.monotonic()
            result["data"] = (mnt / names[30]).read_bytes()
            result["elapsed"] = time.monotonic() - started

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 5
        while proxy.stats()["requests"] == seen and time.monotonic() < deadline:
            time.sleep(0.001)
        proxy.stragglers(0.0, 0.0)                # ... and only that one (the hedge comes >= 0.3 s later)
        assert proxy.stats()["stragglers"] == 1
        reader.join(STRAGGLE_S + 5)

        assert result["data"] == files[names[30]]
        assert delay <= result["elapsed"] < delay + 1.5, (result["elapsed"], delay)
        hedge = mnt.status()["tiers"]["hedge"]
        assert hedge["won"] == 1 and hedge["lost"] == 0 and hedge["failed"] == 0
        assert mnt.requests("get") == gets_before + 2       # the straggler (cancelled) and its hedge
        requests = mnt.status()["store_requests"]
        assert requests.get("get cancelled") == 1 and "get error" not in requests, requests   # never an error
        for name in names[31:]:                              # the mount goes on as before
            assert (mnt / name).read_bytes() == files[name]
        assert mnt.status()["tiers"]["hedge"]["won"] == 1


def test_hedges_that_lose_are_counted_lost_and_never_as_get_errors(s3_server, bucket, mount_factory):
    """GETs hedged at the median latency (no floor, full budget), one in five straggling: hedges win
    the stragglers and lose to the others, and the loser of each pair is cancelled, some while still
    connecting (a cancellation trio wraps in a group). Each counts as a cancelled GET; none as an
    error."""
    files = {f"f{i:02d}.bin": random.Random(i).randbytes(20_000 + i) for i in range(60)}
    put_tree(s3_client(s3_server.endpoint_url), bucket, "", files)
    url = urlparse(s3_server.endpoint_url)
    with LatencyProxy(url.hostname, url.port, latency=0.01) as proxy:
        mnt = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint_url, "--immutable",
                            "--hedge-min-delay", "0", "--hedge-budget", "1", "--hedge-percentile", "50").start()
        names = sorted(os.listdir(mnt.path))
        for name in names[:20]:                   # the latency estimate
            assert (mnt / name).read_bytes() == files[name]
        proxy.stragglers(0.2, 0.3)
        for name in names[20:]:
            assert (mnt / name).read_bytes() == files[name]
        status = mnt.status()
    hedge, requests = status["tiers"]["hedge"], status["store_requests"]
    assert hedge["lost"] + hedge["won"] >= 3, hedge
    assert "get error" not in requests, requests
    assert requests["get 200"] >= 60 and requests.get("get cancelled", 0) == hedge["lost"] + hedge["won"], \
        (hedge, requests)
