"""cachefs's own FUSE layer on real mounts, beyond what every mount test covers: a user who is not
root mounts through fusermount3 (the descriptor passed back over a socket), extra request loops
on cloned descriptors serve concurrent readers, and the daemon's status shows what INIT agreed."""

import hashlib
import os
import random
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from mounts import CACHEFS, mount_factory, public_dir  # noqa: F401

from cachefs.host import find_mount

pytestmark = pytest.mark.fuse

FILES = {f"d{i % 4}/f{i:03d}": random.Random(i).randbytes(500 + 311 * i) for i in range(60)}
AS_USER = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]   # nobody: fusermount3 needs a user name


def write_tree(root: Path) -> None:
    for path, data in FILES.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)


@pytest.fixture
def fuse_device_for_users():
    """fusermount3 opens /dev/fuse with the user's rights: distributions make it 0666; a sandbox
    that made it 0600 gets 0666 for the test, and its mode back afterwards."""
    mode = os.stat("/dev/fuse").st_mode & 0o777
    if mode & 0o006 != 0o006:
        os.chmod("/dev/fuse", 0o666)
    yield
    os.chmod("/dev/fuse", mode)


def test_a_user_who_is_not_root_mounts_through_fusermount3(public_dir, fuse_device_for_users,  # noqa: F811
                                                          checkout_reachable_by_other_users):
    if shutil.which("fusermount3") is None:
        pytest.fail("fusermount3 is missing: install fuse3", pytrace=False)
    data, mnt, cache = public_dir / "data", public_dir / "mnt", public_dir / "cache"
    write_tree(data)
    for path in (mnt, cache):
        path.mkdir()
        os.chown(path, 65534, 65534)
    subprocess.run(["chmod", "-R", "a+rX", str(data)], check=True)
    env = {**os.environ, "HOME": str(cache)}
    # in the foreground: the daemon is this process, run as the user (a re-exec of this checkout's
    # interpreter as another user is up to how Python was installed, not to cachefs)
    daemon = subprocess.Popen([*AS_USER, *CACHEFS, "mount", f"file://{data}", str(mnt), "--cache-dir", str(cache),
                               "--immutable", "--metrics-port", "0", "--foreground"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while find_mount(str(mnt)) is None:
            assert daemon.poll() is None and time.monotonic() < deadline, daemon.stderr.read()
            time.sleep(0.05)
        assert find_mount(str(mnt))[1] == "fuse.cachefs"
        options = open("/proc/self/mountinfo").read().split(f" {mnt} ")[1]
        assert "user_id=65534" in options
        import json

        def fuse_status() -> dict:
            status = subprocess.run([*AS_USER, *CACHEFS, "status", "--json", str(mnt)], capture_output=True,
                                    text=True, env=env, timeout=60)
            return json.loads(status.stdout)["fuse"]

        # cold (fetched, cached), then from the disk tier once its cache file is written (the fill
        # runs after the first read answers): that open tries passthrough
        deadline = time.monotonic() + 20
        while True:
            reader = subprocess.run([*AS_USER, "sha256sum", str(mnt / "d1/f001")], capture_output=True, text=True,
                                    timeout=60)
            assert reader.stdout.split()[0] == hashlib.sha256(FILES["d1/f001"]).hexdigest(), reader.stderr
            fuse = fuse_status()
            if fuse["passthrough"] is False or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert fuse["backend"] == "cachefs" and fuse["passthrough"] is False    # no CAP_SYS_ADMIN: refused, fell back
    finally:
        stop = subprocess.run([*AS_USER, *CACHEFS, "umount", str(mnt)], capture_output=True, text=True, env=env,
                              timeout=120)
        if find_mount(str(mnt)) is not None:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    assert stop.returncode == 0, stop.stderr
    assert find_mount(str(mnt)) is None


@pytest.mark.parametrize("loops", [0, 3])
def test_request_loops_on_cloned_descriptors_serve_concurrent_readers(tmp_path, mount_factory, loops):  # noqa: F811
    write_tree(tmp_path / "data")
    mnt = mount_factory(f"file://{tmp_path / 'data'}", "--immutable", "--fuse-loops", str(loops),
                        "--passthrough", "off").start()
    paths = sorted(FILES)

    def reader(seed: int) -> int:
        order = random.Random(seed).sample(paths, len(paths))
        for path in order * 5:
            with open(mnt / path, "rb") as fh:
                assert fh.read() == FILES[path]
        return len(order) * 5

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(reader, range(8))) == 8 * 5 * len(paths)
    status = mnt.status()["fuse"]
    assert status["backend"] == "cachefs" and status["requests"] > 8 * len(paths)
    assert "max_pages" in status["flags"] and time.monotonic() - started < 60
    log = (mnt.cache_dir / "cachefs.log").read_text()
    assert (f"{loops} extra FUSE request loop(s)" in log) == bool(loops)
    mnt.umount()


@pytest.mark.parametrize("poll", [None, "0"], ids=["default", "off"])
def test_the_request_loop_polls_before_it_sleeps_unless_told_not_to(tmp_path, mount_factory, poll):  # noqa: F811
    """By default the daemon's loop polls /dev/fuse up to 200 us before it sleeps: one reader
    opening files one after another, hot, has many of its requests found by the poll (no
    wake-up), and `cachefs status` says so; `--fuse-poll-us 0`: no poll."""
    write_tree(tmp_path / "data")
    mnt = mount_factory(f"file://{tmp_path / 'data'}", "--immutable",
                        *(["--fuse-poll-us", poll] if poll else [])).start()
    paths = [str(mnt / path) for path in sorted(FILES)]
    for path in paths * (2000 // len(paths) + 1):
        with open(path, "rb", buffering=0) as fh:
            fh.read()
    status = mnt.status()["fuse"]
    if poll == "0":
        assert status["poll"] is None
    else:
        assert status["poll"]["ceiling_us"] == 200 and status["poll"]["found"] > 0, status["poll"]
    mnt.umount()


@pytest.mark.parametrize("passthrough,kind", [("auto", "thread"), ("off", "auto"), ("auto", "auto")],
                         ids=["passthrough", "no-passthrough", "from-the-loops-table"])
def test_handles_stay_releasable_past_32768_opens(tmp_path, mount_factory, passthrough, kind):  # noqa: F811
    """A handle number's top bit marks a loop process's handle: once a daemon had given out
    32,768 handles its own numbers had it, so no RELEASE freed a handle again and the control
    file's ioctls answered ENOTTY (`cachefs status` failed). (``thread``: no loops' table, so
    the daemon's own handles; with it, the opens of handed-over files are the table's.)"""
    write_tree(tmp_path / "data")
    mnt = mount_factory(f"file://{tmp_path / 'data'}", "--immutable", "--passthrough", passthrough,
                        "--fuse-loop-kind", kind).start()
    paths = [str(mnt / path) for path in sorted(FILES)]

    def opener(seed: int) -> None:
        for path in random.Random(seed).choices(paths, k=10_000):
            os.close(os.open(path, os.O_RDONLY))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(opener, range(4)))
    status = mnt.status()                             # the control file's ioctls reach the daemon
    assert status["fuse"]["by_opcode"]["open"] >= 40_000 and status["open_files"] == 0, status["fuse"]
    assert all((mnt / path).read_bytes() == data for path, data in FILES.items())
    mnt.umount()
