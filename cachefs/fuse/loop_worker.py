"""A request-loop process: reads requests from a cloned ``/dev/fuse`` descriptor and answers what
the loop table (``looptable.py``) lets it answer alone; everything else goes to the daemon.

Answered here, with no Python of the daemon's and no GIL of its: the OPEN of an inode the daemon
published a backing id for (opened for reading), the RELEASE of a handle a loop gave out, and an
ioctl on one (ENOTTY: CPython's ``open`` asks ``isatty`` of every file). Anything else is sent,
as read, to the daemon on this loop's socket; the daemon answers it on this loop's descriptor
(its own copy). A loop dies with its daemon (``PR_SET_PDEATHSIG``); the requests it had read are
sent again by the kernel to the daemon that takes the mount over (FUSE_NOTIFY_RESEND).

Run by the daemon as ``python -m cachefs.fuse.loop_worker FUSE_FD SOCKET_FD TABLE_FD LOOP``.
"""

import ctypes
import errno
import os
import signal
import socket
import sys
import time

from cachefs.fuse import abi
from cachefs.fuse.looptable import READY, LoopTable

_PR_SET_PDEATHSIG = 1


def serve(fuse_fd: int, sock: socket.socket, table: LoopTable, loop: int) -> int:
    buf = bytearray(abi.BUFFER_SIZE)
    view = memoryview(buf)
    seq, row = table.seq, loop * 8
    answer = table.answerer(loop)
    readv, send = os.readv, sock.send
    while True:
        try:
            length = readv(fuse_fd, [view])
        except InterruptedError:
            continue
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.EINTR, errno.EAGAIN):
                continue              # a request interrupted before it was read
            if exc.errno == errno.ENODEV:
                return 0              # unmounted: the one clean end
            print(f"cachefs loop {loop}: reading requests: {exc}", file=sys.stderr)
            return 3
        seq[row] += 1                 # odd: answering
        try:
            request = view[:length]
            if not answer(request, fuse_fd):
                send(request)
                seq[row + 4] += 1     # forwarded (the answerer counts the rest)
        except OSError as exc:
            if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                return 1              # the daemon is gone: the next one has the kernel send it again
            if exc.errno == errno.EMSGSIZE:      # larger than the socket takes
                unique = abi.IN_HEADER.unpack_from(view)[2]
                try:
                    os.writev(fuse_fd, [abi.OUT_HEADER.pack(abi.OUT_HEADER.size, -errno.EIO, unique)])
                except OSError:
                    pass
            else:
                print(f"cachefs loop {loop}: {exc}", file=sys.stderr)
        seq[row] += 1                 # even: between requests


def main(argv: list[str]) -> int:
    fuse_fd, sock_fd, table_fd, loop = (int(a) for a in argv[:4])
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent or parent == 1:
        return 1                      # the daemon died before the death signal was set
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # the daemon ends its loops; a Ctrl-C is for it
    os.set_blocking(fuse_fd, True)
    sock = socket.socket(fileno=sock_fd)
    table = LoopTable.attach(table_fd)
    if not 1 <= loop <= table.loops:
        return 2
    time.sleep(float(os.environ.get("CACHEFS_TEST_LOOP_START", 0)))     # tests: a loop slow to start
    try:
        sock.send(READY)              # the daemon's own loop stops reading once one loop does
    except OSError:
        return 1
    return serve(fuse_fd, sock, table, loop)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
