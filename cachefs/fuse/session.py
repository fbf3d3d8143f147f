"""A FUSE session over ``/dev/fuse``: INIT, the request loop, replies and notifications.

One trio task reads requests (the descriptor is non-blocking; it waits for it with trio) and
dispatches each by its opcode through one table. A handler that has a synchronous fast path
(``Operations.now_<op>``: state that needs no await) is answered at once, in the reading task;
the others run as trio tasks. Every reply is one ``writev``. The kernel's requests carry a unique
id; INTERRUPT cancels a request still waiting (a READ on a GET, a LOOKUP on a listing) and the
kernel gets EINTR; a request that has already been answered ignores it.

A session may also adopt a connection another process mounted and initialized (``adopt``: a
daemon taking over a live mount, ``cachefs/keeper.py``): it skips INIT, keeps what INIT settled,
and first asks the kernel to send again every request read but not answered
(``FUSE_NOTIFY_RESEND``); a resent request's unique has bit 63 set and is answered as received.
Where the kernel cannot resend (before Linux 6.9), a session under a keeper reads each request
straight into a slot of an in-flight log that outlives it, freed once the request is answered
(``inflight.py``); a session that adopts the connection answers what its predecessor left there.
``stop_reading`` ends the reading and lets the requests in hand be answered (a hand-over). The
extra request loops on cloned descriptors (threads or processes) are in ``loops.py``.

Errors: a handler's ``FuseError`` is its answer; an exception the ``Operations`` layer let through
is a bug and answers EIO (logged with its traceback); an opcode nobody serves answers ENOSYS; a
malformed request answers EINVAL. The session never dies of a request.
"""

import errno
import fcntl
import logging
import os
import struct
import threading
import time
from collections.abc import Callable

import trio

from cachefs.errors import CachefsError, NeedsWait
from cachefs.fuse import abi, mount
from cachefs.fuse.inflight import InflightLog
from cachefs.fuse.loop_procs import LoopProcesses
from cachefs.fuse.loops import RequestLoops
from cachefs.fuse.mount import MountOptions
from cachefs.fuse.opcodes import Opcodes
from cachefs.fuse.poll import Poll
from cachefs.fuse.settings import Negotiated, SessionOptions
from cachefs.fuse.types import Context, FuseError
from cachefs.ports import Port

log = logging.getLogger(__name__)

_BURST = 16                  # requests answered in a row before the loop lets other tasks run
_INTERRUPTIBLE = {abi.READ, abi.LOOKUP, abi.GETATTR, abi.OPEN, abi.OPENDIR, abi.READDIR, abi.READDIRPLUS}
_NO_REPLY = {abi.FORGET, abi.BATCH_FORGET, abi.INTERRUPT}


Later = NeedsWait       # a fast path that cannot answer without waiting: the request goes to a task


RESENT = 1 << 63          # the bit the kernel sets in the unique of a request it sends again


def _results_waiting() -> int:
    """Work handed to trio's thread from other threads (a worker thread's result), not yet run."""
    return trio.lowlevel.current_statistics().run_sync_soon_queue_size


class Request:
    __slots__ = ("opcode", "unique", "nodeid", "uid", "gid", "pid", "body", "fd", "slot", "replayed")

    def __init__(self, data: memoryview, fd: int, slot: int = -1, replayed: bool = False) -> None:
        self.fd = fd                  # the descriptor it was read from: its answer goes there
        self.slot = slot              # its slot in the in-flight log (-1: none)
        self.replayed = replayed      # read by a dead predecessor, found in the in-flight log
        (length, self.opcode, self.unique, self.nodeid, self.uid, self.gid, self.pid,
         _ext, _pad) = abi.IN_HEADER.unpack_from(data)
        self.body = data[abi.IN_HEADER.size:length]

    def ctx(self) -> Context:
        return Context(self.uid, self.gid, self.pid, resent=self.replayed or bool(self.unique & RESENT))

    def name(self, start: int = 0) -> bytes:
        """The NUL-terminated name at ``start`` of the body."""
        raw = bytes(self.body[start:])
        return raw[:raw.index(b"\0")] if b"\0" in raw else raw


class Session(RequestLoops, Opcodes):
    """One mount's connection. ``kernel`` side API for handlers: ``notify_store``,
    ``notify_inval_inode``, ``notify_inval_entry``; lifecycle: ``serve`` until the filesystem
    is unmounted or ``terminate`` is called."""

    def __init__(self, options: SessionOptions | None = None, fd: int = -1, cloned: Port | None = None) -> None:
        self.fd = fd                  # set by ``mount`` (or given: a descriptor mounted elsewhere)
        self.options = options or SessionOptions()
        self.negotiated = Negotiated()
        self.ops = None
        self.requests = 0
        self.poll: Poll | None = None             # --fuse-poll-us (poll.py)
        self.opcodes: dict[int, int] = {}       # requests read, by opcode
        self._running: dict[int, trio.CancelScope] = {}     # unique -> scope of an interruptible task
        self._nursery: trio.Nursery | None = None
        self._stop = False
        self._initialized = trio.Event()
        self._passthrough_refused = 0
        self._clones: list[int] = []
        self._inbox: list[tuple[bytes, int]] = []
        self._inbox_lock = threading.Lock()
        self._token = None
        self._table = self._build_table()
        self._adopted = False
        self._given_clones: list[int] = []
        self._reading: trio.CancelScope | None = None
        self._waiting: trio.CancelScope | None = None       # the request loop's reading (``_loop``)
        self._in_hand = 0             # requests being answered by tasks
        self.inflight: InflightLog | None = None     # kept while the kernel cannot resend
        self.cloned = cloned if cloned is not None else Port("cloned")   # each new clone (the keeper holds it too)
        self.procs: LoopProcesses | None = None      # request loops as processes (loop_procs.py)
        self._quick: Callable[[memoryview, int], int] | None = None     # answers from the loops' table (row 0)
        self._opened_here: list[int] = []           # inodes it opened, not yet told to the operations

    def adopt(self, fds: list[int], negotiated: dict, mountpoint: str) -> None:
        """Serve the connection of ``fds`` (the session's descriptor, then clones for the request
        loops), mounted and initialized by a previous daemon: no INIT comes again."""
        self.fd, self._given_clones = fds[0], list(fds[1:])
        self.mountpoint = mountpoint
        self.negotiated = Negotiated.adopt(negotiated)
        self._adopted = True

    def descriptors(self) -> list[int]:
        """The session's descriptor and the clones of its request loops."""
        return [self.fd, *self._clones]

    def stop_reading(self) -> None:
        """Read no more requests; ``serve`` returns once those in hand are answered (at most 5 s:
        the kernel sends the rest again to the next daemon)."""
        self._stop = True
        if self.procs is not None:
            self.procs.stop()
        if self._reading is not None:
            self._reading.cancel()

    def mount(self, mountpoint: str, options: MountOptions) -> None:
        self.fd = mount.mount(mountpoint, options)
        self.mountpoint = mountpoint

    def close(self, unmount: bool) -> None:
        """Detach the filesystem (when ``unmount``) and close the session's descriptor; with no
        other holder of it, the kernel ends the connection and no reader waits on it."""
        if unmount and getattr(self, "mountpoint", None):
            try:
                mount.unmount(self.mountpoint, lazy=True)
            except CachefsError as exc:
                log.warning("%s", exc)
        if self.procs is not None:
            self.procs.close()
        for fd in self._clones:
            os.close(fd)
        self._clones.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ---- the loop ------------------------------------------------------------------------------
    async def serve(self, ops, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Answer requests until the filesystem is unmounted (the kernel ends the session) or
        ``terminate`` is called."""
        self.ops = ops
        os.set_blocking(self.fd, False)
        if self.options.poll_s > 0:
            self.poll = Poll(self.fd, self.options.poll_s)
        buf = bytearray(abi.BUFFER_SIZE)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            if self._adopted:
                self._initialized.set()
                if self.negotiated.resend:
                    self._notify(abi.NOTIFY_RESEND, [])     # what the dead daemon read comes again
                log.info("took over the FUSE connection (7.%d, %s)%s", self.negotiated.minor,
                         abi.flag_names(self.negotiated.flags),
                         "; requests in flight sent again" if self.negotiated.resend else "")
                if not self.negotiated.resend and self.options.inflight:
                    self._open_inflight(fresh=False)
            task_status.started()
            try:
                self._replay()
                nursery.start_soon(self._start_loops)
                with trio.CancelScope() as self._reading:
                    await self._loop(buf)
                if self._reading.cancelled_caught:
                    with trio.move_on_after(5.0):
                        while self._in_hand:
                            await trio.sleep(0.005)
            finally:
                if self._opened_here:
                    self._tell_opened()
                nursery.cancel_scope.cancel()
                self._nursery = None

    # ---- the in-flight log (kernels without FUSE_NOTIFY_RESEND) -------------------------------------
    def initialized(self) -> None:
        """INIT is answered: keep requests in flight where the kernel cannot send them again."""
        if self.options.inflight and not self.negotiated.resend:
            self._open_inflight(fresh=True)
        self._initialized.set()

    def _open_inflight(self, *, fresh: bool) -> None:
        try:
            self.inflight = InflightLog(self.options.inflight, fresh=fresh)
        except (OSError, ValueError) as exc:
            log.error("cannot keep the in-flight log %s (%s): a daemon that dies leaves the requests it "
                      "had read unanswered", self.options.inflight, exc)

    def _replay(self) -> None:
        """Handle what the dead predecessor had read and not answered, before any new request."""
        if self.inflight is None:
            return
        fds = [self.fd, *self._given_clones]        # as the keeper passed them (the loops take them later)
        pending = self.inflight.pending()
        names = " ".join(abi.OPCODE_NAMES.get(abi.IN_HEADER.unpack_from(data)[1], "?") for _, _, data in pending)
        for slot, index, data in pending:
            if index >= len(fds):
                self.inflight.done(slot)
                continue
            self._dispatch(data, fds[index], slot, replayed=True)
        if pending:
            log.info("answering %d request(s) the previous daemon had read, from the in-flight log (%s)", len(pending),
                     names)

    def _slot(self, index: int, buf: bytearray) -> tuple[int, memoryview]:
        """Where to read the next request from descriptor ``index``: a slot of the in-flight log,
        or (slot -1) the loop's own buffer when there is no log or no free slot."""
        if self.inflight is not None:
            reserved = self.inflight.reserve(index)
            if reserved is not None:
                return reserved
        return -1, memoryview(buf)

    def idle_work(self) -> None:
        """The operations have work for a moment with no request (``ops.idle``): the request loop,
        if it waits, looks at it now."""
        self._stop_waiting()
        if self.procs is not None:
            self.procs.nudge()

    def _stop_waiting(self) -> None:
        if self._waiting is not None:
            self._waiting.cancel()

    def _forwarded(self, data: memoryview, fd: int) -> None:
        """A request a loop process read and left to us: answered on its descriptor."""
        self.requests += 1
        self._dispatch(data, fd)

    async def _loop(self, buf: bytearray) -> None:
        """Read and answer requests until unmounted or stopped. The wait for the descriptor has no
        cancel scope of its own (one per wait cost as much as an open's answer): the reading runs in
        one that ``_stop_waiting`` cancels (idle work, loops reading); it starts again, slot kept."""
        at = [self._slot(0, buf)]
        while not self._stop:
            with trio.CancelScope() as self._waiting:
                if await self._read_requests(buf, at):
                    return

    async def _read_requests(self, buf: bytearray, at: list) -> bool:
        """``_loop``'s reading, until cancelled (False) or the session is over (True). ``at[0]``:
        the slot and buffer the next request is read into."""
        burst, poll = 0, self.poll
        idle = getattr(self.ops, "idle", None)
        slot, into = at[0]
        while not self._stop:
            try:
                length = os.readv(self.fd, [into])
            except BlockingIOError:
                burst = 0
                if self._opened_here:
                    self._tell_opened()
                if idle is not None and idle():        # work for a quiet moment (Operations.idle)
                    await trio.lowlevel.checkpoint()
                    continue
                if self.procs is not None and self.procs.reading:
                    # the loop processes read every request (a reader here too would be woken for
                    # each one and mostly find it taken); read again only once none is left
                    await self.procs.changed()
                    if self.procs.unmounted:
                        return True
                    continue
                if poll is None:
                    await trio.lowlevel.wait_readable(self.fd)
                    continue
                # --fuse-poll-us: read with no sleep, when no request is in a task (its thread's or
                # the store's answer would wait for the poll) and no task waits to run; the poll
                # ends at the loop's next timer or once a worker thread's result comes (poll.py)
                quiet = time.monotonic()
                if poll.window > 0 and not self._in_hand:      # (no statistics asked while it is off)
                    stats = trio.lowlevel.current_statistics()
                    if not stats.tasks_runnable and poll(stats.seconds_to_next_deadline, _results_waiting):
                        continue
                await trio.lowlevel.wait_readable(self.fd)
                poll.slept(time.monotonic() - quiet)
                continue
            except OSError as exc:
                if exc.errno == errno.ENODEV:         # unmounted: the session is over
                    return True
                if exc.errno in (errno.ENOENT, errno.EINTR):   # a request interrupted before we read it
                    continue
                raise
            self.requests += 1
            self._dispatch(into[:length], self.fd, slot)
            if self.inflight is not None:      # the next slot (or the buffer when none is free)
                slot, into = at[0] = self._slot(0, buf)
            burst += 1
            if burst >= _BURST:
                burst = 0
                if self._opened_here:
                    self._tell_opened()
                await trio.lowlevel.checkpoint()
        return True

    def _answered(self, quick: Callable[[memoryview, int], int], request: memoryview, fd: int) -> bool:
        """Whether the loops' table answered ``request`` on ``fd`` (``LoopTable.answerer``: an open
        of a published backing, a release or an ioctl of a handle from the table), as a loop process
        would: no request object, no operation."""
        try:
            opcode = quick(request, fd)
        except OSError as exc:
            log.error("cannot answer a FUSE request: %s", exc)
            return True
        if opcode:
            self.opcodes[opcode] = self.opcodes.get(opcode, 0) + 1
        return bool(opcode)

    def settled(self, timeout: float = 1.0) -> None:
        """From another thread (a metrics scrape): return once the operations have been told
        every open the loops' table answered before this call (at most ``timeout`` s)."""
        token = self._token
        if token is None or self._quick is None:
            return
        done = threading.Event()

        def settle() -> None:          # in the trio thread: every answer written before this is in the list
            if self._opened_here:
                self._tell_opened()
            done.set()
        try:
            token.run_sync_soon(settle)
        except trio.RunFinishedError:
            return
        done.wait(timeout)

    def _tell_opened(self) -> None:
        """The operations count the opens answered from the table (passthrough opens, bytes served)."""
        inodes = self._opened_here.copy()
        self._opened_here.clear()               # (the answerer holds this list's append)
        self.ops.table_opened(inodes)

    def terminate(self) -> None:
        """End ``serve`` (the filesystem stays mounted until unmounted)."""
        self._stop = True
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def wait_initialized(self) -> None:
        await self._initialized.wait()

    # ---- dispatch ------------------------------------------------------------------------------
    def _dispatch(self, data: memoryview, fd: int, slot: int = -1, replayed: bool = False) -> None:
        quick = self._quick            # what the loops' table answers, from any loop or the log: no request object
        if quick is not None and self._answered(quick, data, fd):
            if slot >= 0:
                self.inflight.done(slot)
            return
        if self._opened_here:                   # counted before anything that could report them
            self._tell_opened()
        try:
            req = Request(data, fd, slot, replayed)
        except struct.error:
            log.error("a malformed FUSE request (%d bytes) was dropped", len(data))
            if slot >= 0:
                self.inflight.done(slot)
            return
        self.opcodes[req.opcode] = self.opcodes.get(req.opcode, 0) + 1
        entry = self._table.get(req.opcode)
        if entry is None:
            if req.opcode not in _NO_REPLY:
                self.reply_error(req, errno.ENOSYS)
            self._finish(req)
            return
        try:
            entry(req)
            if req.opcode in _NO_REPLY:
                self._finish(req)               # nothing to answer; never run again
        except FuseError as exc:
            self.reply_error(req, exc.errno)
        except (struct.error, ValueError, IndexError):
            log.error("malformed %s request: answered EINVAL", abi.OPCODE_NAMES.get(req.opcode), exc_info=True)
            self.reply_error(req, errno.EINVAL)
        except Exception:
            log.exception("FUSE %s failed: answered EIO", abi.OPCODE_NAMES.get(req.opcode))
            self.reply_error(req, errno.EIO)

    def _later(self, req: Request, work: Callable, encode: Callable) -> None:
        """Run ``await work()`` in a task and answer with ``encode(result)`` (bytes or None)."""
        self._nursery.start_soon(self._run, req, req.opcode in _INTERRUPTIBLE, work, encode,
                                 name=abi.OPCODE_NAMES.get(req.opcode, "fuse"))

    async def _run(self, req: Request, interruptible: bool, work: Callable, encode: Callable) -> None:
        scope = trio.CancelScope()
        if interruptible:
            self._running[req.unique] = scope
        self._in_hand += 1
        try:
            with scope:
                result = await work()
            if scope.cancelled_caught:
                self.reply_error(req, errno.EINTR)
                return
            self.reply(req, encode(result))
        except FuseError as exc:
            self.reply_error(req, exc.errno)
        except Exception:
            log.exception("a FUSE request failed: answered EIO")
            self.reply_error(req, errno.EIO)
        finally:
            self._in_hand -= 1
            self._running.pop(req.unique, None)

    def _answer(self, req: Request, now: Callable | None, later: Callable, encode: Callable) -> None:
        """The fast path ``now()`` if there is one and it needs no wait, else ``later()`` in a task."""
        if now is not None:
            try:
                result = now()
            except Later:
                pass
            else:
                self.reply(req, encode(result))
                return
        self._later(req, later, encode)

    # ---- replies -------------------------------------------------------------------------------
    def reply(self, req: "Request", payload=None) -> None:
        """Answer ``req`` on the descriptor it was read from (each has its own queue of requests
        in flight: an answer on another one finds no request)."""
        unique = req.unique
        if payload is None:
            self._send(req.fd, [abi.OUT_HEADER.pack(abi.OUT_HEADER.size, 0, unique)])
        elif isinstance(payload, list):
            size = abi.OUT_HEADER.size + sum(len(p) for p in payload)
            self._send(req.fd, [abi.OUT_HEADER.pack(size, 0, unique), *payload])
        else:
            self._send(req.fd, [abi.OUT_HEADER.pack(abi.OUT_HEADER.size + len(payload), 0, unique), payload])
        self._finish(req)

    def reply_error(self, req: "Request", code: int) -> None:
        self._send(req.fd, [abi.OUT_HEADER.pack(abi.OUT_HEADER.size, -code, req.unique)])
        self._finish(req)

    def _finish(self, req: "Request") -> None:
        """``req`` needs nothing more: free its slot of the in-flight log (once)."""
        if req.slot >= 0:
            self.inflight.done(req.slot)
            req.slot = -1

    def _send(self, fd: int, parts: list) -> None:
        try:
            os.writev(fd, parts)
        except OSError as exc:
            # ENOENT: the request was interrupted or the connection aborted meanwhile: nobody waits
            if exc.errno not in (errno.ENOENT, errno.ENODEV, errno.ECONNABORTED):
                log.error("cannot answer a FUSE request: %s", exc)

    # ---- passthrough (the kernel side API for handlers) ---------------------------------------------
    @property
    def passthrough(self) -> bool:
        """The kernel agreed to FUSE passthrough and no hand-over has been refused for good."""
        return self.negotiated.has(abi.PASSTHROUGH) and not self._passthrough_refused

    def backing_open(self, fd: int) -> int:
        """Register ``fd`` as a backing file; the id to answer an OPEN with. OSError when the
        kernel refuses; a refusal that every file would meet turns passthrough off for the
        session: EPERM (no CAP_SYS_ADMIN), ELOOP (the cache files are on a stacked filesystem,
        e.g. overlayfs: the kernel takes backing files one level deep only)."""
        arg = bytearray(abi.BACKING_MAP.pack(fd, 0, 0))
        try:
            return fcntl.ioctl(self.fd, abi.DEV_IOC_BACKING_OPEN, arg)
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL, errno.ELOOP):
                self._passthrough_refused = exc.errno
                why = ("the cache dir is on a stacked filesystem (overlayfs?)" if exc.errno == errno.ELOOP
                       else os.strerror(exc.errno))
                log.info("FUSE passthrough refused by the kernel (%s): every read goes through the daemon", why)
            raise

    def backing_close(self, backing_id: int) -> None:
        try:
            fcntl.ioctl(self.fd, abi.DEV_IOC_BACKING_CLOSE, bytearray(struct.pack("<I", backing_id)))
        except OSError as exc:
            if exc.errno not in (errno.ENODEV, errno.ENOENT, errno.ENOTCONN):
                log.warning("closing FUSE backing id %d: %s", backing_id, exc)

    # ---- notifications (the kernel side API for handlers) -----------------------------------------
    def notify_store(self, ino: int, offset: int, data: bytes) -> None:
        """Put ``data`` into the kernel page cache of ``ino`` at ``offset``."""
        body = abi.NOTIFY_STORE_OUT.pack(ino, offset, len(data), 0)
        self._notify(abi.NOTIFY_STORE, [body, data])

    def notify_inval_inode(self, ino: int, offset: int = 0, length: int = 0) -> None:
        """Drop ``ino``'s cached attributes and pages (``length`` 0: to the end)."""
        self._notify(abi.NOTIFY_INVAL_INODE, [abi.NOTIFY_INVAL_INODE_OUT.pack(ino, offset, length)])

    def notify_inval_entry(self, parent: int, name: bytes) -> None:
        """Drop the kernel's cached entry ``name`` in directory ``parent``."""
        self._notify(abi.NOTIFY_INVAL_ENTRY, [abi.NOTIFY_INVAL_ENTRY_OUT.pack(parent, len(name), 0), name + b"\0"])

    def _notify(self, code: int, parts: list) -> None:
        size = abi.OUT_HEADER.size + sum(len(p) for p in parts)
        try:
            os.writev(self.fd, [abi.OUT_HEADER.pack(size, code, 0), *parts])
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENODEV, errno.ENOTCONN):
                raise FuseError(exc.errno) from None
