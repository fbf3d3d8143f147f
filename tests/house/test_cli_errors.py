"""Bad input through the real CLI (docs/design.md, invariant 7): the documented exit code, one
`cachefs: error: ...` line and no traceback, nothing left mounted and no daemon left running."""

import contextlib
import fcntl
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mounts import cachefs, fill, tmpfs

from cachefs import host
from cachefs.cli import main
from cachefs.config import parse_endpoint
from cachefs.errors import EXIT_CODES, ConfigError, ExitCode, FuseUnavailable
from cachefs.host import find_mount
from cachefs.launcher import process_alive
from testing.s3 import free_port, s3_client

pytestmark = pytest.mark.fuse


# --- helpers ------------------------------------------------------------------------------------

def daemons_of(cache_dir: Path) -> set[int]:
    """Live `cachefs _daemon` and `_keeper` processes logging into ``cache_dir`` (their stdout is its
    log file), standbys aside;
    other daemons on this machine (other tests, other sessions) are not ours to judge."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                if (b"_daemon" in argv or b"_keeper" in argv) and \
                        Path(os.readlink(f"/proc/{entry}/fd/1")).parent == cache_dir and not _standby(int(entry), argv):
                    pids.add(int(entry))
    return pids


def _standby(pid: int, argv: list[bytes]) -> bool:
    """A keeper's standby daemon: started beside the serving one, it holds no cache-dir lock."""
    if b"--keeper-fd" not in argv:
        return False
    fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    return not any(name.endswith("/cachefs.lock") for name in fds)


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
    with tmpfs(tmp_path / "full", "64k") as path:
        fill(path / "filler")
        yield path


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


def test_bad_loop_kind(paths):
    expect_error(run_mount("s3://bucket/x", *paths, "--fuse-loop-kind", "fibers"), ExitCode.USAGE,
                 "fuse_loop_kind must be auto, thread or process")


# --- the store: 3 and 5 ------------------------------------------------------------------------

def test_missing_bucket(paths, s3_server):
    result = run_mount("s3://no-such-bucket-cachefs", *paths, "--endpoint-url", s3_server.endpoint_url)
    expect_error(result, ExitCode.NOT_FOUND, "no-such-bucket-cachefs")


def test_missing_prefix_of_a_read_only_mount(paths, s3_server, bucket):
    # A writable mount of an empty prefix works (a new output prefix: tests/namespace/test_empty_prefix.py).
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


def test_umount_lazy_detaches_at_once_while_a_file_is_open(dataset, mount_factory):
    url, args = dataset
    mnt = mount_factory(url, *args).start()
    pid = mnt.status()["pid"]
    with open(mnt / "a.txt", "rb") as held:
        started = time.monotonic()
        result = cachefs("umount", "--lazy", str(mnt.path))
        assert result.returncode == 0 and time.monotonic() - started < 10, result.stderr
        assert "detached" in result.stderr and f"pid {pid}" in result.stderr
        assert find_mount(str(mnt.path)) is None
        assert held.read() == b"hello"                 # the open file is still served
    deadline = time.monotonic() + 10                   # closed: the daemon exits
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(pid)


# --- the cache dir: 8 -----------------------------------------------------------------------------

def test_cache_dir_parent_is_a_file(paths, tmp_path, dataset):
    url, args = dataset
    (tmp_path / "afile").write_text("x")
    expect_error(run_mount(url, paths[0], tmp_path / "afile" / "cache", *args), ExitCode.CACHE_DIR,
                 "Not a directory")


@pytest.mark.parametrize("existing", [False, True], ids=["new-cache-dir", "existing-cache-dir"])
def test_cache_dir_on_a_full_filesystem(paths, full_fs, dataset, existing):
    url, args = dataset
    cache = full_fs / "cache"
    if existing:          # made before the filesystem filled up, holding a lock file from before
        cache.mkdir()
        (cache / "cachefs.lock").write_bytes(b"")
    expect_error(run_mount(url, paths[0], cache, *args), ExitCode.CACHE_DIR, str(cache), "is full")
    assert lock_holder(cache) is None


def test_a_cache_size_above_the_filesystems_is_a_warning(tmp_path, dataset, mount_factory):
    url, args = dataset
    mnt = mount_factory(url, *args, "--cache-size", "10000T")
    result = mnt.try_start()
    assert result.returncode == 0, result.stderr
    assert "cachefs: warning: --cache-size 10240000.0 GiB is more than the cache filesystem holds" in result.stderr
    assert "--free-space-ratio floor" in (mnt.cache_dir / "cachefs.log").read_text()


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
    assert daemons_of(first.cache_dir) == {first.pid, first.keeper_pid}      # the detector sees a live daemon
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



# --- --help: every subcommand in the usage line ---------------------------------------------------

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


# --- endpoint URLs: one check for every command -------------------------------------------------

@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9000", "https://rgw.example.com", "http://[::1]:7480/",
                                      "http://rgw-0.storage.svc.cluster.local:80/s3"])
def test_good_endpoint_urls_pass(endpoint):
    assert parse_endpoint(endpoint) == endpoint.rstrip("/")


@pytest.mark.parametrize("endpoint, words", [
    ("rgw.example:7480", "needs a scheme"), ("ftp://rgw.example", "needs a scheme"), ("", "needs a scheme"),
    ("http://", "malformed"), ("http://rgw.example:99999", "malformed"), ("http://rgw .example", "malformed"),
    ("http://rgw.example/?x=1", "malformed"), ("http://AKIA:secret@rgw.example", "must not carry credentials"),
])
def test_bad_endpoint_urls_are_one_line_config_errors(endpoint, words):
    with pytest.raises(ConfigError, match=words) as info:
        parse_endpoint(endpoint)
    assert "\n" not in str(info.value) and "secret" not in str(info.value)


def test_an_endpoint_without_a_scheme_is_exit_2_for_every_command(paths, tmp_path):
    """mount, pack and unpack check the endpoint in one place, before anything else happens."""
    mountpoint, cache_dir = paths
    results = [run_mount("s3://bucket/prefix", mountpoint, cache_dir, "--endpoint-url", "rgw.example:7480"),
               cachefs("pack", "s3://b/src", "s3://b/dst", "--endpoint-url", "rgw.example:7480"),
               cachefs("unpack", "s3://b/dst", str(tmp_path / "out"), "--endpoint-url", "rgw.example:7480")]
    for result in results:
        expect_error(result, ExitCode.USAGE, "'rgw.example:7480' needs a scheme")
    assert not (tmp_path / "out").exists()


# --- argparse: one usage line, not the whole option list ----------------------------------------

def test_an_argparse_error_prints_one_usage_line_and_the_error():
    result = cachefs("mount", "s3://bucket/prefix")
    assert result.returncode == ExitCode.USAGE
    assert result.stderr.splitlines() == ["usage: cachefs mount URL MOUNTPOINT [options] (--help for more)",
                                          "cachefs: error: the following arguments are required: mountpoint"]
    result = cachefs("warmup", "--concurrency", "many")
    assert result.returncode == ExitCode.USAGE and len(result.stderr.splitlines()) == 2, result.stderr


# --- exit codes: one table for --help and the docs ------------------------------------------------

def test_help_lists_every_exit_code_from_the_one_table():
    result = cachefs("--help")
    listed = {int(line.split()[0]) for line in result.stdout.split("exit codes:")[1].splitlines() if line.strip()}
    assert listed == set(EXIT_CODES) and {11, 12, 23, 24} <= listed
    for command, codes in (("warmup", {11, 12, 130}), ("pack", {21, 22, 23, 24, 25, 130}), ("mount", {6, 7, 8})):
        text = cachefs(command, "--help").stdout
        for code in codes:
            assert f"{code:>3}  {EXIT_CODES[code]}" in text, (command, code)
    values = [v for k, v in vars(ExitCode).items() if k.isupper()] + [11, 12] + list(range(21, 26)) + [130]
    assert set(values) == set(EXIT_CODES)


# --- extras: a missing one is one line naming it ----------------------------------------------------

MISSING = "import sys; [sys.modules.__setitem__(m, None) for m in {mods!r}]; "


@pytest.mark.parametrize("mods, command, extra", [
    (("pyarrow", "numpy", "crc32c"), ["pack", "s3://b/src", "s3://b/dst"], "packer"),
    (("pyarrow", "numpy", "crc32c"), ["unpack", "s3://b/dst", "/tmp/never-made"], "packer"),
    (("moto", "flask"), ["demo"], "server"),
    (("grpc", "google.protobuf"), ["csi", "--node-id", "n"], "csi"),
])
def test_a_command_whose_extra_is_missing_names_it(mods, command, extra):
    code = MISSING.format(mods=mods) + f"from cachefs.cli import main; sys.exit(main({command!r}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    expect_error(result, ExitCode.USAGE, f"pip install 'cachefs[{extra}]'")


def test_importing_the_loader_without_its_extra_names_it():
    code = MISSING.format(mods=("pyarrow", "numpy", "crc32c")) + "import cachefs.data"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "ImportError: cachefs.data needs the 'packer' extra (missing: pyarrow, numpy, crc32c): "
        "pip install 'cachefs[packer]'")
