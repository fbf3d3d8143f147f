"""The two FUSE backends answer alike: the same generated operation sequences, run on a mount
served by cachefs's own protocol layer and on one served by pyfuse3 (libfuse), give the same
results and the same errno, op by op, and leave the same tree.

Each backend gets its own prefix of one bucket with the same starting files; sequences are
seeded (``CACHEFS_DIFF_SEQUENCES`` of them, 40 operations each), so a failure names its seed.
"""

import errno
import os
import random
import stat
from pathlib import Path

import pytest
from mounts import put_tree

from testing.s3 import s3_client

pytestmark = pytest.mark.fuse

SEQUENCES = int(os.environ.get("CACHEFS_DIFF_SEQUENCES", "6"))
START = {"a.txt": b"alpha " * 100, "b.log": b"", "d/c.bin": bytes(range(256)) * 300, "d/e/f": b"f"}
NAMES = ("a.txt", "b.log", "n.pt", "d/c.bin", "d/x", "d/e", "d/e/f", "z", "d/e/g.log", "d")


def outcome(action, *args):
    try:
        return "ok", action(*args)
    except OSError as exc:
        return "err", errno.errorcode.get(exc.errno, exc.errno)


class Side:
    """One mount, driven by path relative to its root."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def p(self, rel: str) -> str:
        return str(self.root / rel)

    def read(self, rel: str) -> bytes:
        with open(self.p(rel), "rb") as fh:
            return fh.read()

    def pread(self, rel: str, offset: int, size: int) -> bytes:
        fd = os.open(self.p(rel), os.O_RDONLY)
        try:
            return os.pread(fd, size, offset)
        finally:
            os.close(fd)

    def stat(self, rel: str) -> tuple:
        st = os.stat(self.p(rel))
        return stat.S_IFMT(st.st_mode), st.st_size if stat.S_ISREG(st.st_mode) else 0

    def listdir(self, rel: str) -> list[str]:
        return sorted(os.listdir(self.p(rel)))

    def write(self, rel: str, flags: int, offset: int, data: bytes) -> int:
        fd = os.open(self.p(rel), os.O_WRONLY | flags, 0o644)
        try:
            return os.write(fd, data) if flags & os.O_APPEND else os.pwrite(fd, data, offset)
        finally:
            os.close(fd)

    def truncate(self, rel: str, size: int) -> None:
        os.truncate(self.p(rel), size)

    def unlink(self, rel: str) -> None:
        os.unlink(self.p(rel))

    def mkdir(self, rel: str) -> None:
        os.mkdir(self.p(rel))

    def rmdir(self, rel: str) -> None:
        os.rmdir(self.p(rel))

    def rename(self, old: str, new: str) -> None:
        os.rename(self.p(old), self.p(new))

    def symlink(self, rel: str) -> None:
        os.symlink("target", self.p(rel))

    def link(self, old: str, new: str) -> None:
        os.link(self.p(old), self.p(new))

    def mknod(self, rel: str) -> None:
        os.mkfifo(self.p(rel))

    def open_dir_for_writing(self, rel: str) -> None:
        os.close(os.open(self.p(rel), os.O_WRONLY))

    def getxattr(self, rel: str) -> bytes:
        return os.getxattr(self.p(rel), "user.x")

    def namemax(self, rel: str) -> int:
        return os.statvfs(self.p(rel)).f_namemax

    def tree(self) -> dict[str, object]:
        found = {}
        for dirpath, dirs, files in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            if ".cachefs" in rel:
                continue
            for name in dirs:
                found[os.path.normpath(os.path.join(rel, name))] = "dir"
            for name in files:
                if not name.startswith(".cachefs"):
                    path = os.path.join(dirpath, name)
                    found[os.path.normpath(os.path.join(rel, name))] = outcome(Path(path).read_bytes)
        return found


def operations(rng: random.Random) -> list[tuple]:
    """40 operations: (method name, *args)."""
    ops = []
    for _ in range(40):
        name, other = rng.choice(NAMES), rng.choice(NAMES)
        kind = rng.randrange(16)
        data = rng.randbytes(rng.choice((0, 1, 100, 5000, 70_000)))
        flags = rng.choice((os.O_CREAT, os.O_CREAT | os.O_TRUNC, os.O_APPEND, os.O_CREAT | os.O_EXCL, 0))
        ops.append([("read", name), ("pread", name, rng.randrange(80_000), rng.randrange(1, 70_000)),
                    ("stat", name), ("listdir", rng.choice(("", "d", "d/e", "a.txt", "q"))),
                    ("write", name, flags, rng.randrange(20_000), data), ("truncate", name, rng.randrange(10_000)),
                    ("unlink", name), ("mkdir", name), ("rmdir", name), ("rename", name, other),
                    ("symlink", name), ("link", name, other), ("mknod", name), ("open_dir_for_writing", name),
                    ("getxattr", name), ("namemax", "")][kind])
    return ops


@pytest.fixture
def two_mounts(s3_server, bucket, mount_factory, tmp_path):
    client = s3_client(s3_server.endpoint_url)
    sides = []
    for backend in ("cachefs", "pyfuse3"):
        put_tree(client, bucket, backend, START)
        mnt = mount_factory(f"s3://{bucket}/{backend}", "--endpoint-url", s3_server.endpoint_url,
                            "--fuse-backend", backend, name=backend,
                            cache_dir=tmp_path / f"cache-{backend}").start()
        sides.append(Side(mnt.path))
    return sides


@pytest.mark.parametrize("seed", range(SEQUENCES))
def test_both_backends_answer_every_operation_alike(two_mounts, seed):
    ours, libfuse = two_mounts
    for i, (method, *args) in enumerate(operations(random.Random(seed))):
        got, expected = outcome(getattr(ours, method), *args), outcome(getattr(libfuse, method), *args)
        assert got == expected, f"seed {seed}, operation {i}: {method}{tuple(args)[:3]}: cachefs {got}, " \
                                f"pyfuse3 {expected}"
    assert ours.tree() == libfuse.tree()
