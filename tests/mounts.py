"""Real kernel FUSE mounts for tests: a `cachefs mount` subprocess per mount, always cleaned up.

Under CI=true a missing /dev/fuse fails the test instead of skipping it.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachefs.control.client import request
from cachefs.host import find_mount
from cachefs.launcher import process_alive

CACHEFS = [sys.executable, "-m", "cachefs"]


def interruptible() -> None:
    """``preexec_fn`` for a child a test sends Ctrl-C (SIGINT): its default action back. A shell
    without job control starts background commands with SIGINT ignored, the ignore is inherited
    across exec, and Python then installs no KeyboardInterrupt handler: the child would never
    see the Ctrl-C the test sends (the test suite run in the background hit exactly this)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def require_fuse() -> None:
    if os.path.exists("/dev/fuse"):
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail("/dev/fuse is missing under CI: FUSE tests must run", pytrace=False)
    pytest.skip("/dev/fuse is missing")


def cachefs(*args: str, check: bool = False, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CACHEFS, *args], capture_output=True, text=True, check=check, timeout=timeout)


def is_mounted(path: str | Path) -> bool:
    return find_mount(str(path)) is not None


class Mount:
    def __init__(self, url: str, mountpoint: Path, cache_dir: Path, args: list[str]) -> None:
        self.url = url
        self.path = mountpoint
        self.cache_dir = cache_dir
        self.args = args
        self.pid: int | None = None
        self.keeper_pid: int | None = None

    def __truediv__(self, other: str) -> Path:
        return self.path / other

    def start(self) -> "Mount":
        result = self.try_start()
        if result.returncode != 0:
            log = (self.cache_dir / "cachefs.log")
            tail = log.read_text()[-3000:] if log.exists() else ""
            raise AssertionError(f"mount failed ({result.returncode}): {result.stderr}\n{tail}")
        return self

    def try_start(self) -> subprocess.CompletedProcess:
        self.path.mkdir(parents=True, exist_ok=True)
        result = cachefs("mount", self.url, str(self.path), "--cache-dir", str(self.cache_dir),
                         "--metrics-port", "0", *self.args)
        if result.returncode == 0:
            status = self.status()
            self.pid = status["pid"]
            self.keeper_pid = (status.get("keeper") or {}).get("pid")
        return result

    def status(self) -> dict:
        return next(request(str(self.path), "status"))

    def wait_listed_ahead(self, timeout: float = 30.0) -> dict:
        """The status of the listing ahead at mount (--list-ahead) once it has ended."""
        deadline = time.monotonic() + timeout
        while (listing := self.status()["listing"])["state"] in ("waiting", "running"):
            assert time.monotonic() < deadline, f"the listing ahead did not finish: {listing}"
            time.sleep(0.05)
        return listing

    def requests(self, op: str) -> int:
        """Object-store requests of one operation (get, head, list) so far, any status."""
        return sum(n for key, n in self.status()["store_requests"].items() if key.split()[0] == op)

    def umount(self) -> None:
        result = cachefs("umount", str(self.path))
        assert result.returncode == 0, result.stderr
        assert not is_mounted(self.path)
        if self.keeper_pid is not None:         # it exits once the mount is gone
            _wait_gone(self.keeper_pid)
            assert not process_alive(self.keeper_pid), "the keeper outlived the mount"
            self.keeper_pid = None
        self.pid = None

    def kill(self) -> None:
        """SIGKILL the keeper and the daemon (a crash of both: the node lost its processes); the
        kernel mount stays behind, stale."""
        assert self.pid is not None
        if self.keeper_pid is not None:
            os.kill(self.keeper_pid, signal.SIGKILL)
            _wait_gone(self.keeper_pid)
            self.keeper_pid = None
        os.kill(self.pid, signal.SIGKILL)
        _wait_gone(self.pid)
        self.pid = None

    def kill_daemon(self, timeout: float = 20.0) -> int:
        """SIGKILL the daemon only; the keeper starts a new one on the live mount. Returns the
        new daemon's pid once it answers."""
        old = self.status()["pid"]
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.02)
            try:
                pid = self.status()["pid"]
            except Exception:  # noqa: BLE001  (ENOTCONN and the like: no daemon yet)
                continue
            if pid != old:
                self.pid = pid
                return pid
        raise AssertionError(f"no new daemon took {self.path} over within {timeout} s")

    def cleanup(self) -> None:
        if is_mounted(self.path) and cachefs("umount", str(self.path)).returncode != 0:
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
        for pid in (self.keeper_pid, self.pid):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                _wait_gone(pid)


@contextlib.contextmanager
def mounted(path: Path, kind: str, source: str, *options: str):
    """A filesystem of ``kind`` mounted at ``path`` (made here), always unmounted (lazily if busy)."""
    path.mkdir()
    subprocess.run(["mount", "-t", kind, *(["-o", ",".join(options)] if options else []), source, str(path)],
                   check=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


def tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` mounted at ``path``."""
    return mounted(path, "tmpfs", "tmpfs", f"size={size}")


def ramfs(path: Path):
    """A ramfs mounted at ``path``: a filesystem with no extended attributes and no size."""
    return mounted(path, "ramfs", "ramfs")


def fill(path: Path) -> None:
    """Take every byte a filesystem has left, in the new file ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        with contextlib.suppress(OSError):
            while os.write(fd, b"\0" * 4096):
                pass
    finally:
        os.close(fd)
    assert os.statvfs(path).f_bavail == 0


def _wait_gone(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process_alive(pid):
        time.sleep(0.02)


@pytest.fixture
def mount_factory(tmp_path: Path):
    """make(url, *args, name=..., cache_dir=...) -> an unstarted Mount; all cleaned up after."""
    require_fuse()
    made: list[Mount] = []

    def make(url: str, *args: str, name: str = "mnt", cache_dir: Path | None = None,
             mountpoint: Path | None = None) -> Mount:
        mount = Mount(url, mountpoint or tmp_path / name, cache_dir or tmp_path / "cache", list(args))
        made.append(mount)
        return mount

    yield make
    for mount in reversed(made):
        mount.cleanup()


@pytest.fixture
def public_dir():
    """A world-traversable directory (pytest's tmp_path is 0700 root), for tests as other users.
    Request it before ``mount_factory``: fixtures tear down in reverse, so the mounts inside it
    are gone before it is removed."""
    import shutil
    import tempfile
    path = Path(tempfile.mkdtemp(prefix="cachefs-test-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def wait_for(predicate, timeout: float = 20.0) -> None:
    """Poll ``predicate`` (real time) until it is true; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def put_tree(client, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def put(item):
        path, data = item
        client.put_object(Bucket=bucket, Key=f"{prefix}/{path}" if prefix else path, Body=data)

    with ThreadPoolExecutor(8) as pool:      # the client's connection pool holds 10
        list(pool.map(put, files.items()))


def overwrite_while_open(client, bucket: str, mnt, old: bytes, new: bytes, block: int) -> None:
    """Open ``obj`` (holding ``old``), read its first block, overwrite it with ``new`` in the
    bucket: an uncached block of the open (pinned) version is an error (If-Match fails: 412),
    never the new bytes, and a read of the whole file through the same handle gives all old
    bytes or an error."""
    import errno
    fd = os.open(mnt / "obj", os.O_RDONLY)
    try:
        assert os.pread(fd, block, 0) == old[:block]
        client.put_object(Bucket=bucket, Key="obj", Body=new)
        with pytest.raises(OSError) as info:
            os.pread(fd, block, len(old) - block)
        assert info.value.errno in (errno.EIO, errno.ESTALE)
        try:
            whole = os.pread(fd, len(old), 0)
        except OSError as exc:
            assert exc.errno in (errno.EIO, errno.ESTALE)
        else:
            assert whole == old[:len(whole)]
    finally:
        os.close(fd)
