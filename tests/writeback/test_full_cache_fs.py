"""A cache filesystem filled to the last byte by staged writes: the daemon that finds it so after a
crash still starts, uploads what was acknowledged and frees the space; writes refused on the full
filesystem were never acknowledged."""

import errno
import os
import random
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
from mounts import cachefs, fill, tmpfs, wait_for

from testing.latency_proxy import LatencyProxy
from testing.s3 import s3_client

pytestmark = pytest.mark.fuse

MIB = 1 << 20


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 24 MiB tmpfs for the cache dir; always unmounted (after the mounts that use it)."""
    with tmpfs(tmp_path / "small", "24m") as path:
        yield path


def test_a_daemon_killed_with_its_cache_filesystem_full_uploads_everything_after(small_fs, s3_server, bucket,
                                                                                 mount_factory):
    client = s3_client(s3_server.endpoint_url)
    cache = small_fs / "cache"
    common = (f"s3://{bucket}/out", "--block-size", str(256 << 10), "--cache-size", "64M")
    url = urlparse(s3_server.endpoint_url)
    acknowledged: dict[str, bytes] = {}
    with LatencyProxy(url.hostname, url.port, latency=0.0) as proxy:     # the store goes away: all stays staged
        mnt = mount_factory(*common, "--endpoint-url", proxy.endpoint_url, "--staging-size", "1G",
                            "--staging-wait", "0.5", "--max-attempts", "1", cache_dir=cache).start()
        (mnt / "ckpt").mkdir()
        proxy.refuse(True)
        rng = random.Random(7)
        refused = None
        for i in range(40):                        # 40 x 1 MiB does not fit in 24 MiB
            data = rng.randbytes(MIB)
            try:
                (mnt / f"ckpt/{i:02d}.pt").write_bytes(data)
            except OSError as exc:
                refused = exc
                break
            acknowledged[f"ckpt/{i:02d}.pt"] = data
        assert refused is not None and refused.errno == errno.ENOSPC, refused
        assert len(acknowledged) >= 5
        mnt.kill()
    subprocess.run(["fusermount3", "-u", "-z", str(mnt.path)], check=False)
    fill(small_fs / "filler")
    listed = client.list_objects_v2(Bucket=bucket, Prefix="out/").get("Contents", [])
    assert [o["Key"] for o in listed if o["Key"] != "out/ckpt/"] == []    # the marker may beat refuse()

    again = mount_factory(*common, "--endpoint-url", s3_server.endpoint_url, name="again", cache_dir=cache)
    result = again.try_start()
    assert result.returncode == 0, result.stderr
    assert "full" in result.stderr                 # said, not refused
    done = cachefs("sync", str(again.path), "--wait", "--timeout", "120")
    assert done.returncode == 0, done.stdout + done.stderr
    for path, data in acknowledged.items():
        assert client.get_object(Bucket=bucket, Key=f"out/{path}")["Body"].read() == data, path
    assert os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize >= 4 * MIB    # the uploads freed it
    (again / "after.log").write_bytes(b"written once there was room\n")
    done = cachefs("sync", str(again.path), "--wait", "--timeout", "120")
    assert done.returncode == 0, done.stdout + done.stderr
    assert client.get_object(Bucket=bucket, Key="out/after.log")["Body"].read() == b"written once there was room\n"
    again.umount()


def test_a_cache_filesystem_full_of_cached_blocks_mounts_and_evicts(small_fs, s3_server, bucket, mount_factory):
    client = s3_client(s3_server.endpoint_url)
    rng = random.Random(3)
    first = {f"a/{i:02d}.bin": rng.randbytes(256 << 10) for i in range(40)}        # 10 MiB, cached
    later = {f"b/{i:02d}.bin": rng.randbytes(256 << 10) for i in range(16)}        # read on the full fs
    for path, data in {**first, **later}.items():
        client.put_object(Bucket=bucket, Key=f"ds/{path}", Body=data)
    common = (f"s3://{bucket}/ds", "--endpoint-url", s3_server.endpoint_url, "--cache-size", "64M",
              "--mem-cache-size", "16M")
    cache = small_fs / "cache"
    mnt = mount_factory(*common, cache_dir=cache).start()
    for path, data in first.items():
        assert (mnt / path).read_bytes() == data
    cachefs("warmup", str(mnt.path / "a"))          # the fills are on disk before the unmount
    mnt.umount()
    fill(small_fs / "filler")

    again = mount_factory(*common, name="again", cache_dir=cache)
    result = again.try_start()
    assert result.returncode == 0, result.stderr
    assert "cached blocks to evict" in result.stderr
    for path, data in later.items():
        assert (again / path).read_bytes() == data, path
    wait_for(lambda: os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize >= 2 * MIB)   # evicted
    for path, data in first.items():
        assert (again / path).read_bytes() == data, path
    again.umount()
