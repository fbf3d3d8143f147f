"""Request loops as processes (``--fuse-loop-kind process``): the daemon's side.

Each loop process (``loop_worker.py``) reads requests from its own clone of the session's
descriptor and answers the opens of published backings, and their releases, by itself; the rest
it sends here, as read, on its socket, and the session answers them on the loop's descriptor (the
daemon keeps a copy of each). The loops read one shared table (``looptable.py``): which inode has
which backing id, and how many files each loop opened and released on it.

What the daemon promises the kernel (one backing per inode while any file of it is open; an id
alive while an open may still be answered with it) holds across processes this way:

- a backing id is published (``publish``) once registered, and stays registered while published;
- to close one, it is first taken out of the table (``retract``), then closed only when every
  loop has finished the request it was answering at that moment (``closable``: no loop still
  answers an open with it) and the loops' files on it are all released. Until then the daemon
  answers an open of that inode with the same id (``Backings``: a closing backing is reused);
- a loop that exits (killed, crashed) counts as between requests; the kernel sends what it had
  read again (FUSE_NOTIFY_RESEND).

Loops run only where what they answer cannot change: an ``--immutable`` mount with passthrough
and a kernel that can send requests again (Linux 6.9+). Elsewhere the session keeps thread loops.
The table is made wherever they could run, with no process too (``count`` 0, a mount with no
extra loops): the daemon's own loop then answers the opens of published backings from it the
same lean way (``LoopTable.answerer``).
"""

import errno
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from cachefs.fuse.looptable import READY, LoopTable

log = logging.getLogger("cachefs.fuse.session")

_SOCKET_BUFFER = 4 << 20          # a forwarded request is one message (a WRITE can be 1 MiB)
TICK = 0.25                       # seconds between checks of the backings waiting to close


@dataclass(eq=False)
class Loop:
    index: int
    fd: int                                   # its cloned /dev/fuse descriptor (ours is a copy)
    sock: socket.socket
    proc: subprocess.Popen
    gone: bool = False
    ready: bool = False                       # it reads requests (it said so: ``READY``)


@dataclass(slots=True)
class Closing:
    """A backing taken out of the table: closable once the loops have moved on and released it."""

    slot: int
    since: list[int] = field(default_factory=list)


class LoopProcesses:
    def __init__(self, dispatch: Callable[[memoryview, int], None], resend: Callable[[], None], *,
                 count: int, nonce: int, slots: int, ready: Callable[[], None] = lambda: None) -> None:
        self._dispatch = dispatch
        self._resend = resend
        self._ready = ready                       # called when a loop starts reading
        self.table = LoopTable.create(loops=count, slots=slots, nonce=nonce)
        self.loops: list[Loop] = []
        self._free: list[int] = []               # slots given back (a new one is ``_next`` while any is left)
        self._next = 0
        self._gone: set[int] = set()
        self.ticks: list[Callable[[], None]] = []     # called every TICK (Backings.sweep)
        self.forwarded = 0
        self.unmounted = False                    # a loop found the connection gone
        self._changed = trio.Event()              # set when a loop starts reading or exits

    @property
    def reading(self) -> bool:
        """Some loop reads requests (else the session's own loop reads them: also while the loops
        start, a Python process each, or a new mount and a hand-over would wait for them)."""
        return any(loop.ready and not loop.gone for loop in self.loops)

    async def changed(self) -> None:
        """Until a loop starts reading or exits, or ``nudge``."""
        await self._changed.wait()

    def nudge(self) -> None:
        """Wake whoever waits in ``changed`` (the daemon has work for a quiet moment)."""
        self._change()

    def _change(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # ---- the processes ---------------------------------------------------------------------------
    def start(self, fds: list[int]) -> None:
        """One loop process per descriptor in ``fds`` (clones of the session's; none: the table only)."""
        if not fds:
            log.debug("FUSE opens of published backings answered from the loop table by the daemon's loop")
            return
        for index, fd in enumerate(fds, start=1):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            for sock in (ours, theirs):
                _big_buffers(sock)
            proc = subprocess.Popen(
                [sys.executable, "-m", "cachefs.fuse.loop_worker", str(fd), str(theirs.fileno()),
                 str(self.table.fd), str(index)],
                pass_fds=(fd, theirs.fileno(), self.table.fd), stdin=subprocess.DEVNULL, close_fds=True)
            theirs.close()
            ours.setblocking(False)
            self.loops.append(Loop(index, fd, ours, proc))
        log.info("%d FUSE request loop process(es) on cloned descriptors (pids %s)", len(self.loops),
                 " ".join(str(loop.proc.pid) for loop in self.loops))

    async def run(self) -> None:
        """Take what the loops send and tick the closing backings, until cancelled."""
        async with trio.open_nursery() as nursery:
            for loop in self.loops:
                nursery.start_soon(self._receive, loop)
            while True:
                await trio.sleep(TICK)
                for tick in self.ticks:
                    tick()

    async def _receive(self, loop: Loop) -> None:
        buf = bytearray(_SOCKET_BUFFER)           # (recv(n) would allocate n bytes per message)
        view = memoryview(buf)
        while True:
            try:
                length = loop.sock.recv_into(buf)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(loop.sock)
                continue
            except OSError as exc:
                length = 0
                log.warning("request loop %d: %s", loop.index, exc)
            if not length:
                self._lost(loop)
                return
            if length == len(READY) and view[:length] == READY:      # (a request is 40 bytes at least)
                loop.ready = True
                log.debug("request loop process %d reads requests", loop.index)
                self._change()
                self._ready()
                continue
            self.forwarded += 1
            self._dispatch(memoryview(bytes(view[:length])), loop.fd)    # its own copy: a task may keep it

    def _lost(self, loop: Loop) -> None:
        if loop.gone:
            return                            # we stopped it
        loop.gone = True
        self._gone.add(loop.index)
        try:
            status = loop.proc.wait(timeout=2)     # its socket closed: it is exiting
        except subprocess.TimeoutExpired:
            status = None
        if status == 0:
            self.unmounted = True             # it read ENODEV: the connection is gone
        else:
            log.warning("FUSE request loop process %d (pid %d) exited (status %s): the kernel sends again what "
                        "it had read%s", loop.index, loop.proc.pid, status,
                        "" if self.reading else "; the daemon reads every request itself from now on")
            try:
                self._resend()
            except Exception as exc:  # noqa: BLE001  (a connection going away: its readers get ENOTCONN anyway)
                log.warning("cannot ask the kernel to send the lost loop's requests again: %s", exc)
        self._change()

    def stop(self) -> None:
        """Kill the loops (a hand-over, an unmount): what they had read is sent again to whoever
        serves next."""
        for loop in self.loops:
            loop.gone = True
            self._gone.add(loop.index)
            if loop.proc.poll() is None:
                loop.proc.send_signal(signal.SIGKILL)
        for loop in self.loops:
            try:
                loop.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.warning("FUSE request loop pid %d did not exit", loop.proc.pid)
            loop.sock.close()

    def close(self) -> None:
        self.stop()
        self.loops.clear()
        self.table.close()

    # ---- the table (Backings) --------------------------------------------------------------------
    def publish(self, inode: int, backing_id: int, slot: int = -1) -> int:
        """Let the loops answer opens of ``inode`` with ``backing_id``: its slot (a new one unless
        given), or -1 when it cannot be published (no slot free, an inode past the table)."""
        if slot < 0:
            if self._free:
                slot = self._free.pop()
            elif self._next < self.table.slots:
                slot, self._next = self._next, self._next + 1
            else:
                return -1
            self.table.reset(slot)
        if not self.table.publish(inode, slot, backing_id):
            self._free.append(slot)
            return -1
        return slot

    def retract(self, inode: int, slot: int) -> Closing:
        self.table.retract(inode)
        return Closing(slot, self.table.positions())

    def withdraw(self, inode: int, slot: int) -> None:
        """Out of the table and its slot free at once (no loop can hold a file of ``inode`` open:
        the kernel forgot it, or the session ends)."""
        self.table.retract(inode)
        self.free(slot)

    def closable(self, closing: Closing) -> bool:
        return self.table.passed(closing.since, self._gone) and self.table.open_files(closing.slot) == 0

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def totals(self) -> dict[str, int]:
        """What every loop answered and forwarded, summed (the metrics)."""
        totals: dict[str, int] = {}
        for loop in self.loops:
            for name, value in self.table.stats(loop.index).items():
                totals[name] = totals.get(name, 0) + value
        return totals

    def status(self) -> dict:
        """Each loop's pid and what it answered; the files the loops' opens keep open now."""
        used = self._next                         # (no slot past it was ever counted on)
        opened = sum(sum(row[:used]) for row in self.table.opened)
        released = sum(sum(row[:used]) for row in self.table.released)
        return {"loops": [{"pid": loop.proc.pid, "running": not loop.gone, "reading": loop.ready and not loop.gone,
                           **self.table.stats(loop.index)}
                          for loop in self.loops],
                "daemon": {k: n for k, n in self.table.stats(0).items() if k != "forwarded"},     # from the table
                "open_files": (opened - released) & 0xFFFFFFFF, "forwarded": self.forwarded,
                "published": self._next - len(self._free)}


def _big_buffers(sock: socket.socket) -> None:
    for force, plain in ((33, socket.SO_SNDBUF), (32, socket.SO_RCVBUF)):    # SO_SNDBUFFORCE, SO_RCVBUFFORCE
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, _SOCKET_BUFFER)
        except OSError as exc:
            if exc.errno != errno.EPERM:
                raise
            sock.setsockopt(socket.SOL_SOCKET, plain, _SOCKET_BUFFER)


def new_nonce() -> int:
    return int.from_bytes(os.urandom(2), "little") or 1
