"""The loader channel's daemon side (cachefs.packed.channel) and its wire (cachefs.packed.wire) with a
stand-in packed view and disk tier: requests of both wire versions, answers, descriptors, shard
warms, and who is answered. The real mount is in test_packed_mount.py
(test_the_loader_reads_cached_shards_from_the_daemons_files_not_through_fuse)."""

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

from cachefs.packed import wire
from cachefs.packed.channel import LoaderChannel
from cachefs.ports import Port
from cachefs.tiers.cache import FileVersion

BS = 1 << 20


class Tiers:
    """Blocks 0 and 2 of the shard on "disk", block 1 not; the files' data starts after a header
    of 5 and 9 bytes."""

    block_size = BS

    def __init__(self, tmp_path):
        self.files = {}
        for index, header in ((0, b"HEAD!"), (2, b"LONGHEAD!")):
            path = tmp_path / f"block{index}"
            path.write_bytes(header + bytes([index]) * 100)
            self.files[index] = path, len(header)

    def block_len(self, f, index):
        return min(BS, f.size - index * BS)

    def block_count(self, f):
        return -(-f.size // BS)

    def open_cache_file(self, f, index):
        path, offset = self.files.get(index, (None, 0))
        return (os.open(path, os.O_RDONLY), offset) if path else None


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
            message, fds, _, _ = socket.recv_fds(sock, 1 << 16, wire.FILES_PER_ANSWER)
        except (ConnectionResetError, BrokenPipeError):      # closed unanswered, our request unread
            return None, []
        return (json.loads(message) if message else None), list(fds)


def eventually(condition) -> bool:
    for _ in range(200):
        if condition():
            return True
        time.sleep(0.01)
    return False


def serve(tmp_path, check, shard_read=None):
    channel = LoaderChannel(tmp_path, Packed(), Tiers(tmp_path), shard_read=shard_read)

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
    channel = LoaderChannel(tmp_path, Packed(), Tiers(tmp_path))

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(channel.run)
            assert not channel.listening
    trio.run(main)
    assert (tmp_path / "loader.sock" / "keep").read_text() == "x"


def test_the_cached_blocks_come_with_their_descriptors_and_offsets(tmp_path):
    def check(channel):
        assert channel.listening and oct(os.stat(channel.path).st_mode & 0o777) == oct(0o600)
        assert channel.advertised() == {"socket": str(channel.path), "wire": wire.WIRE}
        reply, fds = ask(channel.path, {"wire": 2, "op": "files", "shard": 0, "name": "00000.tfrecord",
                                        "first": 0, "count": 10})
        try:
            assert reply == {"wire": 2, "ok": True, "block_size": BS, "extents": [[0, BS, 5], [2, BS - 5, 9]]}
            assert [os.pread(fd, 1, offset) for fd, (_, _, offset) in zip(fds, reply["extents"], strict=True)] \
                == [b"\0", b"\2"]
        finally:
            for fd in fds:
                os.close(fd)
        assert eventually(lambda: channel.served == 2)     # counted once the answer is sent

    serve(tmp_path, check)


def test_a_loader_of_wire_1_gets_its_own_shape(tmp_path):
    """An older loader (no "wire" key) reads each block file's header itself: it is answered
    [index, length] pairs."""
    def check(channel):
        reply, fds = ask(channel.path, {"shard": 0, "name": "00000.tfrecord", "first": 0, "count": 10})
        try:
            assert reply == {"ok": True, "block_size": BS, "blocks": [[0, BS], [2, BS - 5]]} and len(fds) == 2
        finally:
            for fd in fds:
                os.close(fd)

    serve(tmp_path, check)


def test_a_loader_asks_for_a_shard_warm(tmp_path):
    asked = []
    shard_read = Port("shard_read")

    def check(channel):
        request = wire.encode_request(wire.Warm(0, "00000.tfrecord"))
        reply, fds = ask(channel.path, json.loads(request))
        assert reply == {"wire": 2, "ok": True, "queued": True} and fds == []
        reply, _ = ask(channel.path, {"wire": 2, "op": "warm", "shard": 0, "name": "00009.tfrecord"})
        assert reply["ok"] is False and "not 00009.tfrecord" in reply["error"]
        assert channel.warms == 1

    shard_read.connect(asked.append)
    serve(tmp_path, check, shard_read)
    assert [f.path for f in asked] == ["shards/00000.tfrecord"]

    def without_shard_warm(channel):          # no listener: the loader reads a byte instead
        reply, _ = ask(channel.path, {"wire": 2, "op": "warm", "shard": 0, "name": "00000.tfrecord"})
        assert reply == {"wire": 2, "ok": True, "queued": False}
    serve(tmp_path, without_shard_warm)


def test_the_wire_round_trips_and_refuses_what_it_does_not_speak():
    request = wire.Files(3, "00003.tfrecord", 128, 64)
    assert wire.decode_request(wire.encode_request(request)) == request
    assert wire.decode_request(wire.encode_request(wire.Warm(3, "x"))) == wire.Warm(3, "x")
    assert wire.decode_request(b'{"shard": 1, "name": "n", "first": 2, "count": 999}') == \
        wire.Files(1, "n", 2, wire.FILES_PER_ANSWER, wire=1)              # wire 1, count capped
    for bad in (b'{"wire": 3, "op": "files", "shard": 0, "name": "n"}', b'{"wire": 2, "op": "rm", "shard": 0, '
                b'"name": "n"}', b'{"shard": 0, "name": "n", "op": "warm"}', b"[1]", b"\xff", b'{"name": "n"}'):
        with pytest.raises(wire.WireError):
            wire.decode_request(bad)
    extents = [wire.Extent(0, BS, 5), wire.Extent(2, 7, 2 * BS)]
    answer = wire.encode_files(wire.Files(0, "n"), BS, extents)
    assert wire.decode_files(answer, 2) == wire.FilesAnswer(BS, extents)
    for message, fds in ((answer, 1),                                              # descriptors missing
                         (answer.replace(b'"wire": 2', b'"wire": 1'), 2),          # another version
                         (wire.encode_error(2, "no such shard"), 0),
                         (b'{"wire": 2, "ok": true, "block_size": 1, "extents": [[-1, 1, 0]]}', 1),
                         (b"garbage", 0)):
        with pytest.raises(wire.WireError):
            wire.decode_files(message, fds)
    assert wire.decode_warm(wire.encode_warm(True)) is True


def test_bad_requests_get_an_error_and_no_descriptor(tmp_path):
    def check(channel):
        for request in ({"shard": 1, "name": "00001.tfrecord", "first": 0, "count": 1},      # no such shard
                        {"shard": 0, "name": "00009.tfrecord", "first": 0, "count": 1},      # wrong name
                        {"shard": 0, "name": "00000.tfrecord"},                              # fields missing
                        {"shard": "x", "name": "00000.tfrecord", "first": 0, "count": 1}):
            reply, fds = ask(channel.path, request)
            assert reply["ok"] is False and reply["error"] and fds == []
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
    base = tempfile.mkdtemp(prefix="loader-channel-", dir="/tmp")     # pytest's tmp_path is 0700: nobody cannot reach it
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
