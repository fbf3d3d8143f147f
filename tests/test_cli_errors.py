"""Bad input through the real CLI (DESIGN invariant 7): the documented exit code, one
`cachefs: error: ...` line and no traceback, nothing left mounted and no daemon left running."""

import contextlib
import fcntl
import logging
import os
import subprocess
import time
from pathlib import Path

import pytest
from mounts import cachefs

from cachefs import host
from cachefs.cli import main
from cachefs.demo.local_s3 import free_port, s3_client
from cachefs.errors import ExitCode, FuseUnavailable
from cachefs.host import find_mount

pytestmark = pytest.mark.fuse


# --- helpers ------------------------------------------------------------------------------------

def daemons_of(cache_dir: Path) -> set[int]:
    """Live `cachefs _daemon` processes logging into ``cache_dir`` (their stdout is its log file);
    other daemons on this machine (other tests, other sessions) are not ours to judge."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                if b"_daemon" in argv and Path(os.readlink(f"/proc/{entry}/fd/1")).parent == cache_dir:
                    pids.add(int(entry))
    return pids


def lock_holder(cache_dir: Path) -> str | None:
    """None if no process holds the cache dir's lock, else the pid written in it."""
    path = cache_dir / "cachefs.lock"
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode().strip()
    finally:
        os.close(fd)


def run_mount(url: str, mountpoint: Path, cache_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """`cachefs mount` expected to fail: also checks that it left no daemon running and that
    the mountpoint is as it was (unmounted, or still holding an earlier mount of the test)."""
    before, mounted = daemons_of(cache_dir), find_mount(str(mountpoint))
    result = cachefs("mount", url, str(mountpoint), "--cache-dir", str(cache_dir), "--metrics-port", "0", *args)
    deadline = time.monotonic() + 10
    while daemons_of(cache_dir) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemons_of(cache_dir) == before, "a daemon was left running (or an earlier one stopped)"
    assert find_mount(str(mountpoint)) == mounted
    return result


def expect_error(result: subprocess.CompletedProcess, code: int, *words: str, usage: bool = False) -> str:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("cachefs: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    if not usage:
        assert lines == errors, result.stderr
    for word in words:
        assert word in errors[0]
    return errors[0]


@pytest.fixture
def paths(tmp_path: Path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    return mnt, tmp_path / "cache"


@pytest.fixture
def dataset(s3_server, bucket):
    s3_client(s3_server.endpoint_url).put_object(Bucket=bucket, Key="ds/a.txt", Body=b"hello")
    return f"s3://{bucket}/ds", ("--endpoint-url", s3_server.endpoint_url)


@pytest.fixture
def full_fs(tmp_path: Path):
    """A 64 KiB tmpfs filled to the last byte; always unmounted."""
    path = tmp_path / "full"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], check=True)
    try:
        fd = os.open(path / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * 4096):
                    pass
        finally:
            os.close(fd)
        assert os.statvfs(path).f_bavail == 0
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


# --- usage errors: 2 --------------------------------------------------------------------------

def test_malformed_url(paths):
    expect_error(run_mount("not-a-url", *paths), ExitCode.USAGE, "not a store URL")


def test_unknown_option(paths):
    expect_error(run_mount("s3://bucket/x", *paths, "--bogus"), ExitCode.USAGE, "--bogus", usage=True)


def test_malformed_toml_config(paths, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("cache_size = \n[oops\n")
    expect_error(run_mount("s3://bucket/x", *paths, "--config", str(bad)), ExitCode.USAGE, "not valid TOML")


def test_bad_size_value(paths):
    expect_error(run_mount("s3://bucket/x", *paths, "--cache-size", "lots"), ExitCode.USAGE, "cache_size", "lots")


# --- the store: 3 and 5 ------------------------------------------------------------------------

def test_missing_bucket(paths, s3_server):
    result = run_mount("s3://no-such-bucket-cachefs", *paths, "--endpoint-url", s3_server.endpoint_url)
    expect_error(result, ExitCode.NOT_FOUND, "no-such-bucket-cachefs")


def test_missing_prefix_of_a_read_only_mount(paths, s3_server, bucket):
    # A writable mount of an empty prefix works (a new output prefix: tests/test_empty_prefix.py).
    result = run_mount(f"s3://{bucket}/nope", *paths, "--endpoint-url", s3_server.endpoint_url, "--read-only")
    expect_error(result, ExitCode.NOT_FOUND, "nope")


def test_unreachable_endpoint(paths):
    result = run_mount("s3://bucket/x", *paths, "--endpoint-url", f"http://127.0.0.1:{free_port()}",
                       "--connect-timeout", "1", "--max-attempts", "1")
    expect_error(result, ExitCode.UNREACHABLE)


# --- the mountpoint: 6 ----------------------------------------------------------------------------

def test_mountpoint_missing(tmp_path, dataset):
    url, args = dataset
    expect_error(run_mount(url, tmp_path / "absent", tmp_path / "cache", *args), ExitCode.MOUNTPOINT,
                 "does not exist")


def test_mountpoint_is_a_file(tmp_path, dataset):
    url, args = dataset
    (tmp_path / "file").write_text("x")
    expect_error(run_mount(url, tmp_path / "file", tmp_path / "cache", *args), ExitCode.MOUNTPOINT,
                 "not a directory")


def test_mountpoint_busy(tmp_path, dataset, mount_factory):
    url, args = dataset
    first = mount_factory(url, *args).start()
    result = run_mount(url, first.path, tmp_path / "cache2", *args)
    expect_error(result, ExitCode.MOUNTPOINT, "busy")
    assert lock_holder(tmp_path / "cache2") is None
    assert (first / "a.txt").read_bytes() == b"hello"        # the first mount is untouched
    assert first.status()["pid"] == first.pid


def test_umount_of_a_plain_directory(paths):
    expect_error(cachefs("umount", str(paths[0])), ExitCode.MOUNTPOINT, "not a mounted cachefs")


# --- the cache dir: 8 -----------------------------------------------------------------------------

def test_cache_dir_parent_is_a_file(paths, tmp_path, dataset):
    url, args = dataset
    (tmp_path / "afile").write_text("x")
    expect_error(run_mount(url, paths[0], tmp_path / "afile" / "cache", *args), ExitCode.CACHE_DIR,
                 "Not a directory")


def test_cache_dir_on_a_full_filesystem(paths, full_fs, dataset):
    url, args = dataset
    cache = full_fs / "cache"
    expect_error(run_mount(url, paths[0], cache, *args), ExitCode.CACHE_DIR, str(cache))
    assert lock_holder(cache) is None


def test_cache_dir_whose_block_dir_cannot_be_made(paths, dataset):
    url, args = dataset
    mnt, cache = paths
    cache.mkdir()
    (cache / "blocks").write_text("not a directory")
    expect_error(run_mount(url, mnt, cache, *args), ExitCode.CACHE_DIR, "blocks")
    assert lock_holder(cache) is None


def test_cache_dir_locked_by_another_daemon(tmp_path, dataset, mount_factory):
    url, args = dataset
    first = mount_factory(url, *args).start()
    second = tmp_path / "mnt2"
    second.mkdir()
    result = run_mount(url, second, first.cache_dir, *args)
    expect_error(result, ExitCode.CACHE_DIR, "in use by another cachefs daemon", f"pid {first.pid}")
    assert find_mount(str(second)) is None
    assert lock_holder(first.cache_dir) == str(first.pid)
    assert daemons_of(first.cache_dir) == {first.pid}      # the detector sees a live daemon
    assert (first / "a.txt").read_bytes() == b"hello"


# --- no daemon: 9 -----------------------------------------------------------------------------

def test_status_of_a_plain_directory(paths):
    expect_error(cachefs("status", str(paths[0])), ExitCode.NO_DAEMON, "is not a cachefs mount")


# --- no FUSE: 7 (the real device is never touched) ----------------------------------------------

def _without(monkeypatch, missing: str) -> None:
    real = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda path: False if path == missing else real(path))


def test_check_fuse_without_dev_fuse(monkeypatch):
    _without(monkeypatch, "/dev/fuse")
    with pytest.raises(FuseUnavailable, match="/dev/fuse is missing") as info:
        host.check_fuse()
    assert info.value.exit_code == ExitCode.NO_FUSE == 7


def test_check_fuse_with_an_inaccessible_device_or_no_fusermount(monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: path != "/dev/fuse")
    with pytest.raises(FuseUnavailable, match="not readable and writable"):
        host.check_fuse()
    monkeypatch.undo()
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    monkeypatch.setattr(host.shutil, "which", lambda name: None)
    with pytest.raises(FuseUnavailable, match="fusermount3 is missing"):
        host.check_fuse()


def test_mount_without_dev_fuse_exits_7(monkeypatch, paths, capsys):
    """In-process `cachefs mount --foreground`, so the patched os.path.exists applies."""
    _without(monkeypatch, "/dev/fuse")
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level      # --foreground sets up logging to stderr
    try:
        code = main(["mount", "file:///tmp", str(paths[0]), "--cache-dir", str(paths[1]), "--foreground",
                     "--metrics-port", "0"])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    err = capsys.readouterr().err
    assert code == ExitCode.NO_FUSE
    assert err.strip() == "cachefs: error: /dev/fuse is missing: load the fuse module or pass the device " \
                          "to the container"
    assert find_mount(str(paths[0])) is None



# --- --help: every subcommand in the usage line (issue 13 item 6) --------------------------------

def test_usage_line_lists_every_subcommand_including_plugins():
    from cachefs.cli import build_parser, public_commands

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    names = public_commands(sub)
    assert {"mount", "umount", "status", "sync", "demo", "warmup"} <= set(names)   # warmup: an entry point
    usage = parser.format_usage()
    assert usage.startswith("usage: cachefs") and "_daemon" not in usage
    for name in sub.choices:
        if not name.startswith("_"):
            assert name in usage, (name, usage)
    shown = usage[usage.index("{") + 1:usage.index("}")].split(",")
    assert shown == names
    result = cachefs("--help")
    assert result.returncode == 0 and "warmup" in result.stdout.split("\n\n")[0]


def test_bad_subcommand_is_a_usage_error_naming_the_choices():
    result = cachefs("defragment")
    assert result.returncode == ExitCode.USAGE
    assert "warmup" in result.stderr and "Traceback" not in result.stderr
