"""The session's extra request loops: threads that read cloned descriptors, or loop processes.

``RequestLoops`` is a part of ``Session`` (a base class of it). After INIT it starts
``options.loops`` readers, each on a clone of the session's descriptor (``FUSE_DEV_IOC_CLONE``; a
clone a previous daemon made and the keeper kept is taken first): as threads, which read requests
and hand them to the trio thread in batches (the kernel's copy of each request leaves the trio
thread; one owner answers), or as processes (``loop_procs.py``), which answer what the loops'
table holds and forward the rest. Either way the daemon's own loop (``Session._loop``) keeps
reading the session's descriptor.
"""

import errno
import fcntl
import logging
import os
import struct
import threading

import trio

from cachefs.fuse import abi
from cachefs.fuse.loop_procs import LoopProcesses, new_nonce

log = logging.getLogger("cachefs.fuse.session")


class RequestLoops:
    """The request loops of a ``Session`` beside its own (the attributes are the session's)."""

    async def _start_loops(self) -> None:
        """After INIT, ``options.loops`` threads that each read requests from a clone of the
        session's descriptor (FUSE_DEV_IOC_CLONE) and hand them to the trio thread in batches:
        the reads (the kernel's copy of each request) leave the trio thread; one owner answers."""
        if self.options.loops <= 0 and not self.options.loop_processes:
            self._keep_given()                # kept open (the keeper holds them too), unread
            return
        await self._initialized.wait()
        if self.options.loop_processes and self._start_processes():
            return
        for i in range(self.options.loops):
            fd = self._clone()
            if fd is None:                    # (every given clone was taken first)
                log.info("%d request loop(s) only", i + 1)
                return
            threading.Thread(target=self._clone_loop, args=(fd, len(self._clones)), name=f"fuse-loop-{i + 1}",
                             daemon=True).start()
        if self.options.loops > 0:
            log.info("%d extra FUSE request loop(s) on cloned descriptors", self.options.loops)
        self._keep_given()

    def _clone(self) -> int | None:
        """A descriptor for one more request loop: a clone a previous daemon made (the keeper kept
        it), else a new clone of the session's (given to the keeper); None if the kernel refuses."""
        if self._given_clones:
            fd = self._given_clones.pop(0)
        else:
            try:
                fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
                fcntl.ioctl(fd, abi.DEV_IOC_CLONE, bytearray(struct.pack("<I", self.fd)))
            except OSError as exc:
                log.info("cannot clone the FUSE descriptor (%s)", exc)
                return None
            self.cloned(fd)
        self._clones.append(fd)
        return fd

    def _keep_given(self) -> None:
        for fd in self._given_clones:     # more clones than loops now: the kernel resent their requests
            self._clones.append(fd)
        self._given_clones = []

    def _start_processes(self) -> bool:
        """Request loops as processes (loop_procs.py) where what they answer cannot change under
        them: passthrough agreed and a kernel that sends requests again (a loop that dies loses none).
        With no extra loop asked for, their table alone, which the daemon's loop answers opens from."""
        if not (self.passthrough and (self.negotiated.resend or self.options.loops <= 0)):
            if self.options.loops > 0:
                log.log(logging.INFO if self.options.loop_processes == "process" else logging.DEBUG,
                        "request loop processes need FUSE passthrough and FUSE_NOTIFY_RESEND (Linux 6.9+): "
                        "thread loops instead")
            return False
        fds = [fd for fd in (self._clone() for _ in range(self.options.loops)) if fd is not None]
        if self.options.loops > 0 and not fds:
            return False
        # our loop stops reading once one of them reads (``_loop``, ``_stop_waiting``)
        procs = LoopProcesses(self._forwarded, lambda: self._notify(abi.NOTIFY_RESEND, []), count=len(fds),
                              nonce=new_nonce(), slots=self.options.table_slots, ready=self._stop_waiting)
        try:
            procs.start(fds)
        except OSError as exc:
            log.warning("cannot start the request loop processes (%s): thread loops instead", exc)
            procs.close()
            return False
        self.procs = procs
        self._quick = procs.table.answerer(0, self._opened_here.append)
        self._keep_given()
        started = getattr(self.ops, "loops_started", None)
        if started is not None:
            started(self.procs)
        self._nursery.start_soon(self.procs.run)
        return True

    def _clone_loop(self, fd: int, index: int) -> None:
        buf = bytearray(abi.BUFFER_SIZE)
        slot, into = self._slot(index, buf)
        while not self._stop:
            try:
                length = os.readv(fd, [into])
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.EINTR):
                    continue
                return                       # ENODEV: unmounted; EBADF: closed
            data = into[:length] if slot >= 0 else bytes(into[:length])     # a slot stays its request's
            with self._inbox_lock:
                self._inbox.append((data, fd, slot))
                wake = len(self._inbox) == 1
            if wake:
                try:
                    self._token.run_sync_soon(self._drain_inbox)
                except trio.RunFinishedError:
                    return
            if self.inflight is not None:      # the next slot (or the buffer when none is free)
                slot, into = self._slot(index, buf)

    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            batch, self._inbox = self._inbox, []
        for data, fd, slot in batch:
            self.requests += 1
            self._dispatch(data if slot >= 0 else memoryview(data), fd, slot)
