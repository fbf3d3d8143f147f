"""How pyfuse3's workers wait for the next FUSE request: at once when one is queued.

pyfuse3 3.x runs its workers as trio tasks. Before each request a worker takes a lock, then parks
in ``trio.lowlevel.wait_readable`` on ``/dev/fuse``. Trio parks the task until the scheduler's
next pass even when the device is readable already, and the lock passes to the next worker only
on a later pass. So every request waits at least two passes, and a pass lasts as long as all the
other runnable work (GETs being received, fills finishing): 0.2-1 ms on a busy daemon. With 8
readers on a cold mount, the wait from a reader's ``open`` to the daemon's lookup handler came to
1.9 ms (mean) of the file's 16-18 ms.

``Intake.wait`` takes the place of ``pyfuse3._wait_fuse_readable`` (a module global that
``_session_loop`` looks up at each call). A worker back from a request polls the device without
waiting and, when a request is queued, reads it at once. Otherwise it parks as before, one
worker at a time. The device is blocking: a read with nothing queued would stop the thread. So:

- a request is read only right after a poll or a wake-up said the device is readable, with no
  await in between (one thread: nothing else can take the request meanwhile);
- while a worker is parked on the device (``_parked``), nobody else polls it: the wake-up, and
  the request it was for, are that worker's;
- after ``STREAK`` requests taken at once in a row, the next one waits for one scheduler pass
  first, so a flood of cheap requests cannot keep GETs, timers and fills from running.

pyfuse3 counts its parked workers in a field Python cannot reach. It sees none, so it keeps
adding workers up to ``max_tasks``; the extra ones wait on ``_lock`` and cost nothing.

``install`` uses this only when pyfuse3 still has the global it replaces and exactly one
``/dev/fuse`` descriptor is open (the session's); otherwise pyfuse3's own wait runs.
"""

import logging
import os
import select
from collections.abc import Awaitable, Callable

import trio

log = logging.getLogger(__name__)

STREAK = 16


class Intake:
    def __init__(self, fd: int, on_at_once: Callable[[], object] = lambda: None) -> None:
        self.fd = fd
        self.stopping = False
        self.original: Callable[[], Awaitable[bool]] | None = None     # pyfuse3's own wait
        self._on_at_once = on_at_once     # counts the requests read with no scheduler pass first
        self._streak = 0
        self._lock = trio.Lock()
        self._parked = False
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def _queued(self) -> bool:
        return bool(self._poll.poll(0))

    async def wait(self) -> bool:
        """True when a request can be read now without blocking; False when the loop should end."""
        if self.stopping:
            return False
        if self._streak >= STREAK:
            self._streak = 0
            await trio.lowlevel.cancel_shielded_checkpoint()
            if self.stopping:
                return False
        if not self._parked and self._queued():
            self._streak += 1
            self._on_at_once()
            return True
        self._streak = 0
        async with self._lock:
            if self.stopping:
                return False
            if not self._parked and self._queued():
                return True
            self._parked = True
            try:
                await trio.lowlevel.wait_readable(self.fd)
            except trio.ClosedResourceError:       # pyfuse3.terminate()
                return False
            finally:
                self._parked = False
        return True


def fuse_fds() -> list[int]:
    """The descriptors of this process open on ``/dev/fuse``."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                found.append(int(name))
        except OSError:
            continue
    return found


def install(pyfuse3, on_at_once: Callable[[], object] = lambda: None) -> Intake | None:
    """Put ``Intake.wait`` into pyfuse3's session loop (after ``pyfuse3.init``); None, and
    pyfuse3's own wait, when that cannot be done safely. ``uninstall`` puts pyfuse3's back."""
    original = getattr(pyfuse3, "_wait_fuse_readable", None)
    if not callable(original):
        log.info("pyfuse3 %s has no _wait_fuse_readable: its own request loop runs", pyfuse3.__version__)
        return None
    fds = fuse_fds()
    if len(fds) != 1:
        log.info("%d /dev/fuse descriptors open, not 1: pyfuse3's own request loop runs", len(fds))
        return None
    intake = Intake(fds[0], on_at_once)
    intake.original = original
    pyfuse3._wait_fuse_readable = intake.wait
    return intake


def uninstall(pyfuse3, intake: Intake | None) -> None:
    if intake is not None:
        pyfuse3._wait_fuse_readable = intake.original
