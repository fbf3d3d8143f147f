"""Real FUSE mounts of a moto S3 bucket: the filesystem view, reads, tiers across remounts."""

import errno
import hashlib
import os
import random
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from mounts import put_tree, wait_for

from testing.s3 import s3_client

pytestmark = pytest.mark.fuse

BLOCK = 256 * 1024


def dataset(seed: int = 1) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {f"train/class_{c}/img_{i}.jpg": rng.randbytes(rng.randint(1, 40_000))
             for c in range(3) for i in range(8)}
    files["train/empty.txt"] = b""
    files["val/deep/er/x.bin"] = rng.randbytes(3 * BLOCK + 123)   # 4 blocks, last one partial
    files["big.bin"] = rng.randbytes(5 * 1024 * 1024 + 7)
    files["name with spaces & ümlaut.txt"] = b"hello\n"
    return files


@pytest.fixture
def loaded(s3_server, bucket):
    files = dataset()
    client = s3_client(s3_server.endpoint_url)
    put_tree(client, bucket, "ds", files)
    client.put_object(Bucket=bucket, Key="ds/train/", Body=b"")        # a directory marker
    client.put_object(Bucket=bucket, Key="outside.txt", Body=b"not in the prefix")
    return s3_server, bucket, files, client


def s3_args(server, *extra):
    return ("--endpoint-url", server.endpoint_url, "--block-size", str(BLOCK), *extra)


def blocks_of(data: bytes) -> int:
    return (len(data) + BLOCK - 1) // BLOCK


def metric(port: int, series: str) -> float:
    """One series of the daemon's metrics endpoint on ``port`` (0 when absent)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    found = [ln for ln in text.splitlines() if ln.startswith(series + " ")]
    return float(found[0].split()[-1]) if found else 0.0


def fuse_reads(port: int) -> float:
    """READ requests the daemon answered so far."""
    return metric(port, 'cachefs_fuse_operations_total{op="read"}')


def tree_of(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            full = Path(dirpath) / name
            out[str(full.relative_to(root))] = full.read_bytes()
    return out


def test_read_whole_tree_and_stat(loaded, mount_factory, tmp_path):
    server, bucket, files, client = loaded
    mnt = mount_factory(f"s3://{bucket}/ds", *s3_args(server)).start()
    assert tree_of(mnt.path) == files
    assert sorted(os.listdir(mnt.path)) == ["big.bin", "name with spaces & ümlaut.txt", "train", "val"]
    head = client.head_object(Bucket=bucket, Key="ds/big.bin")
    st = os.stat(mnt / "big.bin")
    assert st.st_size == len(files["big.bin"])
    assert abs(st.st_mtime - head["LastModified"].timestamp()) < 2
    assert os.stat(mnt / "train").st_mode & 0o170000 == 0o040000
    # find and cp -r out of the mount agree with the bucket
    found = subprocess.run(["find", str(mnt.path), "-type", "f"], capture_output=True, text=True, check=True)
    assert len(found.stdout.split("\n")) - 1 == len(files)
    shutil.copytree(mnt.path, tmp_path / "copy")
    assert tree_of(tmp_path / "copy") == files


def test_pread_seek_and_partial_blocks(loaded, mount_factory):
    server, bucket, files, _ = loaded
    mnt = mount_factory(f"s3://{bucket}/ds", *s3_args(server)).start()
    data = files["val/deep/er/x.bin"]
    rng = random.Random(5)
    fd = os.open(mnt / "val/deep/er/x.bin", os.O_RDONLY)
    try:
        for _ in range(50):
            off = rng.randrange(0, len(data) + 10)
            size = rng.choice([1, 100, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 17])
            assert os.pread(fd, size, off) == data[off:off + size]
        os.lseek(fd, len(data) - 10, os.SEEK_SET)
        assert os.read(fd, 100) == data[-10:]
        assert os.read(fd, 100) == b""
    finally:
        os.close(fd)


def test_writes_are_refused_with_erofs(loaded, mount_factory):
    server, bucket, _, _ = loaded
    mnt = mount_factory(f"s3://{bucket}/ds", *s3_args(server, "--read-only")).start()
    for action in (lambda: open(mnt / "new.txt", "w"), lambda: open(mnt / "big.bin", "r+b"),
                   lambda: os.mkdir(mnt / "newdir"), lambda: os.unlink(mnt / "big.bin"),
                   lambda: os.rename(mnt / "big.bin", mnt / "b2"), lambda: os.truncate(mnt / "big.bin", 0)):
        with pytest.raises(OSError) as info:
            action()
        assert info.value.errno == errno.EROFS
    assert (mnt / "big.bin").stat().st_size > 0


def test_missing_names_are_enoent(loaded, mount_factory):
    server, bucket, _, _ = loaded
    mnt = mount_factory(f"s3://{bucket}/ds", *s3_args(server)).start()
    with pytest.raises(FileNotFoundError):
        (mnt / "nope.txt").read_bytes()
    with pytest.raises(FileNotFoundError):
        os.stat(mnt / "train" / "class_0" / "missing")
    with pytest.raises(NotADirectoryError):
        os.listdir(mnt / "big.bin")
    assert not (mnt / "outside.txt").exists()


def test_directory_of_more_than_1000_objects(s3_server, bucket, mount_factory):
    client = s3_client(s3_server.endpoint_url)
    files = {f"many/f{i:05d}": str(i).encode() for i in range(1234)}
    put_tree(client, bucket, "", files)
    mnt = mount_factory(f"s3://{bucket}", *s3_args(s3_server)).start()
    names = os.listdir(mnt / "many")
    assert len(names) == 1234
    assert sorted(names) == sorted(p.split("/")[1] for p in files)
    assert (mnt / "many/f01233").read_bytes() == b"1233"


def test_remount_serves_from_disk_tier_with_zero_requests(loaded, mount_factory):
    server, bucket, files, _ = loaded
    mnt = mount_factory(f"s3://{bucket}/ds", *s3_args(server)).start()
    assert tree_of(mnt.path) == files
    assert mnt.requests("get") >= len([d for d in files.values() if d])
    mnt.umount()
    subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=False)
    mnt.start()
    assert tree_of(mnt.path) == files
    status = mnt.status()
    assert mnt.requests("get") == 0, status["store_requests"]
    # one LIST (MaxKeys=1) is the mount-time check that the prefix exists; listings come from
    # the snapshot in the cache dir
    assert mnt.requests("list") == 1, status["store_requests"]
    assert status["tiers"]["disk"]["hits"] > 0


def test_sigkill_daemon_then_remount(loaded, mount_factory):
    server, bucket, files, _ = loaded
    mnt = mount_factory(f"s3://{bucket}/ds", *s3_args(server)).start()
    assert (mnt / "big.bin").read_bytes() == files["big.bin"]
    big_blocks = blocks_of(files["big.bin"])
    wait_for(lambda: mnt.status()["tiers"]["disk"]["blocks"] == big_blocks)
    mnt.kill()
    with pytest.raises(OSError) as info:
        os.listdir(mnt.path)
    assert info.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)   # the kernel says either
    mnt.umount()                           # a stale mount is cleaned up by `cachefs umount`
    mnt.start()
    assert tree_of(mnt.path) == files
    # every block but big.bin's came from the store; big.bin's survived the crash on disk
    assert mnt.requests("get") == sum(blocks_of(d) for d in files.values()) - big_blocks


def _block_files(cache_dir: Path) -> list[Path]:
    root = cache_dir / "blocks"
    return sorted(p for p in root.rglob("*") if p.is_file() and "tmp" not in p.relative_to(root).parts)


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupt_cache_file_is_detected_and_refetched(loaded, mount_factory, damage):
    server, bucket, files, _ = loaded
    mnt = mount_factory(f"s3://{bucket}/ds", *s3_args(server)).start()
    name = "train/class_1/img_3.jpg"
    assert (mnt / name).read_bytes() == files[name]
    mnt.umount()
    (block,) = _block_files(mnt.cache_dir)
    raw = bytearray(block.read_bytes())
    if damage == "flip":
        raw[-1] ^= 0xFF
    elif damage == "truncate":
        raw = raw[: len(raw) - 100]
    else:
        raw[:64] = b"\0" * 64
    block.write_bytes(bytes(raw))
    subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=False)
    mnt.start()
    assert (mnt / name).read_bytes() == files[name]
    status = mnt.status()
    assert status["corrupt_blocks"] == 1
    assert mnt.requests("get") == 1


def test_kernel_tuning_applied(loaded, mount_factory):
    server, bucket, _, _ = loaded
    mnt = mount_factory(f"s3://{bucket}/ds", *s3_args(server, "--fuse-read-ahead-kb", "2048",
                                                       "--fuse-max-background", "48")).start()
    from cachefs.host import find_mount
    major, minor = find_mount(str(mnt.path))[0].split(":")
    assert Path(f"/sys/class/bdi/{major}:{minor}/read_ahead_kb").read_text().strip() == "2048"
    conn = os.makedev(int(major), int(minor))
    assert Path(f"/sys/fs/fuse/connections/{conn}/max_background").read_text().strip() == "48"


def test_owner_and_modes_and_allow_other(loaded, public_dir, mount_factory):
    server, bucket, files, _ = loaded
    mnt = mount_factory(f"s3://{bucket}/ds", *s3_args(server, "--uid", "1234", "--gid", "2345",
                                                       "--file-mode", "0640", "--dir-mode", "0750",
                                                       "--allow-other"), mountpoint=public_dir / "mnt").start()
    st = os.stat(mnt / "big.bin")
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1234, 2345, 0o640)
    assert os.stat(mnt / "train").st_mode & 0o7777 == 0o750
    as_owner = ["setpriv", "--reuid", "1234", "--regid", "2345", "--clear-groups"]
    read = subprocess.run([*as_owner, "sha256sum", str(mnt / "big.bin")], capture_output=True, text=True)
    assert read.returncode == 0, read.stderr
    assert read.stdout.split()[0] == hashlib.sha256(files["big.bin"]).hexdigest()
    other = subprocess.run(["setpriv", "--reuid", "4321", "--regid", "4321", "--clear-groups",
                            "cat", str(mnt / "big.bin")], capture_output=True)
    assert other.returncode != 0   # mode 0640 denies others


def test_without_allow_other_other_users_are_refused(loaded, public_dir, mount_factory):
    server, bucket, _, _ = loaded
    mnt = mount_factory(f"s3://{bucket}/ds", *s3_args(server), mountpoint=public_dir / "mnt").start()
    other = subprocess.run(["setpriv", "--reuid", "1234", "--regid", "1234", "--clear-groups",
                            "ls", str(mnt.path)], capture_output=True, text=True)
    assert other.returncode != 0


def test_sequential_large_read_triggers_readahead(loaded, mount_factory):
    server, bucket, files, _ = loaded
    mnt = mount_factory(f"s3://{bucket}/ds", *s3_args(server)).start()
    with open(mnt / "big.bin", "rb") as fh:
        got = b"".join(iter(lambda: fh.read(128 * 1024), b""))
    assert got == files["big.bin"]
    assert mnt.requests("get") == (len(files["big.bin"]) + BLOCK - 1) // BLOCK   # each block once


def test_status_command_human_and_json(loaded, mount_factory):
    server, bucket, files, _ = loaded
    mnt = mount_factory(f"s3://{bucket}/ds", *s3_args(server)).start()
    (mnt / "big.bin").read_bytes()
    listing = mnt.wait_listed_ahead()
    from mounts import cachefs
    human = cachefs("status", str(mnt.path))
    assert human.returncode == 0 and "disk" in human.stdout and "hit ratio" in human.stdout
    assert f"listing ahead done: {listing['folders']} folders in" in human.stdout
    import json
    status = json.loads(cachefs("status", str(mnt.path), "--json").stdout)
    assert status["pid"] == mnt.pid
    assert status["read_bytes"] >= len(files["big.bin"])
    assert status["tiers"]["disk"]["used_bytes"] > 0
    mnt.umount()
    mnt.start()                     # a remount within the TTL: the saved listings serve, no listing ahead
    assert mnt.status()["listing"]["state"] == "skipped"
    assert "listing ahead skipped: the saved listings are fresh" in cachefs("status", str(mnt.path)).stdout


def test_small_cold_files_are_fetched_at_open_and_need_no_read(loaded, mount_factory):
    """A small file no tier holds is fetched by its open (one GET) and pushed into the kernel page
    cache: the READ round trip that would carry the GET never happens, and the bytes are right."""
    from testing.s3 import free_port
    server, bucket, files, _ = loaded
    small = {p: d for p, d in files.items() if p.startswith("train/") and d}
    port = free_port()
    mnt = mount_factory(f"s3://{bucket}/ds", *s3_args(server), "--metrics-port", str(port)).start()

    gets = mnt.requests("get")         # reads the control file: before the READ count is taken
    before = fuse_reads(port)
    assert all((mnt / p).read_bytes() == d for p, d in small.items())
    assert fuse_reads(port) == before
    assert mnt.requests("get") - gets == len(small)


@pytest.mark.parametrize("enabled", [True, False])
def test_a_lookup_starts_the_get_of_a_small_cold_file(loaded, mount_factory, enabled):
    """A lookup of a small file no tier holds starts its GET (readahead at lookup): the open that
    follows joins it, so each file still costs one GET and no READ. ``--no-readahead-at-lookup``
    leaves a lookup without GETs (a stat fetches nothing)."""
    from testing.s3 import free_port
    server, bucket, files, _ = loaded
    small = {p: d for p, d in files.items() if p.startswith("train/") and d}
    port = free_port()
    flags = () if enabled else ("--no-readahead-at-lookup",)
    mnt = mount_factory(f"s3://{bucket}/ds", *s3_args(server), "--metrics-port", str(port), *flags).start()

    gets = mnt.requests("get")
    for done, p in enumerate(small, 1):
        (mnt / p).stat()                    # a LOOKUP each, one at a time: each starts a GET
        if enabled:
            wait_for(lambda done=done: mnt.requests("get") - gets == done)
    if not enabled:
        import time
        time.sleep(0.5)
        assert mnt.requests("get") == gets
    assert metric(port, "cachefs_lookup_readaheads_total") == (len(small) if enabled else 0)
    reads = fuse_reads(port)
    assert all((mnt / p).read_bytes() == d for p, d in small.items())
    assert fuse_reads(port) == reads
    assert mnt.requests("get") - gets == len(small)


def test_eight_readers_at_once_read_every_byte_and_the_mount_stops_cleanly(loaded, mount_factory):
    """8 readers opening and reading files at once: requests queue in the kernel and the FUSE layer
    answers them in any order; every byte is right and the mount then stops cleanly."""
    from concurrent.futures import ThreadPoolExecutor

    server, bucket, files, _ = loaded
    mnt = mount_factory(f"s3://{bucket}/ds", *s3_args(server)).start()
    paths = sorted(files)

    def reader(seed: int) -> int:
        order = random.Random(seed).sample(paths, len(paths))
        for p in order * 10:
            fd = os.open(mnt / p, os.O_RDONLY)
            try:
                assert os.read(fd, len(files[p]) + 1) == files[p]
            finally:
                os.close(fd)
        return len(order) * 10

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(reader, range(8))) == 8 * 10 * len(paths)
    mnt.umount()


@pytest.mark.parametrize(("limit", "state", "folders", "lists"), [
    (1000, "done", 32, 0),                      # every folder, the root and c07/deeper included
    (50, "stopped at the limit", 17, 15),       # c00-c15 and c07/deeper are complete after 50 keys
    (0, None, 0, 32),                           # off: the root and each folder at its first lookup
])
def test_folders_are_listed_ahead_at_mount(s3_server, bucket, mount_factory, limit, state, folders, lists):
    """One recursive listing at mount lists the folders (--list-ahead): a first lookup in a folder
    it gave sends no LIST; past its limit, the other folders are listed on their first lookup;
    names and bytes are the store's either way. ``cachefs status`` tells how it went."""
    files = {f"c{c:02d}/f{i}": bytes([c, i]) * 50 for c in range(30) for i in range(3)}
    files["c07/deeper/x"] = b"x"
    client = s3_client(s3_server.endpoint_url)
    put_tree(client, bucket, "ds", files)
    mnt = mount_factory(f"s3://{bucket}/ds", *s3_args(s3_server), "--list-ahead", str(limit)).start()
    if state is None:
        assert mnt.status()["listing"] is None
    else:
        listing = mnt.wait_listed_ahead()
        assert (listing["state"], listing["folders"], listing["taken"]) == (state, folders, folders)
    before = mnt.requests("list")
    assert all((mnt / p).read_bytes() == d for p, d in files.items())
    assert sorted(os.listdir(mnt / "c07")) == ["deeper", "f0", "f1", "f2"]
    assert sorted(os.listdir(mnt / "c29")) == ["f0", "f1", "f2"]
    assert mnt.requests("list") - before == lists


def test_small_cached_files_are_preloaded_at_open(loaded, mount_factory):
    """A small file on the disk tier is pushed into the kernel page cache at open (notify_store):
    the reader gets the right bytes and the kernel sends no READ request for it."""
    from testing.s3 import free_port
    server, bucket, files, _ = loaded
    small = {p: d for p, d in files.items() if p.startswith("train/") and d}
    mnt = mount_factory(f"s3://{bucket}/ds", *s3_args(server)).start()
    assert all((mnt / p).read_bytes() == d for p, d in small.items())
    mnt.umount()
    port = free_port()
    mnt.args += ["--metrics-port", str(port)]        # the later flag wins over the fixture's 0
    mnt.start()

    served = mnt.status()["read_bytes"]
    before = fuse_reads(port)        # the status call reads the control file
    assert all((mnt / p).read_bytes() == d for p, d in small.items())
    assert fuse_reads(port) == before
    assert mnt.requests("get") == 0 and fuse_reads(port) == before + 1
    # pushed at open, they were served all the same: bytes served counts them
    assert mnt.status()["read_bytes"] - served == sum(len(d) for d in small.values())
