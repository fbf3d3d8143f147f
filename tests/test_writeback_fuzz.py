"""Random file operations on a writable mount and on a local directory give the same results
(a Hypothesis state machine, as JuiceFS tests its FUSE layer), and after `sync --wait` the
bucket holds exactly what the local directory holds.

One mount per test (moto on loopback), reused by every example; each example works in a fresh
sub-directory of it and of the reference directory. Short sync periods make uploads, retires
and copy-ups race with the operations, which is where write-back bugs live.
"""

import errno
import hashlib
import itertools
import os
import stat
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cachefs.control.client import request
from cachefs.demo.local_s3 import s3_client

pytestmark = pytest.mark.fuse

NAMES = ("a.log", "b.pt", "c")            # a log-class, a checkpoint-class and an unclassified name
DIRS = ("d", "e")
PATHS = NAMES + tuple(f"{d}/{n}" for d in DIRS for n in NAMES[:2])
ALL = PATHS + DIRS + ("d/x",)             # "d/x": a nested directory, when "d" exists
SETTINGS = settings(max_examples=int(os.environ.get("CACHEFS_FUZZ_EXAMPLES", "25")), stateful_step_count=30, deadline=None,
                    suppress_health_check=list(HealthCheck))

paths = st.sampled_from(PATHS)
anything = st.sampled_from(ALL)
dirs = st.sampled_from(("",) + DIRS)
blobs = st.binary(min_size=0, max_size=3000) | st.builds(lambda n, b: bytes([b]) * n,
                                                          st.integers(1, 300_000), st.integers(0, 255))
offsets = st.integers(0, 70_000)



def digests(found: tuple[dict[str, bytes], set[str]]) -> tuple[dict[str, str], set[str]]:
    """A tree as (path -> "size:md5", folders): what the comparisons assert, so a failure does not
    make pytest diff megabytes of file contents."""
    files, folders = found
    return {p: f"{len(d)}:{hashlib.md5(d).hexdigest()}" for p, d in files.items()}, folders

def outcome(action, *args):
    """("ok", value) or ("err", errno) of ``action(*args)``: what the two sides must agree on."""
    try:
        return "ok", action(*args)
    except OSError as exc:
        return "err", errno.errorcode.get(exc.errno, exc.errno)


def write_at(path: str, flags: int, offset: int, data: bytes) -> int:
    fd = os.open(path, os.O_WRONLY | flags, 0o644)
    try:
        return os.pwrite(fd, data, offset) if not flags & os.O_APPEND else os.write(fd, data)
    finally:
        os.close(fd)


def read_all(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def kind_and_size(path: str) -> tuple[str, int]:
    st_ = os.stat(path)
    return ("dir", 0) if stat.S_ISDIR(st_.st_mode) else ("file", st_.st_size)


def tree(root: Path) -> tuple[dict[str, bytes], set[str]]:
    files, folders = {}, set()
    for dirpath, dirnames, names in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        folders.update(str(rel / d) for d in dirnames)
        for name in names:
            if name != ".cachefs-control":
                files[str(rel / name)] = (Path(dirpath) / name).read_bytes()
    return files, folders


def bucket_tree(client, bucket: str, prefix: str) -> tuple[dict[str, bytes], set[str]]:
    files, folders = {}, set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix):]
            if not rel:
                continue                # the example directory's own marker
            if rel.endswith("/"):
                folders.add(rel.rstrip("/"))
            else:
                files[rel] = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            parts = rel.rstrip("/").split("/")
            folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return files, folders


def sync_mount(mountpoint: Path) -> dict:
    *_, last = request(str(mountpoint), "sync", wait=True, timeout=60)
    assert last.get("done"), last
    return last


def make_machine(mountpoint: Path, reference: Path, client, bucket: str):
    counter = itertools.count()

    class WriteMachine(RuleBasedStateMachine):
        """Each rule runs one operation on both sides and asserts the same outcome."""

        @initialize()
        def fresh_directory(self):
            self.name = f"ex{next(counter)}"
            self.mnt, self.ref = mountpoint / self.name, reference / self.name
            self.mnt.mkdir()
            self.ref.mkdir()
            self.handles: list[tuple[int, int]] = []

        def both(self, action, rel: str, *args):
            got = outcome(action, str(self.mnt / rel), *args)
            want = outcome(action, str(self.ref / rel), *args)
            assert got == want, f"{action.__name__}({rel!r}): mount {got}, local {want}"
            return want

        def both2(self, action, a: str, b: str):
            got = outcome(action, str(self.mnt / a), str(self.mnt / b))
            want = outcome(action, str(self.ref / a), str(self.ref / b))
            assert got == want, f"{action.__name__}({a!r}, {b!r}): mount {got}, local {want}"

        @rule(path=paths, offset=offsets, data=blobs,
              flags=st.sampled_from([os.O_CREAT, os.O_CREAT | os.O_TRUNC, os.O_CREAT | os.O_APPEND, 0]))
        def write(self, path, offset, data, flags):
            self.both(write_at, path, flags, offset, data)

        @rule(path=paths, size=st.integers(0, 80_000))
        def truncate(self, path, size):
            self.both(os.truncate, path, size)

        @rule(path=anything)
        def read(self, path):
            self.both(read_all, path)

        @rule(path=anything)
        def stat_size(self, path):
            self.both(kind_and_size, path)

        @rule(src=anything, dst=anything)
        def rename(self, src, dst):
            if (self.ref / src).is_dir() and os.listdir(self.ref / src):
                got = outcome(os.rename, str(self.mnt / src), str(self.mnt / dst))
                assert got[0] == "err", got     # a non-empty directory does not move (EXDEV: mv copies)
                return
            self.both2(os.rename, src, dst)

        @rule(path=anything)
        def unlink(self, path):
            self.both(os.unlink, path)

        @rule(path=anything)
        def mkdir(self, path):
            self.both(os.mkdir, path)

        @rule(path=anything)
        def rmdir(self, path):
            self.both(os.rmdir, path)

        @rule(path=anything)
        def fsync(self, path):
            self.both(fsync_path, path)

        @rule(path=dirs)
        def listdir(self, path):
            self.both(lambda p: sorted(os.listdir(p)), path)

        @precondition(lambda self: len(self.handles) < 3)
        @rule(path=paths)
        def open_handle(self, path):
            """Keep a read-write descriptor open across operations (uploads while open)."""
            got = outcome(os.open, str(self.mnt / path), os.O_RDWR)
            want = outcome(os.open, str(self.ref / path), os.O_RDWR)
            assert got[0] == want[0] and (got[0] == "ok" or got == want), (path, got, want)
            if got[0] == "ok":
                self.handles.append((got[1], want[1]))

        @precondition(lambda self: self.handles)
        @rule(index=st.integers(0, 2), offset=offsets, data=blobs)
        def write_handle(self, index, offset, data):
            mine, theirs = self.handles[index % len(self.handles)]
            assert outcome(os.pwrite, mine, data, offset) == outcome(os.pwrite, theirs, data, offset)

        @precondition(lambda self: self.handles)
        @rule(index=st.integers(0, 2), size=st.integers(0, 80_000))
        def read_handle(self, index, size):
            mine, theirs = self.handles[index % len(self.handles)]
            assert outcome(os.pread, mine, size, 0) == outcome(os.pread, theirs, size, 0)

        @precondition(lambda self: self.handles)
        @rule(index=st.integers(0, 2))
        def close_handle(self, index):
            mine, theirs = self.handles.pop(index % len(self.handles))
            os.close(mine)
            os.close(theirs)

        @rule()
        def sync(self):
            sync_mount(mountpoint)

        @rule()
        def pause(self):
            """Let the periodic uploads (0.3 s) start, so they race with the next operations."""
            time.sleep(0.35)

        @invariant()
        def same_listing(self):
            if hasattr(self, "mnt"):
                assert sorted(os.listdir(self.mnt)) == sorted(os.listdir(self.ref))

        def teardown(self):
            if not hasattr(self, "mnt"):
                return
            for mine, theirs in self.handles:
                os.close(mine)
                os.close(theirs)
            expected = digests(tree(self.ref))
            assert digests(tree(self.mnt)) == expected
            sync_mount(mountpoint)
            assert digests(bucket_tree(client, bucket, f"{self.name}/")) == expected

    return WriteMachine


def test_random_operations_match_a_local_directory(s3_server, bucket, mount_factory, tmp_path):
    client = s3_client(s3_server.endpoint_url)
    mnt = mount_factory(f"s3://{bucket}", "--endpoint-url", s3_server.endpoint_url, "--block-size", "64K",
                        "--log-sync-period", "0.3", "--checkpoint-quiet-period", "0.3",
                        "--small-file-size", "100K", "--upload-part-size", "5M").start()
    reference = tmp_path / "reference"
    reference.mkdir()
    machine = make_machine(mnt.path, reference, client, bucket)
    run_state_machine_as_test(machine, settings=SETTINGS)
