"""Writes on real mounts against moto: what is written reaches the bucket intact, the two sync
classes keep their periods, crashes (SIGKILL) lose nothing acknowledged, outages are ridden out."""

import errno
import hashlib
import io
import json
import logging
import os
import random
import shutil
import subprocess
import tarfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
from mounts import cachefs, put_tree

from cachefs.control.client import request
from testing.latency_proxy import LatencyProxy
from testing.s3 import s3_client

pytestmark = pytest.mark.fuse

MIB = 1 << 20


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def bucket_tree(client, bucket: str, prefix: str = "") -> dict[str, bytes]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            if not obj["Key"].endswith("/"):
                out[obj["Key"][len(prefix):]] = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return out


def digests(tree: dict[str, bytes]) -> dict[str, str]:
    """Path -> "size:md5": what tree comparisons assert (pytest would diff megabytes of bytes)."""
    return {path: f"{len(data)}:{md5(data)}" for path, data in tree.items()}


def local_tree(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            full = Path(dirpath) / name
            if name != ".cachefs-control":
                out[str(full.relative_to(root))] = full.read_bytes()
    return out


def sync(mnt, *args: str) -> dict:
    result = cachefs("sync", str(mnt.path), "--wait", "--timeout", "120", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    return mnt.status()["writeback"]


def writable(mount_factory, server, bucket, *extra, prefix="out", **kwargs):
    return mount_factory(f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}", "--endpoint-url",
                         server.endpoint_url, "--block-size", str(256 << 10), "--upload-part-size", "5M",
                         *extra, **kwargs)


@pytest.fixture
def seeded(s3_server, bucket):
    client = s3_client(s3_server.endpoint_url)
    put_tree(client, bucket, "out", {"old/a.txt": b"original a\n", "old/b.bin": random.Random(2).randbytes(300_000),
                                     "keep.json": b"{}"})
    return s3_server, bucket, client


# ---- everything written reaches the bucket ------------------------------------------------------

def tensorboard_like(path: Path, events: int) -> None:
    """Length-prefixed records appended and flushed, as TensorBoard's event writer does."""
    with open(path, "ab") as fh:
        for step in range(events):
            body = json.dumps({"step": step, "loss": 1.0 / (step + 1)}).encode()
            fh.write(len(body).to_bytes(8, "little") + body)
            fh.flush()


def torch_save_like(path: Path, payload: bytes) -> None:
    """torch.save writes a zip archive through a seekable file object (seeks back to patch headers).
    Fixed member timestamps: the mount and the reference are written seconds apart."""
    import zipfile
    stamp = (2024, 1, 1, 0, 0, 0)
    with open(path, "wb") as fh, zipfile.ZipFile(fh, "w") as zf:
        zf.writestr(zipfile.ZipInfo("archive/data.pkl", stamp), payload[:1000])
        zf.writestr(zipfile.ZipInfo("archive/data/0", stamp), payload)


def exercise(root: Path, scratch: Path) -> None:
    """The same workload, run on the mount and on a local directory."""
    rng = random.Random(7)
    (root / "runs").mkdir()
    (root / "runs/train.log").write_text("")
    logger = logging.getLogger(f"writeback-test-{root}")
    handler = logging.FileHandler(root / "runs/train.log")
    logger.addHandler(handler)
    logger.propagate = False
    for i in range(20):
        logger.error("step %d loss %.3f", i, 1 / (i + 1))
    handler.close()
    tensorboard_like(root / "runs/events.out.tfevents.123.host", 50)
    torch_save_like(root / "runs/model.pt", rng.randbytes(6 * MIB + 3))
    big = bytearray(rng.randbytes(2 * MIB))
    with open(root / "random.bin", "wb") as fh:          # random-offset writes
        fh.write(big)
        for _ in range(50):
            off = rng.randrange(0, 3 * MIB)
            chunk = rng.randbytes(rng.randrange(1, 70_000))
            fh.seek(off)
            fh.write(chunk)
    with open(root / "old/a.txt", "a") as fh:
        fh.write("appended\n")
    os.truncate(root / "old/b.bin", 1000)
    os.rename(root / "keep.json", root / "runs/moved.json")
    (root / "gone.txt").write_text("soon gone")
    os.unlink(root / "gone.txt")
    (root / "empty").mkdir()
    (root / "tmpdir").mkdir()
    os.rmdir(root / "tmpdir")
    shutil.copy(scratch / "src.bin", root / "copied.bin")
    with tarfile.open(scratch / "t.tar") as tar:
        tar.extractall(root / "untarred", filter="data")
    os.truncate(root / "runs/sparse.bin", 0) if (root / "runs/sparse.bin").exists() else None
    with open(root / "runs/sparse.bin", "wb") as fh:
        fh.truncate(100_000)
        fh.seek(50_000)
        fh.write(b"middle")


@pytest.fixture
def scratch(tmp_path):
    path = tmp_path / "scratch"
    path.mkdir()
    (path / "src.bin").write_bytes(random.Random(3).randbytes(3 * MIB + 17))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(30):
            data = random.Random(i).randbytes(random.Random(i).randrange(0, 20_000))
            info = tarfile.TarInfo(f"d{i % 3}/f{i}.dat")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (path / "t.tar").write_bytes(buf.getvalue())
    return path


def test_everything_written_reaches_the_bucket_intact(seeded, mount_factory, tmp_path, scratch):
    server, bucket, client = seeded
    reference = tmp_path / "reference"
    reference.mkdir()
    put_tree_local(reference, {"old/a.txt": b"original a\n", "old/b.bin": random.Random(2).randbytes(300_000),
                               "keep.json": b"{}"})
    exercise(reference, scratch)
    mnt = writable(mount_factory, server, bucket).start()
    exercise(mnt.path, scratch)
    expected = local_tree(reference)
    assert digests(local_tree(mnt.path)) == digests(expected)   # reads see the writes at once
    assert sorted(os.listdir(mnt.path)) == sorted(os.listdir(reference))
    wb = sync(mnt)
    assert wb["staged_files"] == 0 and wb["pending_operations"] == 0, wb
    in_bucket = bucket_tree(client, bucket, "out/")
    assert {p: md5(d) for p, d in in_bucket.items()} == {p: md5(d) for p, d in expected.items()}
    assert "out/empty/" in {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="out/")["Contents"]}
    mnt.umount()
    again = writable(mount_factory, server, bucket, name="again", cache_dir=tmp_path / "cache2").start()
    assert digests(local_tree(again.path)) == digests(expected)
    assert (again / "empty").is_dir()


def put_tree_local(root: Path, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)


def test_unsupported_operations_return_clear_errnos(seeded, mount_factory):
    server, bucket, client = seeded
    mnt = writable(mount_factory, server, bucket).start()
    (mnt / "f.txt").write_text("x")
    cases = [(lambda: os.link(mnt / "f.txt", mnt / "hard"), errno.EPERM),
             (lambda: os.symlink("f.txt", mnt / "sym"), errno.EPERM),
             (lambda: os.mkfifo(mnt / "fifo"), errno.EPERM),
             (lambda: os.rename(mnt / "old", mnt / "new"), errno.EXDEV),
             (lambda: os.rmdir(mnt / "old"), errno.ENOTEMPTY),
             (lambda: os.mkdir(mnt / "old"), errno.EEXIST),
             (lambda: os.unlink(mnt / "old"), errno.EISDIR)]
    for action, code in cases:
        with pytest.raises(OSError) as info:
            action()
        assert info.value.errno == code, action
    subprocess.run(["mv", str(mnt / "old"), str(mnt / "new")], check=True)   # mv copes with EXDEV
    assert sorted(os.listdir(mnt / "new")) == ["a.txt", "b.bin"] and not (mnt / "old").exists()
    sync(mnt)
    assert sorted(bucket_tree(client, bucket, "out/")) == ["f.txt", "keep.json", "new/a.txt", "new/b.bin"]


# ---- sync classes --------------------------------------------------------------------------------

def test_log_appended_every_100ms_shows_up_within_one_period(s3_server, bucket, mount_factory):
    client = s3_client(s3_server.endpoint_url)
    period = 1.0
    mnt = writable(mount_factory, s3_server, bucket, "--log-sync-period", str(period), prefix="").start()
    written: dict[int, float] = {}
    seen: dict[int, float] = {}
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            try:
                body = client.get_object(Bucket=bucket, Key="train.log")["Body"].read().decode()
            except client.exceptions.NoSuchKey:
                body = ""
            now = time.time()
            for line in body.splitlines():
                seen.setdefault(int(line.split()[1]), now)
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with open(mnt / "train.log", "a") as fh:
            for i in range(50):
                written[i] = time.time()
                fh.write(f"step {i}\n")
                fh.flush()
                time.sleep(0.1)
            time.sleep(period + 2)
    finally:
        stop.set()
        poller.join()
    lags = sorted(seen[i] - written[i] for i in written if i in seen)
    assert len(lags) == len(written), f"only {len(lags)} of {len(written)} lines reached the bucket"
    assert lags[int(len(lags) * 0.95)] <= period + 1.0, lags


def test_checkpoint_waits_for_quiet_period_and_newer_version_supersedes(s3_server, bucket, mount_factory):
    client = s3_client(s3_server.endpoint_url)
    mnt = writable(mount_factory, s3_server, bucket, "--checkpoint-quiet-period", "2", prefix="").start()
    first = random.Random(1).randbytes(12 * MIB)
    (mnt / "model.ckpt").write_bytes(first)
    time.sleep(0.5)
    assert "Contents" not in client.list_objects_v2(Bucket=bucket)        # not quiet yet
    status = mnt.status()["writeback"]["classes"]["checkpoint"]
    assert status["dirty_files"] == 1 and status["dirty_bytes"] == len(first)
    second = random.Random(2).randbytes(12 * MIB)
    (mnt / "model.ckpt").write_bytes(second)        # a newer version before the first went up
    deadline = time.time() + 30
    while time.time() < deadline and mnt.status()["writeback"]["staged_files"]:
        time.sleep(0.2)
    body = client.get_object(Bucket=bucket, Key="model.ckpt")["Body"].read()
    assert md5(body) == md5(second)
    ok = mnt.status()["writeback"]
    assert ok["classes"]["checkpoint"]["dirty_files"] == 0


def test_fsync_remote_returns_when_the_object_is_in_the_store(s3_server, bucket, mount_factory):
    client = s3_client(s3_server.endpoint_url)
    mnt = writable(mount_factory, s3_server, bucket, "--fsync", "remote", "--checkpoint-quiet-period", "600",
                   prefix="").start()
    data = random.Random(5).randbytes(7 * MIB)
    with open(mnt / "w.pt", "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
        assert md5(client.get_object(Bucket=bucket, Key="w.pt")["Body"].read()) == md5(data)


def test_staging_full_blocks_then_enospc(s3_server, bucket, mount_factory):
    url = urlparse(s3_server.endpoint_url)
    with LatencyProxy(url.hostname, url.port, latency=0.0) as proxy:
        mnt = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint_url, "--staging-size", "4M",
                            "--staging-wait", "1", "--max-attempts", "1").start()
        os.listdir(mnt.path)
        proxy.refuse(True)
        try:
            started = time.monotonic()
            with pytest.raises(OSError) as info:
                (mnt / "big.bin").write_bytes(b"x" * (6 * MIB))
            assert info.value.errno == errno.ENOSPC
            assert 1.0 <= time.monotonic() - started < 10
        finally:
            proxy.refuse(False)
            cachefs("umount", "--no-drain", str(mnt.path))


# ---- crashes ------------------------------------------------------------------------------------

def test_sigkill_during_a_large_write_and_after_close_loses_nothing(s3_server, bucket, mount_factory, tmp_path):
    client = s3_client(s3_server.endpoint_url)
    slow = ("--checkpoint-quiet-period", "600", "--log-sync-period", "600")
    mnt = writable(mount_factory, s3_server, bucket, *slow, prefix="").start()
    closed = random.Random(1).randbytes(9 * MIB)
    fsynced = random.Random(2).randbytes(1 * MIB)
    (mnt / "closed.pt").write_bytes(closed)
    with open(mnt / "fsynced.log", "wb") as fh:
        fh.write(fsynced)
        os.fsync(fh.fileno())
        writer = subprocess.Popen(["dd", "if=/dev/urandom", f"of={mnt / 'partial.bin'}", "bs=1M", "count=200"],
                                  stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        mnt.kill()                              # mid-write, with fsynced.log still open
    writer.wait(timeout=30)
    assert "Contents" not in client.list_objects_v2(Bucket=bucket)
    subprocess.run(["fusermount3", "-u", "-z", str(mnt.path)], check=False)
    visible: list[tuple[str, int, str]] = []
    stop = threading.Event()

    def watch():          # no partial object is ever visible
        while not stop.is_set():
            for obj in client.list_objects_v2(Bucket=bucket).get("Contents", []):
                if obj["Key"] == "closed.pt":
                    body = client.get_object(Bucket=bucket, Key="closed.pt")["Body"].read()
                    visible.append((obj["Key"], len(body), md5(body)))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        again = writable(mount_factory, s3_server, bucket, "--checkpoint-quiet-period", "0", prefix="",
                         name="again", cache_dir=mnt.cache_dir).start()
        sync(again)
    finally:
        stop.set()
        watcher.join()
    assert client.get_object(Bucket=bucket, Key="closed.pt")["Body"].read() == closed
    assert client.get_object(Bucket=bucket, Key="fsynced.log")["Body"].read() == fsynced
    partial = client.get_object(Bucket=bucket, Key="partial.bin")["Body"].read()
    assert len(partial) % (1 << 20) == 0 or len(partial) < 200 * MIB    # what reached staging, in order
    assert all(v == ("closed.pt", len(closed), md5(closed)) for v in visible), visible[:3]
    assert (again / "closed.pt").read_bytes() == closed


# ---- failing uploads --------------------------------------------------------------------------

@pytest.mark.allow_warnings
def test_failing_uploads_stay_staged_are_reported_and_recover(s3_server, bucket, mount_factory):
    client = s3_client(s3_server.endpoint_url)
    url = urlparse(s3_server.endpoint_url)
    with LatencyProxy(url.hostname, url.port, latency=0.0) as proxy:
        mnt = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint_url, "--max-attempts", "2",
                            "--connect-timeout", "1", "--read-timeout", "2", "--log-sync-period", "0.5",
                            "--upload-part-size", "5M").start()
        os.listdir(mnt.path)
        proxy.fail_next(3, "503")                    # a short burst: retried inside the store
        (mnt / "a.log").write_text("first\n")
        proxy.refuse(True)                           # an outage
        (mnt / "b.log").write_text("second\n")
        (mnt / "c.bin").write_bytes(random.Random(3).randbytes(11 * MIB))
        cachefs("sync", str(mnt.path))
        deadline = time.time() + 30
        while time.time() < deadline and not mnt.status()["writeback"]["failing"]:
            time.sleep(0.2)
        status = mnt.status()["writeback"]
        assert status["failing"] >= 1 and status["errors"], status
        shown = cachefs("status", str(mnt.path)).stdout
        assert "failing" in shown and "upload error" in shown
        result = cachefs("sync", str(mnt.path), "--wait", "--timeout", "2")
        assert result.returncode != 0 and "NOT synced" in result.stdout
        proxy.refuse(False)
        sync(mnt)
        mnt.umount()
    tree = bucket_tree(client, bucket)
    assert tree["a.log"] == b"first\n" and tree["b.log"] == b"second\n"
    assert tree["c.bin"] == random.Random(3).randbytes(11 * MIB)


def test_umount_drains_staged_files(s3_server, bucket, mount_factory):
    client = s3_client(s3_server.endpoint_url)
    mnt = writable(mount_factory, s3_server, bucket, "--checkpoint-quiet-period", "600", prefix="").start()
    (mnt / "late.pt").write_bytes(b"checkpoint")
    mnt.umount()
    assert client.get_object(Bucket=bucket, Key="late.pt")["Body"].read() == b"checkpoint"


def test_read_only_mount_reports_it(s3_server, bucket, mount_factory):
    put_tree(s3_client(s3_server.endpoint_url), bucket, "", {"x": b"1"})
    mnt = mount_factory(f"s3://{bucket}", "--endpoint-url", s3_server.endpoint_url, "--read-only").start()
    assert next(request(str(mnt.path), "status"))["writeback"] is None
    result = cachefs("sync", str(mnt.path))
    assert result.returncode == 2 and "read-only" in result.stderr
