"""The cache-file channel's daemon side (cachefs.control.cachefds) with a stand-in packed view and
disk tier: requests, answers, descriptors, and who is answered. The real mount is in
test_packed_mount.py (test_the_loader_reads_cached_shards_from_the_daemons_files_not_through_fuse)."""

import errno
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import trio

from cachefs.control.cachefds import MAX_BLOCKS, CacheFds
from cachefs.tiers.cache import FileVersion

BS = 1 << 20


class Tiers:
    """Blocks 0 and 2 of the shard on "disk" (files in tmp_path), block 1 not."""

    block_size = BS

    def __init__(self, tmp_path):
        self.files = {}
        for index in (0, 2):
            path = tmp_path / f"block{index}"
            path.write_bytes(bytes([index]) * 100)
            self.files[index] = path

    def key(self, f, index):
        return index

    def block_len(self, f, index):
        return min(BS, f.size - index * BS)

    def block_count(self, f):
        return -(-f.size // BS)

    def open_block_file(self, key):
        path = self.files.get(key)
        return os.open(path, os.O_RDONLY) if path else None


class Packed:
    def shard_version(self, number):
        if number != 0:
            raise IndexError(f"no shard {number}")
        return FileVersion("shards/00000.tfrecord", '"e"', 3 * BS - 5)


def ask(path, request: dict) -> tuple[dict | None, list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        try:
            sock.sendall(json.dumps(request).encode() + b"\n")
            message, fds, _, _ = socket.recv_fds(sock, 1 << 16, MAX_BLOCKS)
        except (ConnectionResetError, BrokenPipeError):      # closed unanswered, our request unread
            return None, []
        return (json.loads(message) if message else None), list(fds)


def eventually(condition) -> bool:
    for _ in range(200):
        if condition():
            return True
        time.sleep(0.01)
    return False


def serve(tmp_path, check):
    channel = CacheFds(tmp_path, Packed(), Tiers(tmp_path))

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(channel.run)
            await trio.to_thread.run_sync(check, channel)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert not channel.path.exists() and not channel.listening     # removed when the daemon stops
    return channel


def test_a_socket_that_cannot_be_made_turns_the_channel_off(tmp_path):
    """The cache dir refuses the socket (its path is a directory here): the channel logs, serves
    nothing and says it is not listening (status then shows no channel); the daemon goes on."""
    (tmp_path / "loader.sock").mkdir()
    (tmp_path / "loader.sock" / "keep").write_text("x")
    channel = CacheFds(tmp_path, Packed(), Tiers(tmp_path))

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(channel.run)
            assert not channel.listening
    trio.run(main)
    assert (tmp_path / "loader.sock" / "keep").read_text() == "x"


def test_the_cached_blocks_come_with_their_descriptors(tmp_path):
    def check(channel):
        assert channel.listening and oct(os.stat(channel.path).st_mode & 0o777) == oct(0o600)
        reply, fds = ask(channel.path, {"shard": 0, "name": "00000.tfrecord", "first": 0, "count": 10})
        try:
            assert reply == {"ok": True, "block_size": BS, "blocks": [[0, BS], [2, BS - 5]]}
            assert [os.pread(fd, 1, 0) for fd in fds] == [b"\0", b"\2"]
        finally:
            for fd in fds:
                os.close(fd)
        assert eventually(lambda: channel.served == 2)     # counted once the answer is sent

    serve(tmp_path, check)


def test_bad_requests_get_an_error_and_no_descriptor(tmp_path):
    def check(channel):
        for request in ({"shard": 1, "name": "00001.tfrecord", "first": 0, "count": 1},      # no such shard
                        {"shard": 0, "name": "00009.tfrecord", "first": 0, "count": 1},      # wrong name
                        {"shard": 0, "name": "00000.tfrecord"},                              # fields missing
                        {"shard": "x", "name": "00000.tfrecord", "first": 0, "count": 1}):
            reply, fds = ask(channel.path, request)
            assert reply["ok"] is False and "bad request" in reply["error"] and fds == []
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:     # not JSON
            sock.connect(str(channel.path))
            sock.sendall(b"\xff\xfe\n")
            assert json.loads(sock.recv(4096))["ok"] is False
        assert channel.served == 0

    serve(tmp_path, check)


def test_other_users_are_not_answered(tmp_path):
    """SO_PEERCRED: a peer that is neither root nor the daemon's user gets no answer (here the
    allowed set excludes this test's own uid)."""
    def check(channel):
        channel.allowed_uids = {os.getuid() + 4242}
        reply, fds = ask(channel.path, {"shard": 0, "name": "00000.tfrecord", "first": 0, "count": 10})
        assert reply is None and fds == []
        assert eventually(lambda: channel.refused == 1) and channel.served == 0

    serve(tmp_path, check)


NOBODY = 65534
_AS_NOBODY = r"""
import json, socket, sys
try:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(sys.argv[1])
        sock.sendall(json.dumps({"shard": 0, "name": "00000.tfrecord", "first": 0, "count": 10}).encode() + b"\n")
        message, fds, _, _ = socket.recv_fds(sock, 1 << 16, 16)
        print(json.dumps({"message": message.decode(), "fds": len(fds)}))
except OSError as exc:
    print(json.dumps({"errno": exc.errno}))
"""


def test_a_real_second_user_gets_no_descriptor(tmp_path):
    """A process of another user (nobody, started by root): the 0600 socket refuses its connect
    (EACCES); with the mode opened up by mistake, the peer check still sends it nothing."""
    if os.getuid() != 0:
        pytest.skip("needs root to run a process as another user")
    python = shutil.which("python3", path="/usr/bin:/bin")      # one nobody may run (not a venv under /root)
    if python is None:
        pytest.skip("no system python3 for the other user")
    base = tempfile.mkdtemp(prefix="cachefds-", dir="/tmp")     # pytest's tmp_path is 0700: nobody cannot reach it
    try:
        os.chmod(base, 0o755)
        def as_nobody(path) -> dict:
            done = subprocess.run([python, "-c", _AS_NOBODY, str(path)], user=NOBODY, group=NOBODY,
                                  capture_output=True, text=True, timeout=30, check=True)
            return json.loads(done.stdout)

        def check(channel):
            assert as_nobody(channel.path) == {"errno": errno.EACCES}
            os.chmod(channel.path, 0o666)
            got = as_nobody(channel.path)
            assert got.get("fds", 0) == 0 and "blocks" not in got.get("message", "")
            assert eventually(lambda: channel.refused == 1) and channel.served == 0
            reply, fds = ask(channel.path, {"shard": 0, "name": "00000.tfrecord", "first": 0, "count": 10})
            for fd in fds:
                os.close(fd)
            assert reply["ok"] is True and len(fds) == 2          # root is still answered

        serve(Path(base), check)
    finally:
        shutil.rmtree(base, ignore_errors=True)
