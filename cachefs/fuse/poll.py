"""``--fuse-poll-us``: the request loop polls ``/dev/fuse`` a moment before it sleeps, and learns how long.

Waking a sleeping thread for a request costs tens of microseconds on a VM (an idle vCPU, the
scheduler, trio's epoll): more than answering an open. A loop that keeps polling after its last
request reads the next one with no wake-up when it comes soon, as a hot epoch's next open does;
when it does not come soon (a reader waiting on the disk between two files, or no reader), the
poll is CPU spent for nothing; and while readers want every core, it is CPU they lose.

So the poll's length adapts between 0 and the ceiling asked for, as the kernel's haltpoll
governor does for an idle vCPU: after each sleep, the loop looks at how long it was idle in all
(poll and sleep). Idle no longer than the ceiling: a longer poll would have caught the request,
so the window doubles (from a sixteenth of the ceiling when it was off). Idle longer: the poll was
wasted, so the window halves, and below a sixteenth of the ceiling it stops. A request the poll
finds changes nothing.

A poll must not take a core from the readers. It does not start while every CPU the daemon may
run on has a thread to run besides it (``/proc/loadavg``'s running count: 8 readers on 2 CPUs);
while it polls it yields its CPU to any thread that waits for one, and a poll that lost its CPU
that way (an iteration longer than ``_GAP`` while the thread was switched out: a gap alone may be
the VM's) ends at once and halves the window. Nor may it hold up the loop's thread's other work
(``Session._read_requests``): no poll while a request is answered by a task or a task waits to
run, and a poll ends at the next trio timer or once a worker thread's result waits.
"""

import os
import resource
import select
import time
from collections.abc import Callable

_GAP = 20e-6       # a poll iteration this long: did another thread run on our CPU meanwhile?


def _loadavg() -> int:
    try:
        return os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


_LOADAVG = _loadavg()


def _busy(cpus: int) -> bool:
    """Whether every CPU has a thread to run besides ours (``/proc/loadavg``'s count of running
    threads, ours included): then a poll would take a CPU from someone (~2 us to ask)."""
    if _LOADAVG < 0:
        return False
    try:
        return int(os.pread(_LOADAVG, 64, 0).split()[3].split(b"/")[0]) > cpus
    except (OSError, ValueError, IndexError):
        return False


def _switches() -> int:
    """The thread's involuntary context switches (a yield that let another thread run is one)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


class Poll:
    """The adaptive poll of one request loop on ``fd`` (``ceiling``: seconds; 0 never polls)."""

    __slots__ = ("ceiling", "window", "found", "grown", "shrunk", "yielded", "busy", "other", "_poller", "_cpus")

    def __init__(self, fd: int, ceiling: float) -> None:
        self.ceiling = ceiling
        self.window = ceiling / 4               # seconds the next poll may run
        self.found = self.grown = self.shrunk = self.yielded = self.busy = self.other = 0
        self._cpus = len(os.sched_getaffinity(0))
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)

    def __call__(self, limit: float = float("inf"), other: Callable[[], int] | None = None) -> bool:
        """Poll for up to the window (and ``limit`` s: the next timer of the loop's other work):
        whether a request came (or the connection ended). ``other()``, asked every few
        iterations, says whether other work came for the loop's thread meanwhile (a worker
        thread's result): the poll ends for it."""
        window = min(self.window, limit)
        if window <= 0:
            return False
        if _busy(self._cpus):
            self.busy += 1
            return False
        poller = self._poller
        switched = _switches()
        now = time.monotonic()
        end = now + window
        turn = 0
        while not poller.poll(0):
            os.sched_yield()                    # a thread that waits for a CPU gets ours
            before, now = now, time.monotonic()
            if now - before > _GAP and _switches() != switched:     # (a gap alone may be the VM's)
                if poller.poll(0):              # (the thread that ran may have sent it)
                    break
                self.yielded += 1
                self._shrink()
                return False
            if now >= end:
                return False
            turn += 1
            if other is not None and not turn & 3 and other():
                self.other += 1
                return False
        self.found += 1
        return True

    def slept(self, idle: float) -> None:
        """The loop slept and was woken: ``idle`` seconds since it found no request (its poll included)."""
        if idle <= self.ceiling:
            if self.window < self.ceiling:
                self.window = min(self.ceiling, max(2 * self.window, self.ceiling / 16))
                self.grown += 1
        elif self.window > 0:
            self._shrink()

    def _shrink(self) -> None:
        self.window /= 2
        if self.window < self.ceiling / 16:
            self.window = 0.0
        self.shrunk += 1

    def status(self) -> dict:
        return {"window_us": round(self.window * 1e6, 1), "ceiling_us": round(self.ceiling * 1e6, 1),
                "found": self.found, "grown": self.grown, "shrunk": self.shrunk, "yielded": self.yielded,
                "busy": self.busy, "other": self.other}
