"""The control protocol on real mounts: exit codes across the wire, the handshake, and who may
drive the daemon (tested as non-root users through ``setpriv``) on an ``--allow-other`` mount."""

import json
import os
import subprocess
import sys

import pytest
from mounts import CACHEFS, cachefs, put_tree

from cachefs.control.client import hello, request
from cachefs.errors import ExitCode, Unsupported, UsageError
from testing.s3 import s3_client

pytestmark = pytest.mark.fuse

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
OWNER = ["setpriv", "--reuid=1234", "--regid=2345", "--clear-groups"]
FILES = {f"ds/f{i}.bin": bytes([i]) * (20_000 + i) for i in range(6)}


@pytest.fixture
def dataset(s3_server, bucket):
    put_tree(s3_client(s3_server.endpoint_url), bucket, "", FILES)
    return s3_server, bucket


def mount(dataset, mount_factory, public_dir, *extra):
    server, bucket = dataset
    return mount_factory(f"s3://{bucket}", "--endpoint-url", server.endpoint_url, "--block-size", "65536",
                         "--metadata-ttl", "3600", "--allow-other", *extra,
                         mountpoint=public_dir / "mnt").start()


def as_user(user: list[str], *args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([*user, *CACHEFS, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def raw_request_as(user: list[str], mountpoint, command: str, cwd, **args) -> subprocess.CompletedProcess:
    """A request straight to the control file (no client-side handshake): the daemon must refuse."""
    code = ("import sys, json\nfrom cachefs.control.client import request\nfrom cachefs.errors import CachefsError\n"
            "try:\n    print(json.dumps(list(request(sys.argv[1], sys.argv[2], **json.loads(sys.argv[3])))))\n"
            "except CachefsError as e:\n    print(e, file=sys.stderr); sys.exit(e.exit_code)\n")
    return subprocess.run([*user, sys.executable, "-c", code, str(mountpoint), command, json.dumps(args)],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def cached_files(mnt) -> int:
    result = cachefs("warmup", "--check", "--json", str(mnt / "ds"))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])["cached_files"]


def test_other_users_may_read_status_but_not_change_the_cache(checkout_reachable_by_other_users, dataset,
                                                                public_dir, mount_factory):
    mnt = mount(dataset, mount_factory, public_dir)          # mounted by root: root is the owner
    assert cachefs("warmup", str(mnt / "ds")).returncode == 0
    assert cached_files(mnt) == len(FILES)

    status = as_user(NOBODY, "status", str(mnt.path), cwd=public_dir)
    assert status.returncode == 0, status.stderr
    assert mnt.url in status.stdout
    check = as_user(NOBODY, "warmup", "--check", str(mnt / "ds"), cwd=public_dir)
    assert check.returncode == 0, check.stderr

    for args in (["warmup", "--evict", str(mnt / "ds")], ["warmup", "--unpin", str(mnt / "ds")],
                 ["warmup", "--force", str(mnt / "ds")], ["sync", str(mnt.path)]):
        refused = as_user(NOBODY, *args, cwd=public_dir)
        assert refused.returncode == ExitCode.PERMISSION, (args, refused.returncode, refused.stderr)
        assert "only root and the mount's owner" in refused.stderr
        assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    # the daemon itself refuses, not only the client's handshake
    for command, args in (("warmup_evict", {"paths": ["ds"]}), ("sync", {"wait": True}),
                          ("warmup_paths", {"paths": ["ds/f1.bin"]})):
        raw = raw_request_as(NOBODY, mnt.path, command, public_dir, **args)
        assert raw.returncode == ExitCode.PERMISSION, (command, raw.stdout, raw.stderr)
        assert "uid 65534" in raw.stderr
    assert cached_files(mnt) == len(FILES)                    # nothing was evicted

    evict = cachefs("warmup", "--evict", str(mnt / "ds"))    # root may
    assert evict.returncode == 0, evict.stderr
    assert cached_files(mnt) == 0


def test_the_mounts_owner_may_change_it(checkout_reachable_by_other_users, dataset, public_dir, mount_factory):
    mnt = mount(dataset, mount_factory, public_dir, "--uid", "1234", "--gid", "2345")
    assert hello(str(mnt.path))["may_change"] is True        # root
    warm = as_user(OWNER, "warmup", str(mnt / "ds"), cwd=public_dir)
    assert warm.returncode == 0, warm.stderr
    assert cached_files(mnt) == len(FILES)
    synced = as_user(OWNER, "sync", "--wait", str(mnt.path), cwd=public_dir)
    assert synced.returncode == 0, synced.stderr
    refused = as_user(NOBODY, "sync", str(mnt.path), cwd=public_dir)
    assert refused.returncode == ExitCode.PERMISSION, refused.stderr
    hello_nobody = raw_request_as(NOBODY, mnt.path, "hello", public_dir)
    assert hello_nobody.returncode == 0, hello_nobody.stderr
    (answer,) = json.loads(hello_nobody.stdout)
    assert answer["may_change"] is False and "sync" in answer["restricted"] and "status" not in answer["restricted"]


def test_errors_keep_their_exit_codes_across_the_wire(dataset, public_dir, mount_factory, tmp_path):
    mnt = mount(dataset, mount_factory, public_dir, "--read-only")
    answer = hello(str(mnt.path))
    assert answer["protocol"] == 1 and "status" in answer["commands"] and "sync" not in answer["commands"]

    # a usage error raised inside the daemon (a manifest entry escaping the mount) exits 2, not 1
    manifest = tmp_path / "list.txt"
    manifest.write_text("f1.bin\n../../etc/passwd\n")
    result = cachefs("warmup", "--manifest", str(manifest), str(mnt / "ds"))
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert "must stay inside the mount" in result.stderr

    with pytest.raises(UsageError, match="'paths' must be a list of strings") as caught:
        list(request(str(mnt.path), "warmup_check", paths="ds"))
    assert caught.value.exit_code == ExitCode.USAGE
    with pytest.raises(Unsupported) as caught:
        list(request(str(mnt.path), "defragment"))
    assert caught.value.exit_code == ExitCode.UNSUPPORTED

    nothing = cachefs("sync", str(mnt.path))                  # no sync command on a read-only mount
    assert nothing.returncode == ExitCode.USAGE and "read-only mount: nothing to sync" in nothing.stderr
    assert cachefs("umount", str(mnt.path)).returncode == 0  # its drain asks hello, finds no sync


@pytest.mark.skipif(os.environ.get("CACHEFS_FUSE_BACKEND") == "pyfuse3",
                    reason="the pyfuse3 fallback mounts read-write (its control file has no ioctl channel)")
def test_a_read_only_mount_is_ro_and_its_control_file_speaks_by_ioctl(dataset, mount_factory):
    """Nothing can be written to an --immutable mount: the kernel mounts it read-only (mountinfo
    says ro, writes fail with EROFS at once), and status, warmup and umount reach the daemon over
    the control file's ioctl channel, as a read-only bind in a pod would need."""
    import errno
    import os

    from cachefs.host import mounts

    server, bucket = dataset
    mnt = mount_factory(f"s3://{bucket}", "--endpoint-url", server.endpoint_url, "--immutable").start()
    [entry] = [m for m in mounts() if m.mountpoint == str(mnt.path)]
    options = open("/proc/self/mountinfo").read().split(f" {mnt.path} ")[1].split()[0].split(",")
    assert "ro" in options and entry.fstype == "fuse.cachefs"
    with pytest.raises(OSError) as info:
        os.open(mnt.path / ".cachefs-control", os.O_RDWR)
    assert info.value.errno == errno.EROFS                 # the write channel is closed: ioctl it is
    assert next(request(str(mnt.path), "status"))["pid"] == mnt.status()["pid"]
    result = cachefs("warmup", "--json", str(mnt.path / "ds"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["fetched_files"] == len(FILES)
    with pytest.raises(OSError) as info:
        (mnt.path / "new.txt").write_bytes(b"x")
    assert info.value.errno == errno.EROFS
    mnt.umount()
