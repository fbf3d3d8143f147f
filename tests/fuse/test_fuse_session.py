"""The FUSE session without a kernel: requests written into a SOCK_SEQPACKET socket pair (one
message per request, as /dev/fuse reads give), answers read back. INIT negotiates only what the
kernel offers and answers in the layout of its minor; every request gets exactly one answer or
none (FORGET); an unknown opcode is ENOSYS, a malformed one EINVAL, a handler that raises EIO; an
INTERRUPT cancels a waiting request (EINTR); the session never dies of a request."""

import errno
import logging
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time
import types

import pytest
import trio

from cachefs.daemon import _passthrough_settled
from cachefs.fuse import abi
from cachefs.fuse import poll as poll_module
from cachefs.fuse.looptable import LOOP_FH
from cachefs.fuse.session import Later, Session, SessionOptions
from cachefs.fuse.types import Attr, FileInfo, FuseError
from cachefs.metrics import Metrics


def request(opcode: int, unique: int, nodeid: int = 1, body: bytes = b"") -> bytes:
    return abi.IN_HEADER.pack(abi.IN_HEADER.size + len(body), opcode, unique, nodeid, 0, 0, 1, 0, 0) + body


def init(minor: int = 45, flags: int = abi.ASYNC_READ | abi.PASSTHROUGH | abi.MAX_PAGES | abi.INIT_EXT) -> bytes:
    body = abi.INIT_IN.pack(7, minor, 128 << 10, flags & 0xFFFFFFFF, flags >> 32)
    return request(abi.INIT, 1, body=body)


class Ops:
    """A tiny filesystem: inode 2 is file "f" (5 bytes); a read of fh 9 waits forever."""

    def __init__(self) -> None:
        self.forgotten: list[tuple[int, int]] = []

    async def lookup(self, parent, name, ctx):
        if name != b"f":
            raise FuseError(errno.ENOENT)
        return Attr(ino=2, mode=0o100644, size=5, entry_timeout=1.0, attr_timeout=1.0)

    async def getattr(self, inode, ctx):
        if inode not in (1, 2):
            raise FuseError(errno.ENOENT)
        return Attr(ino=inode, mode=0o40755 if inode == 1 else 0o100644, size=5)

    async def open(self, inode, flags, ctx):
        return FileInfo(fh=7, keep_cache=True)

    async def read(self, fh, offset, size):
        if fh == 9:
            await trio.sleep_forever()
        if fh == 8:
            raise RuntimeError("a bug in a handler")
        return b"hello"[offset:offset + size]

    def forget(self, pairs):
        self.forgotten += pairs


class Wire:
    def __init__(self, kernel: socket.socket) -> None:
        self.kernel = kernel

    def send(self, data: bytes) -> None:
        self.kernel.send(data)

    async def answer(self) -> tuple[int, int, bytes]:
        await trio.lowlevel.wait_readable(self.kernel)
        data = self.kernel.recv(1 << 20)
        length, error, unique = abi.OUT_HEADER.unpack_from(data)
        assert length == len(data)
        return unique, error, data[abi.OUT_HEADER.size:]

    async def nothing(self) -> bool:
        with trio.move_on_after(0.2):
            await trio.lowlevel.wait_readable(self.kernel)
            return False
        return True


def run(test, options: SessionOptions | None = None, ops: Ops | None = None) -> None:
    kernel, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    kernel.setblocking(False)
    ops = ops or Ops()
    session = Session(options or SessionOptions(passthrough=True), fd=daemon.fileno())

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.serve, ops)
            await test(Wire(kernel), session, ops)
            nursery.cancel_scope.cancel()
    try:
        trio.run(main)
    finally:
        kernel.close()
        daemon.close()


def test_a_kernel_without_passthrough_is_said_once_and_counted(caplog):
    """INIT from a kernel that does not offer FUSE passthrough: one log line; the daemon then
    counts the fallback (reason ``kernel``) and has its tiers write no exact cache files."""
    caplog.set_level(logging.INFO, logger="cachefs.fuse.session")
    metrics, off = Metrics(), []

    async def test(wire, session, ops):
        wire.send(init(minor=45, flags=abi.ASYNC_READ | abi.MAX_PAGES | abi.INIT_EXT))
        await wire.answer()
        assert not session.passthrough
        tiers = types.SimpleNamespace(handover=types.SimpleNamespace(enabled=True), passthrough_off=lambda: off.append(1))
        _passthrough_settled(types.SimpleNamespace(metrics=metrics, tiers=tiers,
                                                   fuse=types.SimpleNamespace(kernel=session)))
    run(test)
    assert metrics.counter_value("cachefs_passthrough_fallbacks_total", reason="kernel") == 1 and off == [1]
    assert sum("does not offer passthrough" in r.getMessage() for r in caplog.records) == 1


def test_init_agrees_only_what_the_kernel_offers_and_answers_in_its_layout():
    async def test(wire, session, ops):
        wire.send(init(minor=45))
        unique, error, body = await wire.answer()
        major, minor, _, flags, max_bg, _, max_write, _, max_pages, _, flags2, depth = abi.INIT_OUT.unpack(body)
        assert (unique, error, major, minor, max_write, max_pages) == (1, 0, 7, 45, abi.MAX_WRITE, 256)
        agreed = flags | flags2 << 32
        assert agreed & abi.PASSTHROUGH and depth == 1 and max_bg == 64
        assert not agreed & abi.DO_READDIRPLUS              # not offered by this "kernel"
        assert session.passthrough
    run(test)

    async def old(wire, session, ops):
        wire.send(init(minor=26, flags=abi.ASYNC_READ | abi.DO_READDIRPLUS))
        unique, error, body = await wire.answer()
        assert error == 0 and len(body) == 64                 # fuse_init_out is 64 bytes since 7.23
        assert struct.unpack_from("<II", body) == (7, 26) and not session.passthrough
        flags = struct.unpack_from("<I", body, 12)[0]
        assert flags & abi.DO_READDIRPLUS and not flags & abi.INIT_EXT
    run(old)


@pytest.mark.allow_warnings
def test_a_kernel_too_old_is_refused():
    async def test(wire, session, ops):
        wire.send(init(minor=22))
        assert (await wire.answer())[1] == -errno.EPROTO
    run(test)


@pytest.mark.allow_warnings      # the handler that raised is logged with its traceback
def test_each_request_gets_its_answer_and_errors_are_errnos():
    async def test(wire, session, ops):
        wire.send(init())
        await wire.answer()
        wire.send(request(abi.LOOKUP, 10, body=b"f\0"))
        unique, error, body = await wire.answer()
        assert (unique, error) == (10, 0) and abi.ENTRY_OUT.unpack(body)[0] == 2
        wire.send(request(abi.LOOKUP, 11, body=b"nope\0"))
        assert await wire.answer() == (11, -errno.ENOENT, b"")
        wire.send(request(abi.GETATTR, 12, nodeid=99, body=abi.GETATTR_IN.pack(0, 0, 0)))
        assert (await wire.answer())[:2] == (12, -errno.ENOENT)              # a bad node id: an errno
        wire.send(request(abi.READ, 13, body=abi.READ_IN.pack(7, 1, 3, 0, 0, 0, 0)))
        assert await wire.answer() == (13, 0, b"ell")
        wire.send(request(abi.READ, 14, body=abi.READ_IN.pack(8, 0, 3, 0, 0, 0, 0)))
        assert (await wire.answer())[:2] == (14, -errno.EIO)                 # a handler that raised
        wire.send(request(abi.GETXATTR, 15, body=abi.GETXATTR_IN.pack(0, 0) + b"user.x\0"))
        assert (await wire.answer())[:2] == (15, -errno.ENOSYS)              # nobody serves it
        wire.send(request(200, 16))
        assert (await wire.answer())[:2] == (16, -errno.ENOSYS)              # an unknown opcode
        wire.send(request(abi.READ, 17, body=b"\1\2"))
        assert (await wire.answer())[:2] == (17, -errno.EINVAL)              # malformed
        wire.send(request(abi.FORGET, 0, nodeid=2, body=abi.FORGET_IN.pack(3)))
        body = abi.BATCH_FORGET_IN.pack(2, 0) + abi.FORGET_ONE.pack(2, 1) + abi.FORGET_ONE.pack(5, 4)
        wire.send(request(abi.BATCH_FORGET, 0, body=body))
        assert await wire.nothing()                                          # FORGETs get no answer
        assert ops.forgotten == [(2, 3), (2, 1), (5, 4)]
        wire.send(request(abi.OPEN, 18, nodeid=2, body=abi.OPEN_IN.pack(os.O_RDONLY, 0)))
        unique, error, body = await wire.answer()
        assert abi.OPEN_OUT.unpack(body) == (7, abi.FOPEN_KEEP_CACHE, 0)
        wire.send(request(abi.LOOKUP, 19, body=b"f\0"))                      # still serving
        assert (await wire.answer())[:2] == (19, 0)
    run(test)


def test_an_interrupt_cancels_a_waiting_request_and_a_late_one_is_ignored():
    async def test(wire, session, ops):
        wire.send(init())
        await wire.answer()
        wire.send(request(abi.READ, 30, body=abi.READ_IN.pack(9, 0, 5, 0, 0, 0, 0)))
        assert await wire.nothing()                                          # waiting
        wire.send(request(abi.INTERRUPT, 31, body=abi.INTERRUPT_IN.pack(30)))
        assert await wire.answer() == (30, -errno.EINTR, b"")
        wire.send(request(abi.INTERRUPT, 32, body=abi.INTERRUPT_IN.pack(12345)))   # answered long ago
        assert await wire.nothing()
    run(test)


def test_notifications_are_unsolicited_messages():
    async def test(wire, session, ops):
        session.notify_store(2, 0, b"hello")
        unique, code, body = await wire.answer()
        assert (unique, code) == (0, abi.NOTIFY_STORE)
        assert abi.NOTIFY_STORE_OUT.unpack_from(body) == (2, 0, 5, 0) and body.endswith(b"hello")
        session.notify_inval_entry(1, b"f")
        unique, code, body = await wire.answer()
        assert code == abi.NOTIFY_INVAL_ENTRY and body.endswith(b"f\0")
    run(test)


@pytest.mark.parametrize("minor", [31, 36, 40, 45])
def test_every_minor_from_7_31_is_answered(minor):
    async def test(wire, session, ops):
        wire.send(init(minor=minor, flags=abi.ASYNC_READ | abi.INIT_EXT | (abi.PASSTHROUGH if minor >= 40 else 0)))
        unique, error, body = await wire.answer()
        assert error == 0 and struct.unpack_from("<II", body) == (7, minor)
        assert session.passthrough == (minor >= 40)
    run(test)


def test_zero_message_opens_are_asked_for_only_where_offered_and_reads_with_no_handle_get_one():
    """--fuse-no-open: INIT asks for FUSE_NO_OPEN_SUPPORT; once agreed, OPEN is ENOSYS (the kernel
    opens files itself from then on) and a READ with fh 0 is served on the handle the daemon
    keeps for its inode. A kernel that does not offer it gets OPENs answered as always."""
    class NoOpenOps(Ops):
        def __init__(self) -> None:
            super().__init__()
            self.implicit: list[int] = []

        def implicit_fh(self, inode, ctx, ioctl_cmd=None):
            self.implicit.append(inode)
            return 7

    async def offered(wire, session, ops):
        wire.send(init(flags=abi.ASYNC_READ | abi.NO_OPEN_SUPPORT | abi.INIT_EXT))
        flags = abi.INIT_OUT.unpack((await wire.answer())[2])[3]
        assert flags & abi.NO_OPEN_SUPPORT
        wire.send(request(abi.OPEN, 20, nodeid=2, body=abi.OPEN_IN.pack(os.O_RDONLY, 0)))
        assert await wire.answer() == (20, -errno.ENOSYS, b"")
        wire.send(request(abi.READ, 21, nodeid=2, body=abi.READ_IN.pack(0, 1, 3, 0, 0, 0, 0)))
        assert await wire.answer() == (21, 0, b"ell") and ops.implicit == [2]
    run(offered, SessionOptions(no_open=True), NoOpenOps())

    async def not_offered(wire, session, ops):
        wire.send(init(flags=abi.ASYNC_READ | abi.INIT_EXT))
        flags = abi.INIT_OUT.unpack((await wire.answer())[2])[3]
        assert not flags & abi.NO_OPEN_SUPPORT
        wire.send(request(abi.OPEN, 22, nodeid=2, body=abi.OPEN_IN.pack(os.O_RDONLY, 0)))
        unique, error, body = await wire.answer()
        assert (unique, error) == (22, 0) and abi.OPEN_OUT.unpack(body)[0] == 7
    run(not_offered, SessionOptions(no_open=True), NoOpenOps())


def test_the_loops_table_answers_its_requests_before_the_operations_see_them():
    """A mount whose loops could run keeps their table even with no loop process (``--fuse-loops
    0``): the daemon's loop answers a read-only OPEN of a published inode from it (a table handle,
    the backing id, passthrough), its RELEASE and isatty, and tells the operations the opens in one
    batch once no request is left; an open for writing, or of an inode not published, goes to the
    operations; the release of an earlier daemon's table handle is answered, never counted. A
    metrics scrape's thread waits (``settled``) until the opens answered before it are told."""
    class TableOps(Ops):
        def __init__(self) -> None:
            super().__init__()
            self.table_opens: list[int] = []

        def table_opened(self, inodes):
            self.table_opens += inodes

    async def test(wire, session, ops):
        wire.send(init())
        await wire.answer()
        with trio.fail_after(10):
            while session.procs is None:
                await trio.sleep(0.01)
        table = session.procs.table
        assert table.publish(2, 5, 77)
        read_only, writable = abi.OPEN_IN.pack(os.O_RDONLY, 0), abi.OPEN_IN.pack(os.O_RDWR, 0)
        wire.send(request(abi.OPEN, 40, nodeid=2, body=read_only))
        wire.send(request(abi.OPEN, 41, nodeid=2, body=read_only))
        first, second = await wire.answer(), await wire.answer()
        for unique, (got, error, body) in zip((40, 41), (first, second), strict=True):
            fh, flags, backing_id = abi.OPEN_OUT.unpack(body)
            assert (got, error, flags, backing_id) == (unique, 0, abi.FOPEN_PASSTHROUGH, 77)
            assert fh == LOOP_FH | (table.nonce & 0xFFFF) << 32 | 5
        await trio.to_thread.run_sync(session.settled)          # as a metrics scrape asks, from its thread
        assert ops.table_opens == [2, 2]
        wire.send(request(abi.OPEN, 42, nodeid=2, body=writable))          # the operations' to answer
        assert await wire.answer() == (42, 0, abi.OPEN_OUT.pack(7, abi.FOPEN_KEEP_CACHE, 0))
        wire.send(request(abi.OPEN, 43, nodeid=3, body=read_only))         # not published
        assert (await wire.answer())[:2] == (43, 0)
        wire.send(request(abi.IOCTL, 44, nodeid=2, body=abi.IOCTL_IN.pack(fh, 0, 0x5401, 0, 0, 60)))
        assert await wire.answer() == (44, -errno.ENOTTY, b"")
        wire.send(request(abi.RELEASE, 45, nodeid=2, body=abi.RELEASE_IN.pack(fh, 0, 0, 0)))
        assert await wire.answer() == (45, 0, b"")
        earlier = LOOP_FH | ((table.nonce + 1) & 0xFFFF) << 32 | 5
        wire.send(request(abi.RELEASE, 46, nodeid=2, body=abi.RELEASE_IN.pack(earlier, 0, 0, 0)))
        assert await wire.answer() == (46, 0, b"")
        assert table.open_files(5) == 1                          # two opened, one of them released
        assert table.stats(0) == {"opens": 2, "releases": 2, "ioctls": 1, "forwarded": 0}
        assert ops.table_opens == [2, 2]
    run(test, SessionOptions(passthrough=True, loop_processes="auto"), TableOps())


def test_no_poll_holds_up_a_request_answered_in_a_task():
    """While a request is answered by a task (here a GETATTR waiting 50 ms, as for the store's
    answer), the loop does not poll after the requests that come meanwhile (one answered at
    once): trio would see the task's wait end only when the poll ends (a first window of 250 ms)."""
    class InATask(Ops):
        def now_getattr(self, inode):
            if inode == 2:
                raise Later
            return Attr(ino=inode, mode=0o40755, size=5)

        async def getattr(self, inode, ctx):
            await trio.sleep(0.05)
            return Attr(ino=inode, mode=0o100644, size=5)

    async def test(wire, session, ops):
        wire.send(init())
        await wire.answer()
        began = time.monotonic()
        wire.send(request(abi.GETATTR, 60, nodeid=2, body=bytes(16)))
        await trio.sleep(0.01)
        wire.send(request(abi.GETATTR, 61, nodeid=1, body=bytes(16)))
        assert (await wire.answer())[:2] == (61, 0)
        assert (await wire.answer())[:2] == (60, 0)
        took = time.monotonic() - began
        assert 0.05 <= took < 0.2, took
    run(test, SessionOptions(poll_s=1.0), InATask())


@pytest.mark.parametrize("poll_s", [0.0, 0.001])
def test_the_loop_polls_for_a_next_request_only_as_long_as_asked(poll_s, monkeypatch):
    """``--fuse-poll-us``: after its last request, with no task waiting to run, the loop polls the
    descriptor a while (at first a quarter of the ceiling, then as it learns: ``poll.py``) before
    it sleeps in trio; a request that comes meanwhile is read and answered with no wake-up
    (counted: ``found``). Off (0), there is no poll. The kernel is another process, as it is for
    a mount, which sends 40 requests ~0.1 ms apart (a hot reader) and tells what it got only at
    the end (a thread of ours that woke meanwhile would share the GIL, or the CPU, with the poll).
    (Requests answered at once: a task to run, as an answer in a task is, stops the poll.)"""
    monkeypatch.setattr(poll_module, "_busy", lambda cpus: False)     # whatever else runs here (test_poll.py)

    class AtOnce(Ops):
        def now_getattr(self, inode):
            return Attr(ino=inode, mode=0o100644, size=5)

    kernel_side = textwrap.dedent("""
        import os, select, socket, struct, sys, time
        sock = socket.socket(fileno=int(sys.argv[1]))
        sock.setblocking(True)
        got = []
        for unique in range(50, 90):
            sock.send(struct.pack("<IIQQIIIHH", 56, OPCODE, unique, 2, 0, 0, 1, 0, 0) + bytes(16))
            select.select([sock], [], [], 10)
            got.append(struct.unpack_from("<IiQ", sock.recv(1 << 16))[1:])
            end = time.perf_counter() + 0.0001      # the reader's work: inside a 1 ms ceiling
            while time.perf_counter() < end:
                pass
        print(got == [(0, unique) for unique in range(50, 90)])
    """).replace("OPCODE", str(abi.GETATTR))

    async def test(wire, session, ops):
        wire.send(init())
        await wire.answer()
        fd = wire.kernel.fileno()
        kernel = subprocess.Popen([sys.executable, "-c", kernel_side, str(fd)], pass_fds=[fd],
                                  stdout=subprocess.PIPE, text=True)
        try:
            out, _ = await trio.to_thread.run_sync(kernel.communicate, None, 20)
        finally:
            kernel.kill()
            kernel.wait()
        assert out.strip() == "True"
        if not poll_s:
            assert session.poll is None
        else:       # (most, on an idle machine; a loaded one takes the CPU from the poll or the kernel)
            assert session.poll.found >= 1, str(session.poll.status())
    run(test, SessionOptions(poll_s=poll_s), AtOnce())
