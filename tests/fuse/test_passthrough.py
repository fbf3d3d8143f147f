"""FUSE passthrough from the disk tier, on real mounts against the S3 test server: a whole small
object cached as an exact file is read by the kernel itself (no READ reaches the daemon), only
after it was checked in this boot (read back as the disk tier wrote it, or verified before the
hand-over; sealed, so a later daemon trusts an unchanged file); a corrupted cache file is never
handed over (0 wrong bytes), sealed or not; mounts where it cannot apply say why; a handed-over file stays readable while open."""

import os
import random
import time
import urllib.request
from pathlib import Path

import pytest
from mounts import cachefs, mounted, put_tree, ramfs

from cachefs.tiers.disk import format as fmt
from testing.s3 import free_port, s3_client

pytestmark = pytest.mark.fuse

FILES = {f"c{i % 3}/f{i:03d}.jpg": random.Random(i).randbytes(1000 + 997 * i) for i in range(40)}


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("cachefs_")}


def reads(m: dict) -> float:
    return m.get('cachefs_fuse_operations_total{op="read"}', 0.0)


@pytest.fixture
def dataset(s3_server, bucket):
    put_tree(s3_client(s3_server.endpoint_url), bucket, "ds", FILES)
    return f"s3://{bucket}/ds", ("--endpoint-url", s3_server.endpoint_url)


def mount(mount_factory, url, args, port, *extra, **where):
    return mount_factory(url, *args, "--metrics-port", str(port), *extra, **where).start()


def read_all(root: Path) -> dict[str, bytes]:
    return {p: (root / p).read_bytes() for p in FILES}


def exact_files(cache_dir: Path) -> list[Path]:
    found = []
    for path in (cache_dir / "blocks").rglob("*"):
        if path.is_file():
            try:
                os.getxattr(path, fmt.XATTR)
                found.append(path)
            except OSError:
                pass
    return found


def test_cached_small_files_are_read_by_the_kernel_with_no_read_request(dataset, mount_factory):
    url, args = dataset
    port = free_port()
    mnt = mount(mount_factory, url, args, port, "--immutable")
    assert read_all(mnt.path) == FILES                     # cold: fetched, cached as exact files
    mnt.umount()
    assert len(exact_files(mnt.cache_dir)) == len(FILES)
    mnt.start()
    before = metrics(port)
    assert read_all(mnt.path) == FILES                     # every open handed over to the kernel
    after = metrics(port)
    assert after["cachefs_passthrough_opens_total"] - before.get("cachefs_passthrough_opens_total", 0) == len(FILES)
    assert reads(after) == reads(before)                   # not one READ reached the daemon
    # read back and checked as the first daemon wrote them, sealed: handed over with no read first
    assert after['cachefs_scrub_files_total{result="sealed"}'] == len(FILES)
    assert after.get('cachefs_scrub_files_total{result="ok"}', 0) == 0
    with open(mnt / "c0/f000.jpg", "rb") as one, open(mnt / "c0/f000.jpg", "rb") as two:   # one backing, shared
        assert one.read() == two.read() == FILES["c0/f000.jpg"]
    assert reads(metrics(port)) == reads(before)
    mnt.umount()
    mnt.args = (*mnt.args, "--no-passthrough-seals")      # every file verified before its hand-over
    mnt.start()
    assert read_all(mnt.path) == FILES
    m = metrics(port)
    assert m['cachefs_scrub_files_total{result="ok"}'] >= len(FILES) and reads(m) == 0
    assert m.get('cachefs_scrub_files_total{result="sealed"}', 0) == 0


@pytest.mark.allow_warnings          # the dropped cache files are logged
def test_corrupt_cache_files_are_never_handed_over(dataset, mount_factory):
    url, args = dataset
    port = free_port()
    mnt = mount(mount_factory, url, args, port, "--immutable")
    read_all(mnt.path)                                     # cached, read back as written and sealed
    mnt.umount()
    damaged = exact_files(mnt.cache_dir)[:8]
    for i, path in enumerate(damaged):       # a flipped byte, a truncation, a lost or garbled header
        if i % 4 == 0:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
            os.setxattr(path, fmt.XATTR, os.getxattr(path, fmt.XATTR))   # write_bytes kept it; be sure
        elif i % 4 == 1:
            os.truncate(path, path.stat().st_size - 1)
        elif i % 4 == 2:
            os.removexattr(path, fmt.XATTR)
        else:
            os.setxattr(path, fmt.XATTR, b"garbage")
    mnt.start()
    assert read_all(mnt.path) == FILES                     # 0 wrong bytes
    m = metrics(port)
    assert m["cachefs_passthrough_opens_total"] <= len(FILES) - len(damaged)
    assert m['cachefs_scrub_files_total{result="sealed"}'] <= len(FILES) - len(damaged)   # a seal no damage keeps
    assert m['cachefs_scrub_files_total{result="corrupt"}'] + m.get("cachefs_corrupt_blocks_total", 0) >= 2
    mnt.umount()
    mnt.start()                                            # the damaged ones were fetched again, intact
    assert read_all(mnt.path) == FILES


@pytest.mark.parametrize("flags, reason", [((), "mutable"), (("--immutable", "--passthrough", "off"), "off"),
                                           (("--immutable", "--fuse-backend", "pyfuse3"), "off")])
def test_mounts_that_cannot_pass_through_say_why_and_read_through_the_daemon(dataset, mount_factory, flags,
                                                                            reason):
    url, args = dataset
    port = free_port()
    mnt = mount(mount_factory, url, args, port, *flags)
    read_all(mnt.path)
    mnt.umount()
    mnt.start()
    before = metrics(port)
    assert read_all(mnt.path) == FILES
    m = metrics(port)
    assert m.get("cachefs_passthrough_opens_total", 0) == 0
    assert m[f'cachefs_passthrough_fallbacks_total{{reason="{reason}"}}'] == 1
    hits = 'cachefs_tier_hits_total{tier="disk"}'
    assert m[hits] - before.get(hits, 0) >= len(FILES)      # the daemon read every file from the disk tier


def overlay(path: Path):
    """An overlayfs mounted at ``path``: a stacked filesystem, whose files the kernel takes as
    backing files one level deep only."""
    layers = path.parent / "layers"
    for name in ("lower", "upper", "work"):
        (layers / name).mkdir(parents=True)
    return mounted(path, "overlay", "overlay", *(f"{name}dir={layers / name}" for name in ("lower", "upper", "work")))


def test_a_cache_dir_on_a_stacked_filesystem_falls_back_with_one_log_line(dataset, mount_factory, tmp_path):
    """A cache dir on overlayfs: the kernel refuses its cache files as backing files (ELOOP).
    The mount works and reads right, every read through the daemon; one log line says why (at
    the first hand-over: the first daemon read everything cold, only the second tried), the
    reason is counted once, and no later open tries again."""
    url, args = dataset
    port = free_port()
    with overlay(tmp_path / "cache-fs") as cache:
        mnt = mount(mount_factory, url, args, port, "--immutable", cache_dir=cache)
        assert read_all(mnt.path) == FILES                  # cold: fetched, cached
        mnt.umount()
        mnt.start()
        assert read_all(mnt.path) == FILES                  # from the disk tier, through the daemon
        m = metrics(port)
        assert m.get("cachefs_passthrough_opens_total", 0) == 0
        assert m['cachefs_passthrough_fallbacks_total{reason="stacking"}'] == 1, m
        assert m['cachefs_tier_hits_total{tier="disk"}'] >= len(FILES)
        mnt.umount()
        log = (cache / "cachefs.log").read_text()
    assert log.count("FUSE passthrough refused by the kernel (the cache dir is on a stacked filesystem") == 1, log


def test_a_cache_filesystem_without_user_extended_attributes_is_found_at_start(tmp_path):
    """Where cache files cannot keep their header in an attribute (ramfs here; vfat, some
    network filesystems), the disk tier finds it before its first write (``keeps_xattrs``),
    and writes its cache files with the header inside: no passthrough, one log line."""
    assert fmt.keeps_xattrs(tmp_path)
    with ramfs(tmp_path / "ramfs") as bare:
        assert not fmt.keeps_xattrs(bare)
        assert list(bare.iterdir()) == []                   # the probe leaves nothing


def test_a_handed_over_file_stays_readable_while_others_evict_around_it(dataset, mount_factory, s3_server, bucket):
    """A cache just big enough for a few files: the handed-over file's block is held while the
    kernel reads it, and the tier still never holds more than its size."""
    big = {f"big/{i}.bin": random.Random(100 + i).randbytes(200_000) for i in range(12)}
    put_tree(s3_client(s3_server.endpoint_url), bucket, "ds", big)
    url, args = dataset
    port = free_port()
    mnt = mount(mount_factory, url, args, port, "--immutable", "--cache-size", "1M", "--free-space-ratio", "0")
    assert (mnt / "c0/f000.jpg").read_bytes() == FILES["c0/f000.jpg"]
    mnt.umount()
    mnt.start()
    with open(mnt / "c0/f000.jpg", "rb") as held:
        assert metrics(port)["cachefs_passthrough_opens_total"] == 1
        for name, data in big.items():                      # 2.4 MB through a 1 MiB tier
            assert (mnt / name).read_bytes() == data
        assert held.read() == FILES["c0/f000.jpg"]
        status = mnt.status()["tiers"]["disk"]
        assert status["used_bytes"] <= 1 << 20, status
    assert (mnt / "c0/f000.jpg").read_bytes() == FILES["c0/f000.jpg"]


LARGE = random.Random(7).randbytes(5 * (1 << 20) + 12345)      # six 1 MiB blocks, the last short


def whole_files(cache_dir: Path) -> list[Path]:
    return [p for p in exact_files(cache_dir) if p.stat().st_size == len(LARGE)]


def wait_assembled(port: int, count: int) -> None:
    deadline = time.monotonic() + 30
    while metrics(port).get('cachefs_whole_files_total{result="assembled"}', 0) < count:
        assert time.monotonic() < deadline, "the large object was never written whole"
        time.sleep(0.05)


@pytest.mark.allow_warnings          # the corrupted whole-object file is logged as dropped
def test_a_large_object_is_written_whole_and_read_by_the_kernel_verified(s3_server, bucket, mount_factory):
    """Once every block of a large object is cached, an open writes it as one exact file in the
    background; from then on opens hand that file to the kernel (no READ reaches the daemon), only
    after it was verified in this boot; a corrupted one is dropped, never handed over."""
    put_tree(s3_client(s3_server.endpoint_url), bucket, "big", {"ckpt/model.safetensors": LARGE})
    port = free_port()
    mnt = mount(mount_factory, f"s3://{bucket}/big", ("--endpoint-url", s3_server.endpoint_url), port,
                "--immutable", "--block-size", "1M")
    assert (mnt / "ckpt/model.safetensors").read_bytes() == LARGE        # cold: six blocks cached
    assert (mnt / "ckpt/model.safetensors").read_bytes() == LARGE        # all cached: written whole
    wait_assembled(port, 1)
    with open(mnt / "ckpt/model.safetensors", "rb") as f:               # this daemon checked it as it wrote it
        assert f.read() == LARGE
        assert metrics(port)["cachefs_passthrough_opens_total"] == 1
    mnt.umount()
    [whole] = whole_files(mnt.cache_dir)
    assert whole.read_bytes() == LARGE and fmt.exact_header(os.open(whole, os.O_RDONLY)).data_len == len(LARGE)

    mnt.start()
    before = metrics(port)
    with open(mnt / "ckpt/model.safetensors", "rb") as f:
        f.seek(3 << 20)
        assert f.read(1 << 20) == LARGE[3 << 20:4 << 20]
        f.seek(0)
        assert f.read() == LARGE
    after = metrics(port)
    assert after["cachefs_passthrough_opens_total"] == 1
    assert reads(after) == reads(before)                                 # the kernel read it all itself
    assert after['cachefs_scrub_files_total{result="sealed"}'] == 1      # verified by the first daemon
    mnt.umount()

    data = bytearray(whole.read_bytes())                                 # one flipped byte in the last chunk
    data[-100] ^= 0xFF
    header = os.getxattr(whole, fmt.XATTR)
    whole.write_bytes(bytes(data))
    os.setxattr(whole, fmt.XATTR, header)
    mnt.start()
    assert (mnt / "ckpt/model.safetensors").read_bytes() == LARGE        # 0 wrong bytes: fetched again
    m = metrics(port)
    assert m.get("cachefs_passthrough_opens_total", 0) == 0
    assert m['cachefs_scrub_files_total{result="corrupt"}'] == 1
    wait_assembled(port, 1)                                              # written again from the blocks
    assert whole.read_bytes() == LARGE
    with open(mnt / "ckpt/model.safetensors", "rb") as f:
        assert f.read() == LARGE
    assert metrics(port)["cachefs_passthrough_opens_total"] == 1


def test_a_whole_file_replaces_its_blocks_and_serves_reads_through_the_daemon(s3_server, bucket, mount_factory):
    """Written whole, a large object's blocks leave the disk tier (it takes its bytes once); a
    mount that reads through the daemon (passthrough off) reads its blocks from the whole file,
    with no GET; `cachefs warmup` finds it cached; evicting it drops the whole file."""
    put_tree(s3_client(s3_server.endpoint_url), bucket, "big", {"ckpt/model.safetensors": LARGE})
    port = free_port()
    mnt = mount(mount_factory, f"s3://{bucket}/big", ("--endpoint-url", s3_server.endpoint_url), port,
                "--immutable", "--block-size", "1M")
    assert (mnt / "ckpt/model.safetensors").read_bytes() == LARGE
    wait_assembled(port, 1)                                              # the end of the read asked for it
    status = mnt.status()["tiers"]["disk"]
    assert status["blocks"] == 1 and status["used_bytes"] < len(LARGE) + (64 << 10), status
    mnt.umount()

    mnt.args = [*mnt.args, "--passthrough", "off"]
    mnt.start()
    gets = mnt.requests("get")
    with open(mnt / "ckpt/model.safetensors", "rb") as f:
        f.seek(2 << 20)
        assert f.read(300_000) == LARGE[2 << 20:(2 << 20) + 300_000]
        f.seek(0)
        assert f.read() == LARGE
    assert mnt.requests("get") == gets                                   # every block from the whole file
    m = metrics(port)
    assert m.get("cachefs_passthrough_opens_total", 0) == 0 and reads(m) > 0
    result = cachefs("warmup", "--json", str(mnt / "ckpt"))
    assert result.returncode == 0, result.stderr
    assert '"fetched_files": 0' in result.stdout and mnt.requests("get") == gets
    result = cachefs("warmup", "--evict", str(mnt / "ckpt/model.safetensors"))
    assert result.returncode == 0, result.stderr
    assert not whole_files(mnt.cache_dir) and mnt.status()["tiers"]["disk"]["blocks"] == 0
    assert (mnt / "ckpt/model.safetensors").read_bytes() == LARGE


def test_a_warmup_writes_large_objects_whole_so_their_first_open_is_handed_over(s3_server, bucket, mount_factory):
    put_tree(s3_client(s3_server.endpoint_url), bucket, "big", {"ckpt/model.safetensors": LARGE})
    port = free_port()
    mnt = mount(mount_factory, f"s3://{bucket}/big", ("--endpoint-url", s3_server.endpoint_url), port,
                "--immutable", "--block-size", "1M")
    result = cachefs("warmup", str(mnt / "ckpt"))
    assert result.returncode == 0, result.stderr
    wait_assembled(port, 1)
    before = metrics(port)
    assert (mnt / "ckpt/model.safetensors").read_bytes() == LARGE
    after = metrics(port)
    assert after["cachefs_passthrough_opens_total"] == 1 and reads(after) == reads(before)


@pytest.mark.allow_warnings          # the killed daemon's successor logs the takeover
def test_a_daemon_killed_while_writing_a_whole_file_loses_nothing(s3_server, bucket, mount_factory):
    """SIGKILL of the daemon at several points of writing a whole-object file: the object reads
    right every time, and what is left in the cache is either its blocks or a whole file that
    passes its check, never a torn file; no temp file outlives a restart."""
    data = random.Random(11).randbytes(24 << 20)
    put_tree(s3_client(s3_server.endpoint_url), bucket, "big", {"ckpt/model.safetensors": data})
    port = free_port()
    mnt = mount(mount_factory, f"s3://{bucket}/big", ("--endpoint-url", s3_server.endpoint_url), port,
                "--immutable", "--block-size", "1M")
    for delay in (0.0, 0.02, 0.1, 0.3):
        assert (mnt / "ckpt/model.safetensors").read_bytes() == data      # its close asks for the whole file
        time.sleep(delay)
        mnt.kill_daemon()
        assert (mnt / "ckpt/model.safetensors").read_bytes() == data
    mnt.umount()
    mnt.start()
    with open(mnt / "ckpt/model.safetensors", "rb") as f:
        assert f.read() == data
    mnt.umount()
    assert not list((mnt.cache_dir / "blocks" / "tmp").iterdir())
    for path in (mnt.cache_dir / "blocks" / "blocks").rglob("*"):
        if path.is_file() and path.stat().st_size == len(data):
            fd = os.open(path, os.O_RDONLY)
            try:
                header = fmt.exact_header(fd)
                header.verify(0, memoryview(path.read_bytes()))
            finally:
                os.close(fd)


def wait_cached(mnt, blocks: int) -> None:
    deadline = time.monotonic() + 20
    while mnt.status()["tiers"]["disk"]["blocks"] < blocks:
        assert time.monotonic() < deadline, "the fill never reached the disk tier"
        time.sleep(0.05)


def test_a_read_only_mount_of_a_changing_bucket_gives_each_version_its_own_inode(s3_server, bucket, mount_factory):
    """--read-only (objects may change): a file handed to the kernel keeps its version while it is
    open; once the store holds a new version (after the metadata TTL), the path names a new inode,
    new opens read the new bytes (handed over in turn once cached) and the old handle the old."""
    client = s3_client(s3_server.endpoint_url)
    old, new = b"old version " * 500, b"the new version " * 700
    put_tree(client, bucket, "ds", {"f.bin": old})
    port = free_port()
    mnt = mount(mount_factory, f"s3://{bucket}/ds", ("--endpoint-url", s3_server.endpoint_url), port,
                "--read-only", "--metadata-ttl", "1")
    assert (mnt / "f.bin").read_bytes() == old                        # cold: cached as an exact file
    wait_cached(mnt, 1)
    held = open(mnt / "f.bin", "rb")
    try:
        assert held.read() == old
        assert metrics(port).get("cachefs_passthrough_opens_total") == 1, metrics(port)
        first_inode = os.fstat(held.fileno()).st_ino
        client.put_object(Bucket=bucket, Key="ds/f.bin", Body=new)
        time.sleep(1.5)
        assert (mnt / "f.bin").read_bytes() == new                    # the new version, fetched
        assert (mnt / "f.bin").stat().st_ino != first_inode
        wait_cached(mnt, 2)
        with open(mnt / "f.bin", "rb") as again:                      # cached now: handed over
            assert again.read() == new
        assert metrics(port)["cachefs_passthrough_opens_total"] == 2
        held.seek(0)
        assert held.read() == old                                     # the old handle keeps its version
        assert os.fstat(held.fileno()).st_size == len(old)
    finally:
        held.close()
    assert (mnt / "f.bin").read_bytes() == new


def test_a_cache_file_the_scrub_finds_corrupt_is_not_handed_out_again(dataset, mount_factory, monkeypatch):
    """Damaged while mounted, after its hand-over: the scrub finds it, and the next open reads the
    object's right bytes (fetched again), not the backing the kernel still holds."""
    monkeypatch.setenv("CACHEFS_TEST_SCRUB_AGE", "0")          # every handed-over file scrubbed each second
    url, args = dataset
    port = free_port()
    mnt = mount(mount_factory, url, args, port, "--immutable")
    assert read_all(mnt.path) == FILES
    mnt.umount()
    mnt.start()
    name = "c1/f001.jpg"
    assert (mnt / name).read_bytes() == FILES[name]           # handed over; its backing kept for the next open
    [victim] = [p for p in exact_files(mnt.cache_dir) if p.read_bytes() == FILES[name]]
    with open(victim, "r+b") as fh:                           # bit rot under a live mount
        fh.seek(100)
        fh.write(bytes([FILES[name][100] ^ 0xFF]))
    deadline = time.monotonic() + 30
    while metrics(port).get('cachefs_scrub_files_total{result="corrupt"}', 0) < 1:
        assert time.monotonic() < deadline, "the scrub never found the damaged file"
        time.sleep(0.2)
    for _ in range(3):
        assert (mnt / name).read_bytes() == FILES[name]
    assert "failed its scrub" in (mnt.cache_dir / "cachefs.log").read_text()
