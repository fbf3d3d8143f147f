"""The daemon's CPU per OPEN + RELEASE pair answered from the loops' table, with no kernel.

A ``Session`` serves one end of a SOCK_SEQPACKET socket pair (one message per request, as reads
of ``/dev/fuse`` give); a child process plays the kernel on the other end: INIT, then opens of one
published inode and the releases of their handles. What is measured is the daemon process's own
CPU (``getrusage``) while the child runs, so the number is the session's Python and syscalls per
pair: the request loop, its waits in trio, the table's answers.

  --burst     the child writes ``--window`` opens before it reads their answers (many readers:
              the loop finds requests waiting); without it, one open at a time (one reader: the
              loop sleeps in trio between requests and is woken for each)
  --poll-us   the session's ``--fuse-poll-us`` (default 0 here: off)
  --gap-us    one at a time: the reader's own work after each answer, spent on CPU (a hot read)
              or, with ``--gap-sleeps``, asleep (a disk read); pairs/s then shows the round trips

    .venv/bin/python -m benchmarks.session_pairs --pairs 60000 --window 8 --burst

Compare two commits side by side with ``PYTHONPATH`` pointing at a worktree of each.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import time

import trio

from cachefs.fuse import abi
from cachefs.fuse.session import Session, SessionOptions

_INODE, _SLOT, _BACKING = 2, 5, 77


def request(opcode: int, unique: int, nodeid: int = 1, body: bytes = b"") -> bytes:
    return abi.IN_HEADER.pack(abi.IN_HEADER.size + len(body), opcode, unique, nodeid, 0, 0, 1, 0, 0) + body


class _Ops:
    """The operations the table's answers tell (nothing else is asked)."""

    def table_opened(self, inodes) -> None:
        pass

    def forget(self, pairs) -> None:
        pass


def _gap(seconds: float, spin: bool) -> None:
    """The reader's own work between two requests: CPU (a hot read) or a sleep (a disk read)."""
    if seconds <= 0:
        return
    if not spin:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _kernel(sock: socket.socket, pairs: int, window: int, burst: bool, gap: float = 0.0, spin: bool = True) -> None:
    """The child: ``pairs`` opens and their releases, ``window`` files open at most; ``gap``
    seconds of the reader's own work after each answer it waited for (one at a time)."""
    read_only = abi.OPEN_IN.pack(os.O_RDONLY, 0)
    unique, handles = 100, []

    def fh_of(answer: bytes) -> int:
        return abi.OPEN_OUT.unpack_from(answer, abi.OUT_HEADER.size)[0]

    for _ in range(pairs):
        sock.send(request(abi.OPEN, unique, _INODE, read_only))
        unique += 1
        if burst:
            handles.append(None)
        else:
            handles.append(fh_of(sock.recv(4096)))
            _gap(gap, spin)
        if len(handles) < window:
            continue
        if burst:
            handles = [fh_of(sock.recv(4096)) for _ in handles]
        for fh in handles:
            sock.send(request(abi.RELEASE, unique, _INODE, abi.RELEASE_IN.pack(fh, 0, 0, 0)))
            unique += 1
            if not burst:
                sock.recv(4096)
                _gap(gap, spin)
        if burst:
            for _ in handles:
                sock.recv(4096)
        handles = []


async def _measure(pairs: int, window: int, burst: bool, poll: float = 0.0, gap: float = 0.0, spin: bool = True) -> dict:
    kernel, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    session = Session(SessionOptions(passthrough=True, loop_processes="auto", poll_s=poll), fd=daemon.fileno())
    flags = abi.ASYNC_READ | abi.PASSTHROUGH | abi.MAX_PAGES | abi.INIT_EXT
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.serve, _Ops())
            kernel.send(request(abi.INIT, 1, body=abi.INIT_IN.pack(7, 45, 128 << 10, flags & 0xFFFFFFFF, flags >> 32)))
            with trio.fail_after(10):
                await trio.lowlevel.wait_readable(kernel)
                kernel.recv(1 << 20)
                while session.procs is None:
                    await trio.sleep(0.01)
            session.procs.table.publish(_INODE, _SLOT, _BACKING)
            before, began = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            pid = os.fork()
            if pid == 0:
                try:
                    _kernel(kernel, pairs, window, burst, gap, spin)
                finally:
                    os._exit(0)
            await trio.to_thread.run_sync(os.waitpid, pid, 0)
            after, took = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - began
            nursery.cancel_scope.cancel()
    finally:
        kernel.close()
        daemon.close()
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return {"pairs": pairs, "window": window, "burst": burst, "us_per_pair": (user + system) / pairs * 1e6,
            "user_us_per_pair": user / pairs * 1e6, "pairs_per_s": pairs / took,
            "poll": session.poll.status() if session.poll is not None else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=60000)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--burst", action="store_true")
    parser.add_argument("--poll-us", type=int, default=0, help="the session's --fuse-poll-us")
    parser.add_argument("--gap-us", type=int, default=0,
                        help="one at a time: the reader's own work after each answer (us)")
    parser.add_argument("--gap-sleeps", action="store_true", help="the gap is a sleep (a disk read), not CPU")
    args = parser.parse_args()
    row = trio.run(_measure, args.pairs, args.window, args.burst, args.poll_us / 1e6, args.gap_us / 1e6,
                   not args.gap_sleeps)
    print(f"{row['pairs']} pairs, window {row['window']}{', burst' if row['burst'] else ''}, poll {args.poll_us} us, "
          f"gap {args.gap_us} us{' asleep' if args.gap_sleeps else ''}: "
          f"{row['us_per_pair']:.1f} us of daemon CPU per pair (user {row['user_us_per_pair']:.1f}), "
          f"{row['pairs_per_s']:,.0f} pairs/s" + (f"; poll {row['poll']}" if row["poll"] else ""))


if __name__ == "__main__":
    main()
