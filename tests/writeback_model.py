"""The model of the write-back fuzz tests: random file operations (a Hypothesis state machine, as
JuiceFS tests its FUSE layer) applied to a mount and to a local reference directory side by side,
with the checks that compare them; run on a real mount (tests/writeback/test_writeback_fuzz.py)
and on the kernel-free stack (tests/writeback/test_writeback_fuzz_kernel_free.py)."""

import errno
import hashlib
import os
import stat
import time
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from cachefs.control.client import request

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


class LocalSide:
    """Operations on a real directory (a mount, or the reference), by path relative to ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _p(self, rel: str) -> str:
        return str(self.root / rel)

    def write_at(self, rel: str, flags: int, offset: int, data: bytes) -> int:
        fd = os.open(self._p(rel), os.O_WRONLY | flags, 0o644)
        try:
            return os.pwrite(fd, data, offset) if not flags & os.O_APPEND else os.write(fd, data)
        finally:
            os.close(fd)

    def truncate(self, rel: str, size: int) -> None:
        os.truncate(self._p(rel), size)

    def read_all(self, rel: str) -> bytes:
        with open(self._p(rel), "rb") as fh:
            return fh.read()

    def fsync_path(self, rel: str) -> None:
        fd = os.open(self._p(rel), os.O_RDWR)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def kind_and_size(self, rel: str) -> tuple[str, int]:
        st_ = os.stat(self._p(rel))
        return ("dir", 0) if stat.S_ISDIR(st_.st_mode) else ("file", st_.st_size)

    def rename(self, src: str, dst: str) -> None:
        os.rename(self._p(src), self._p(dst))

    def unlink(self, rel: str) -> None:
        os.unlink(self._p(rel))

    def mkdir(self, rel: str) -> None:
        os.mkdir(self._p(rel))

    def rmdir(self, rel: str) -> None:
        os.rmdir(self._p(rel))

    def listdir(self, rel: str) -> list[str]:
        return sorted(name for name in os.listdir(self._p(rel)) if name != ".cachefs-control")

    def open(self, rel: str, flags: int) -> int:
        return os.open(self._p(rel), flags)

    def pwrite(self, fd: int, data: bytes, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        return os.pread(fd, size, offset)

    def close(self, fd: int) -> None:
        os.close(fd)

    def tree(self) -> tuple[dict[str, bytes], set[str]]:
        return tree(self.root)

    def is_nonempty_dir(self, rel: str) -> bool:
        return (self.root / rel).is_dir() and bool(os.listdir(self.root / rel))


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


def make_machine(new_example, sync, stored):
    """The state machine, over any pair of sides: ``new_example()`` -> (name, side under test,
    reference side), fresh directories; ``sync()`` uploads everything; ``stored(name)`` is the
    tree the store holds for that example."""

    class WriteMachine(RuleBasedStateMachine):
        """Each rule runs one operation on both sides and asserts the same outcome."""

        @initialize()
        def fresh_directory(self):
            self.name, self.mnt, self.ref = new_example()
            self.handles: list[tuple[int, int]] = []

        def both(self, action: str, *args):
            got = outcome(getattr(self.mnt, action), *args)
            want = outcome(getattr(self.ref, action), *args)
            assert got == want, f"{action}{args!r}: tested {got}, local {want}"
            return want

        @rule(path=paths, offset=offsets, data=blobs,
              flags=st.sampled_from([os.O_CREAT, os.O_CREAT | os.O_TRUNC, os.O_CREAT | os.O_APPEND, 0]))
        def write(self, path, offset, data, flags):
            self.both("write_at", path, flags, offset, data)

        @rule(path=paths, size=st.integers(0, 80_000))
        def truncate(self, path, size):
            self.both("truncate", path, size)

        @rule(path=anything)
        def read(self, path):
            self.both("read_all", path)

        @rule(path=anything)
        def stat_size(self, path):
            self.both("kind_and_size", path)

        @rule(src=anything, dst=anything)
        def rename(self, src, dst):
            if self.ref.is_nonempty_dir(src):
                got = outcome(self.mnt.rename, src, dst)
                assert got[0] == "err", got     # a non-empty directory does not move (EXDEV: mv copies)
                return
            self.both("rename", src, dst)

        @rule(path=anything)
        def unlink(self, path):
            self.both("unlink", path)

        @rule(path=anything)
        def mkdir(self, path):
            self.both("mkdir", path)

        @rule(path=anything)
        def rmdir(self, path):
            self.both("rmdir", path)

        @rule(path=anything)
        def fsync(self, path):
            self.both("fsync_path", path)

        @rule(path=dirs)
        def listdir(self, path):
            self.both("listdir", path)

        @precondition(lambda self: len(self.handles) < 3)
        @rule(path=paths)
        def open_handle(self, path):
            """Keep a read-write descriptor open across operations (uploads while open)."""
            got = outcome(self.mnt.open, path, os.O_RDWR)
            want = outcome(self.ref.open, path, os.O_RDWR)
            assert got[0] == want[0] and (got[0] == "ok" or got == want), (path, got, want)
            if got[0] == "ok":
                self.handles.append((got[1], want[1]))

        @precondition(lambda self: self.handles)
        @rule(index=st.integers(0, 2), offset=offsets, data=blobs)
        def write_handle(self, index, offset, data):
            mine, theirs = self.handles[index % len(self.handles)]
            assert outcome(self.mnt.pwrite, mine, data, offset) == outcome(self.ref.pwrite, theirs, data, offset)

        @precondition(lambda self: self.handles)
        @rule(index=st.integers(0, 2), size=st.integers(0, 80_000))
        def read_handle(self, index, size):
            mine, theirs = self.handles[index % len(self.handles)]
            assert outcome(self.mnt.pread, mine, size, 0) == outcome(self.ref.pread, theirs, size, 0)

        @precondition(lambda self: self.handles)
        @rule(index=st.integers(0, 2))
        def close_handle(self, index):
            mine, theirs = self.handles.pop(index % len(self.handles))
            self.mnt.close(mine)
            self.ref.close(theirs)

        @rule()
        def sync(self):
            sync()

        @rule()
        def pause(self):
            """Let the periodic uploads (0.3 s) start, so they race with the next operations."""
            time.sleep(0.35)

        @invariant()
        def same_listing(self):
            if hasattr(self, "mnt"):
                assert self.mnt.listdir("") == self.ref.listdir("")

        def teardown(self):
            if not hasattr(self, "mnt"):
                return
            for mine, theirs in self.handles:
                self.mnt.close(mine)
                self.ref.close(theirs)
            expected = digests(self.ref.tree())
            assert digests(self.mnt.tree()) == expected
            sync()
            assert digests(stored(self.name)) == expected

    return WriteMachine
