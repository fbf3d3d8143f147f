"""``cachefs csi-agent --supervise``: the agent's container keeps its keepers when the agent dies.

A container ends when its main process does, and the runtime then kills every process left in it:
the volumes' keepers and daemons with it, so every mount on the node would go through a repair.
With ``--supervise`` the main process is this small loop instead. It runs the agent as a child and
starts it again when it dies of anything but a clean exit; the keepers (which the agent starts in
sessions of their own) go on serving meanwhile, and the new agent finds their mounts live in its
state and has nothing to repair. A clean exit (exit 0: SIGTERM, or a newer agent that took the
volumes over and told this one to go) or a usage error (exit 2) ends the supervisor with the same
status. SIGTERM and SIGINT are passed on to the agent.

The loop also reaps orphans: where the container has a PID namespace of its own, it is PID 1, and
keepers whose agent died become its children.
"""

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time

from cachefs.errors import ExitCode

log = logging.getLogger("cachefs.csi.supervise")

QUICK = 10.0            # an agent that dies sooner than this after its start is restarted more slowly
MAX_BACKOFF = 10.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the supervisor dies (else the agent would be orphaned)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def agent_argv(argv: list[str]) -> list[str]:
    """The agent's own command line: this one's, less ``--supervise``."""
    return [sys.executable, "-m", "cachefs", *(a for a in argv if a != "--supervise")]


def supervise(argv: list[str]) -> int:
    command = agent_argv(argv)
    stopping = False
    child: subprocess.Popen | None = None

    def forward(signum, _frame) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    backoff = 0.1
    starts = 0
    while True:
        started = time.monotonic()
        child = subprocess.Popen(command, preexec_fn=_die_with_parent)
        starts += 1
        if starts > 1:
            log.warning("csi-agent started again (pid %d, start %d)", child.pid, starts)
        code = _wait(child)
        if stopping:
            return max(code, 0)         # stopped by the signal it was passed
        if code in (0, ExitCode.USAGE):
            return code
        cause = f"signal {-code}" if code < 0 else f"exit {code}"
        backoff = min(backoff * 2, MAX_BACKOFF) if time.monotonic() - started < QUICK else 0.2
        log.error("csi-agent pid %d died (%s); its volumes' keepers serve on; starting it again in %.1f s",
                  child.pid, cause, backoff)
        deadline = time.monotonic() + backoff
        while not stopping and time.monotonic() < deadline:
            _reap_orphans()
            time.sleep(min(0.1, backoff))
        if stopping:
            return 0


def _wait(child: subprocess.Popen) -> int:
    """The child's exit status (negative: killed by that signal), reaping any orphan meanwhile."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:                # reaped already: nothing left to wait for
            code = child.poll()
            return 1 if code is None else code
        if pid == child.pid:
            child.returncode = os.waitstatus_to_exitcode(status)
            return child.returncode


def _reap_orphans() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
