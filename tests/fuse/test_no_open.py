"""Zero-message opens (`--fuse-no-open`) on real mounts against the S3 test server: the kernel
opens every file itself, a read that misses the page cache reaches the daemon with no handle and
gets the right bytes, a file in the page cache is read with no request at all, and the control
file (status, warmup) works with no OPEN, one session per calling thread."""

import random
import threading
import urllib.request

import pytest
from mounts import cachefs, put_tree

from cachefs.control import client
from testing.s3 import free_port, s3_client

pytestmark = pytest.mark.fuse

FILES = {f"c{i % 4}/f{i:03d}.jpg": random.Random(i).randbytes(500 + 1531 * i) for i in range(48)}


def ops(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    prefix = 'cachefs_fuse_operations_total{op="'
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def test_files_open_with_no_request_and_a_second_pass_reaches_no_daemon(s3_server, bucket, mount_factory):
    put_tree(s3_client(s3_server.endpoint_url), bucket, "ds", FILES)
    port = free_port()
    mnt = mount_factory(f"s3://{bucket}/ds", "--endpoint-url", s3_server.endpoint_url, "--immutable",
                        "--fuse-no-open", "--metrics-port", str(port)).start()
    assert {p: (mnt / p).read_bytes() for p in FILES} == FILES       # cold: READs with no handle
    first = ops(port)
    assert first.get("open", 0) <= 1 and first["read"] >= len(FILES)  # one OPEN answered ENOSYS at most
    assert {p: (mnt / p).read_bytes() for p in FILES} == FILES       # the page cache: not one request
    again = ops(port)
    assert again.get("read") == first["read"] and again.get("open", 0) == first.get("open", 0)
    with open(mnt / "c1/f001.jpg", "rb") as f:                       # seeks within a file opened so
        f.seek(700)
        assert f.read(900) == FILES["c1/f001.jpg"][700:1600]

    answers, errors = [], []

    def status():
        try:
            answers.append(cachefs("status", str(mnt.path), "--json").returncode)
        except Exception as exc:          # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=status) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and answers == [0, 0, 0, 0]
    for _ in range(3):                    # one thread, request after request: a session each
        assert client.hello(str(mnt.path))["version"]
        assert list(client.request(str(mnt.path), "status"))
    warm = cachefs("warmup", "-q", str(mnt.path))
    assert warm.returncode == 0, warm.stderr
    assert cachefs("status", str(mnt.path)).returncode == 0           # the control file again, same thread
    mnt.umount()
