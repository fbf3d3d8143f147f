"""Faults on a real mount: object-store errors, outages and hangs (through the fault-injecting
proxy), and a full or failing cache disk. A fault fails at most the read it hits; the daemon
keeps serving (docs/design.md, invariant 4)."""

import errno
import os
import random
import time
from urllib.parse import urlparse

import pytest
from mounts import put_tree, tmpfs

from testing.latency_proxy import LatencyProxy
from testing.s3 import s3_client

pytestmark = [pytest.mark.fuse, pytest.mark.allow_warnings]

BLOCK = 64 * 1024


@pytest.fixture
def proxied(s3_server, bucket):
    url = urlparse(s3_server.endpoint_url)
    with LatencyProxy(url.hostname, url.port, latency=0.0) as proxy:
        files = {f"f{i}.bin": random.Random(i).randbytes(100_000 + i) for i in range(6)}
        put_tree(s3_client(s3_server.endpoint_url), bucket, "", files)
        yield proxy, bucket, files


def mount_via(proxy, bucket, mount_factory, *extra, **kwargs):
    return mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint_url, "--block-size", str(BLOCK),
                         "--connect-timeout", "1", "--read-timeout", "2", *extra, **kwargs).start()


def test_503_slowdown_and_resets_are_retried(proxied, mount_factory):
    proxy, bucket, files = proxied
    mnt = mount_via(proxy, bucket, mount_factory, "--max-attempts", "5")
    os.listdir(mnt.path)
    proxy.fail_next(2, "503")
    assert (mnt / "f0.bin").read_bytes() == files["f0.bin"]
    proxy.fail_next(1, "reset")
    assert (mnt / "f1.bin").read_bytes() == files["f1.bin"]
    proxy.fail_next(1, "500")
    assert (mnt / "f2.bin").read_bytes() == files["f2.bin"]
    status = mnt.status()["store_requests"]
    assert status.get("get 503") == 2 and status.get("get 500") == 1, status


def test_outage_fails_only_uncached_reads_and_recovers(proxied, mount_factory):
    proxy, bucket, files = proxied
    mnt = mount_via(proxy, bucket, mount_factory, "--max-attempts", "2")
    assert (mnt / "f0.bin").read_bytes() == files["f0.bin"]
    proxy.refuse(True)
    try:
        started = time.monotonic()
        with pytest.raises(OSError) as info:
            (mnt / "f1.bin").read_bytes()
        assert info.value.errno == errno.EIO
        assert time.monotonic() - started < 20
        assert (mnt / "f0.bin").read_bytes() == files["f0.bin"]      # cached: still served
    finally:
        proxy.refuse(False)
    assert (mnt / "f1.bin").read_bytes() == files["f1.bin"]          # the daemon kept serving


def test_hung_request_times_out(proxied, mount_factory):
    proxy, bucket, files = proxied
    mnt = mount_via(proxy, bucket, mount_factory, "--max-attempts", "1")
    os.listdir(mnt.path)
    proxy.fail_next(1, "hang")
    started = time.monotonic()
    # The hung GET times out (read_timeout 2 s) and fails that FUSE read; the kernel retries a
    # failed readahead page with a synchronous read, which then succeeds.
    assert (mnt / "f3.bin").read_bytes() == files["f3.bin"]
    assert time.monotonic() - started < 15
    assert mnt.status()["store_requests"].get("get error") == 1


@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MiB tmpfs for the cache dir, always unmounted."""
    with tmpfs(tmp_path / "tiny", "1m") as path:
        yield path


def test_full_cache_disk_never_fails_a_read(proxied, mount_factory, tiny_fs):
    proxy, bucket, files = proxied
    mnt = mount_via(proxy, bucket, mount_factory, "--cache-size", "10G", "--log-file",
                    str(tiny_fs.parent / "log"), cache_dir=tiny_fs / "cache")
    for _ in range(2):
        for name, data in files.items():
            assert (mnt / name).read_bytes() == data
    disk = mnt.status()["tiers"]["disk"]
    statvfs = os.statvfs(tiny_fs)
    assert statvfs.f_bavail / statvfs.f_blocks >= 0.09         # the free-space watermark held
    assert disk["used_bytes"] < 1 << 20


def test_failing_cache_disk_is_fenced_and_reads_go_on(proxied, mount_factory):
    proxy, bucket, files = proxied
    mnt = mount_via(proxy, bucket, mount_factory)
    blocks = mnt.cache_dir / "blocks"
    blocks.rename(mnt.cache_dir / "blocks.gone")    # every disk-tier write now fails
    blocks.write_text("not a directory")
    for name, data in files.items():
        assert (mnt / name).read_bytes() == data
    disk = mnt.status()["tiers"]["disk"]
    assert disk["health"] in ("unstable", "down"), disk
    for name, data in files.items():                 # served again (memory tier / store)
        assert (mnt / name).read_bytes() == data


def test_store_outage_after_the_ttl_still_serves_cached_files(proxied, mount_factory):
    proxy, bucket, files = proxied
    mnt = mount_via(proxy, bucket, mount_factory, "--max-attempts", "1", "--metadata-ttl", "1")
    assert (mnt / "f0.bin").read_bytes() == files["f0.bin"]
    proxy.refuse(True)
    try:
        time.sleep(1.3)                                   # listing and attributes are stale now
        started = time.monotonic()
        assert (mnt / "f0.bin").read_bytes() == files["f0.bin"]      # known version, cached blocks
        assert sorted(os.listdir(mnt.path)) == sorted(files)          # the previous listing
        assert time.monotonic() - started < 10
        with pytest.raises(OSError):
            (mnt / "f5.bin").read_bytes()                              # never fetched: EIO
    finally:
        proxy.refuse(False)
    assert (mnt / "f5.bin").read_bytes() == files["f5.bin"]
