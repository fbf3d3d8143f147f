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
waiting and, when a request is queued, reads it at once. Otherwise it waits in pyfuse3's own
function, which keeps pyfuse3's count of idle workers (it adds a worker only when none is idle,
and retires the surplus) and its handling of the session's end. The device is blocking: a read
with nothing queued would stop the thread. So:

- a request is read only right after a poll or a wake-up said the device is readable, with no
  await in between (one thread: nothing else can take the request meanwhile);
- while a worker is parked on the device, nobody polls it: the wake-up, and the request it was
  for, are that worker's. To see that, pyfuse3's ``trio`` global is a view of trio whose
  ``lowlevel.wait_readable`` marks the device's waiter (pyfuse3 swaps that global the same way
  for asyncio);
- after ``STREAK`` requests taken at once in a row, the next one waits in pyfuse3's function
  (a scheduler pass at least), so a flood of cheap requests cannot keep GETs, timers and fills
  from running.

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
    def __init__(self, fd: int, pyfuse3_wait: Callable[[], Awaitable[bool]],
                 on_at_once: Callable[[], object] = lambda: None) -> None:
        self.fd = fd
        self.parked = False                   # a worker waits for the device to become readable
        self._pyfuse3_wait = pyfuse3_wait
        self._on_at_once = on_at_once         # counts the requests read with no scheduler pass first
        self._streak = 0
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    async def wait(self) -> bool:
        """True when a request can be read now without blocking; False when the loop should end."""
        if self._streak < STREAK and not self.parked and self._poll.poll(0):
            self._streak += 1
            self._on_at_once()
            return True
        self._streak = 0
        return await self._pyfuse3_wait()

    async def wait_readable(self, fd: int) -> None:
        """``trio.lowlevel.wait_readable`` as pyfuse3 sees it: the device's waiter is marked."""
        if fd != self.fd:
            await trio.lowlevel.wait_readable(fd)
            return
        self.parked = True
        try:
            await trio.lowlevel.wait_readable(fd)
        finally:
            self.parked = False


class _Lowlevel:
    def __init__(self, intake: Intake) -> None:
        self.wait_readable = intake.wait_readable

    def __getattr__(self, name: str):
        return getattr(trio.lowlevel, name)


class _Trio:
    """trio, but for ``lowlevel.wait_readable``."""

    def __init__(self, intake: Intake) -> None:
        self.lowlevel = _Lowlevel(intake)

    def __getattr__(self, name: str):
        return getattr(trio, name)


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


def install(pyfuse3, on_at_once: Callable[[], object] = lambda: None, fd: int | None = None) -> Intake | None:
    """Put ``Intake.wait`` into pyfuse3's session loop (after ``pyfuse3.init``); None, and
    pyfuse3's own wait, when that cannot be done safely. ``uninstall`` puts pyfuse3's back.
    ``fd``: the session's device (default: the one ``/dev/fuse`` descriptor open)."""
    original = getattr(pyfuse3, "_wait_fuse_readable", None)
    if not callable(original) or getattr(pyfuse3, "trio", None) is not trio:
        log.info("pyfuse3 %s: no _wait_fuse_readable on trio; its own request loop runs",
                 getattr(pyfuse3, "__version__", "?"))
        return None
    fds = fuse_fds() if fd is None else [fd]
    if len(fds) != 1:
        log.info("%d /dev/fuse descriptors open, not 1: pyfuse3's own request loop runs", len(fds))
        return None
    intake = Intake(fds[0], original, on_at_once)
    pyfuse3.trio = _Trio(intake)
    pyfuse3._wait_fuse_readable = intake.wait
    return intake


def uninstall(pyfuse3, intake: Intake | None) -> None:
    if intake is not None:
        pyfuse3._wait_fuse_readable = intake._pyfuse3_wait
        pyfuse3.trio = trio
