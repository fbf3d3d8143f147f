"""The keeper: a small process that holds a mount's ``/dev/fuse`` descriptors so the mount
outlives its daemon, and starts the next daemon when one dies or hands over.

The kernel keeps a FUSE connection alive while any process holds its descriptor. The keeper is
that process: ``cachefs mount`` starts it (``launcher.start``) and it starts the daemon. Once the
daemon has mounted, it sends the keeper its descriptors (the session's and each request loop's
clone, SCM_RIGHTS) and what INIT settled. When the daemon dies (SIGKILL, OOM, a crash) while the
filesystem is still mounted, the keeper starts a new daemon and passes it all of that: the new
daemon adopts the connection without INIT, asks the kernel to send again every request that was
read but not answered (``FUSE_NOTIFY_RESEND``, Linux 6.9+; on older kernels it answers them from
the in-flight log its predecessor kept, ``fuse/inflight.py``), takes the node ids and backing ids of
its predecessor from the id log (``namespace/ids.py``) and serves on. Readers see a pause, never
an error. ``cachefs restart MOUNTPOINT`` does the same on purpose (a new cachefs version): the
keeper starts the new daemon first, lets it import everything, and then tells the old one to
stop reading, finish what it is serving and exit (``HANDOVER``).

When no new daemon can serve (five failures in a minute), or the kernel cannot resend and the
daemon kept no in-flight log, the keeper aborts the connection (readers get ENOTCONN at once, as
with no keeper) rather than leave callers hanging on requests nobody will answer. A daemon that exits 0 has unmounted: the keeper exits too.

A standby daemon (``keeper_standby``) waits beside the serving one, its modules imported, so a
crash costs the pause of building the daemon, not of starting Python. Five daemons in a row that
die within two seconds of serving (a request that kills every daemon it reaches) make the keeper
give up and abort the connection.

Messages on the keeper socket (SOCK_SEQPACKET) are one JSON object each, with descriptors
attached where noted: daemon -> keeper ``standing_by`` (imported), ``mounted`` (+fds: session,
clones; negotiated, devno), ``clone`` (+fd), ``restart`` (config); keeper -> daemon ``go`` (+fds
on a takeover; generation, negotiated), ``stop`` (hand over now), ``restart_failed``. The keeper
loads no trio and no store code (only when it gives up does it load the FUSE layer, to abort).
"""

import array
import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

log = logging.getLogger("cachefs.keeper")

HANDOVER = 75               # a daemon's exit status after handing the mount to its successor
_MAX_FDS = 64
QUICK = 2.0                 # a daemon that dies this soon after it began serving died "quickly"
MAX_QUICK_DEATHS = 5        # this many quick deaths in a row (a request that kills every daemon): give up
STANDBY_DELAY = 1.0         # seconds after a daemon begins serving before its standby is started
ADOPT_TIMEOUT = 60.0        # seconds a keeper taking a mount over waits for the other one's descriptors


# ---- messages ------------------------------------------------------------------------------------
def send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([data], ancillary)


def receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """One message and its descriptors; (None, []) when the other side is gone."""
    fds = array.array("i")
    try:
        data, ancillary, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(_MAX_FDS * fds.itemsize))
    except (ConnectionResetError, OSError):
        return None, []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    for fd in fds:
        os.set_inheritable(fd, False)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), list(fds)


# ---- the keeper ----------------------------------------------------------------------------------
@dataclass
class _Daemon:
    proc: subprocess.Popen
    sock: socket.socket
    pidfd: int
    ready_r: int = -1             # its ready pipe (successors only: the first one's goes to the launcher)
    imported: bool = False        # it stands by: imported everything, waits for "go"
    serving_since: float = 0.0


class Keeper:
    def __init__(self, config_line: str, secrets_line: str, mountpoint: str, standby: bool,
                 cache_dir: str | None = None) -> None:
        self.config_line, self.secrets_line = config_line, secrets_line
        self.mountpoint = mountpoint
        self.cache_dir = cache_dir
        self.listener: socket.socket | None = None     # another keeper asks for the mount here (keeper.sock)
        self.migrating: socket.socket | None = None     # ... and this one waits for the descriptors
        self.fds: list[int] = []           # the session's descriptor, then the request loops' clones
        self.negotiated: dict | None = None
        self.devno: str | None = None
        self.generation = 0
        self.quick_deaths = 0              # daemons in a row that died within QUICK seconds of serving
        self.daemon: _Daemon | None = None
        self.standby: _Daemon | None = None      # imported, waiting to take over after a crash
        self.successor: _Daemon | None = None    # started by a restart, takes over once imported
        self.want_standby = standby
        self.standby_due = 0.0
        self.stopping = False
        self.restarts = 0

    # ---- daemons ----------------------------------------------------------------------------
    def _spawn(self, ready_fd: int | None) -> _Daemon:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ready_r = -1
        if ready_fd is None:
            ready_r, ready_fd = os.pipe()
        proc = subprocess.Popen([sys.executable, "-m", "cachefs", "_daemon", str(ready_fd), "--keeper-fd",
                                 str(theirs.fileno())], stdin=subprocess.PIPE, pass_fds=(ready_fd, theirs.fileno()),
                                close_fds=True)
        theirs.close()
        if ready_r >= 0:
            os.close(ready_fd)
        proc.stdin.write(self.config_line.encode())
        if self.secrets_line:
            proc.stdin.write(b"\n" + self.secrets_line.encode())
        proc.stdin.close()
        return _Daemon(proc, ours, os.pidfd_open(proc.pid), ready_r=ready_r)

    def _go(self, daemon: _Daemon) -> None:
        """Let ``daemon`` serve: the first one mounts; a successor adopts the held descriptors."""
        message = {"kind": "go", "generation": self.generation, "keeper_pid": os.getpid(),
                   "restarts": self.restarts}
        if self.fds:
            message.update(negotiated=self.negotiated, devno=self.devno, loops=len(self.fds) - 1)
        try:
            send(daemon.sock, message, self.fds)
        except OSError as exc:
            log.warning("cannot reach the new daemon (pid %d): %s", daemon.proc.pid, exc)
        daemon.serving_since = time.monotonic()
        self.daemon = daemon
        self.standby_due = time.monotonic() + STANDBY_DELAY

    def run(self, ready_fd: int, adopt: bool = False) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._forward)
        first = self._spawn(ready_fd)
        os.close(ready_fd)
        if adopt:
            status = self._adopt(first)
            if status is not None:
                return status
        self._go(first)
        while True:
            outcome = self._wait()
            if outcome is not None:
                self._retire_standby()
                return outcome

    def _forward(self, signum, _frame) -> None:
        """SIGTERM/SIGINT/SIGHUP to the keeper: the daemon unmounts (as when signalled itself)."""
        self.stopping = True
        if self.daemon is not None and self.daemon.proc.poll() is None:
            self.daemon.proc.send_signal(signum)

    def _wait(self) -> int | None:
        daemon = self.daemon
        others = [d for d in (self.standby, self.successor) if d is not None]
        watch = [daemon.sock, daemon.pidfd] + [fd for d in others for fd in (d.sock, d.pidfd)]
        if self.listener is not None and self.migrating is None:
            watch.append(self.listener)
        timeout = 5.0
        if self._standby_missing():
            timeout = max(0.0, self.standby_due - time.monotonic())
        try:
            readable, _, _ = select.select(watch, [], [], timeout)
        except InterruptedError:
            return None
        if daemon.sock in readable:
            message, fds = receive(daemon.sock)
            if message is not None:
                self._on_message(message, fds)
        for other in others:
            if other.sock in readable:
                message, fds = receive(other.sock)
                for fd in fds:
                    os.close(fd)
                if message is not None and message.get("kind") == "standing_by":
                    other.imported = True
                    if other is self.successor:
                        self._tell(daemon, {"kind": "stop"})     # hand over now: the successor is ready
            if other.pidfd in readable and other.proc.poll() is not None:
                self._lost(other)
        if self.listener is not None and self.listener in readable:
            self._on_migrate()
        if daemon.pidfd in readable:
            return self._on_exit(daemon)
        if self._standby_missing() and time.monotonic() >= self.standby_due:
            self.standby = self._spawn(None)
        return None

    def _standby_missing(self) -> bool:
        """A standby is wanted and none waits (none while the mount is being handed to another keeper)."""
        return (self.want_standby and self.standby is None and bool(self.fds) and not self.stopping
                and self.migrating is None)

    def _lost(self, other: _Daemon) -> None:
        """A standby or a restart's successor exited before taking over."""
        self._close(other)
        if other is self.successor:
            log.warning("the new daemon (pid %d) exited (status %s) before taking over; pid %d keeps serving %s",
                        other.proc.pid, other.proc.returncode, self.daemon.proc.pid, self.mountpoint)
            self.successor = None
            self._tell(self.daemon, {"kind": "restart_failed"})
        else:
            log.warning("the standby daemon (pid %d) exited (status %s); another is started", other.proc.pid,
                        other.proc.returncode)
            self.standby = None
            self.standby_due = time.monotonic() + 10 * STANDBY_DELAY

    def _on_message(self, message: dict, fds: list[int]) -> None:
        kind = message.get("kind")
        if kind == "mounted":
            for fd in self.fds:
                os.close(fd)
            self.fds, self.negotiated, self.devno = fds, message["negotiated"], message["devno"]
            log.info("holding the FUSE connection %s of %s (%d descriptor(s))", self.devno, self.mountpoint,
                     len(fds))
            self._listen()
        elif kind == "clone":
            self.fds.extend(fds)
        elif kind == "restart":
            if message.get("config"):
                self.config_line = json.dumps(message["config"])     # the options of the new daemon on
            if self.successor is None:
                self._retire_standby()             # it runs the old code and options
                self.successor = self._spawn(None)
                log.info("restart asked: new daemon pid %d imports, then takes %s over", self.successor.proc.pid,
                         self.mountpoint)
        else:
            for fd in fds:
                os.close(fd)

    def _tell(self, daemon: _Daemon, message: dict) -> None:
        try:
            send(daemon.sock, message)
        except OSError:
            pass

    def _on_exit(self, daemon: _Daemon) -> int | None:
        status = daemon.proc.wait()
        self._close(daemon)
        live = self.fds and self.devno is not None and _mounted(self.devno)
        if not live or self.stopping and status == 0:
            self._release()
            if self.successor is not None:
                self.successor.proc.kill()
            log.info("the daemon (pid %d) of %s exited (status %s) and the mount is gone; the keeper exits",
                     daemon.proc.pid, self.mountpoint, status)
            return status if status >= 0 else 128 - status
        if self.migrating is not None:
            return self._hand_to_keeper(daemon, status)
        if status == HANDOVER and self.successor is not None:
            log.info("pid %d handed %s over to pid %d", daemon.proc.pid, self.mountpoint, self.successor.proc.pid)
            successor, self.successor = self.successor, None
            self.quick_deaths = 0
        else:
            why = f"killed by {signal.Signals(-status).name}" if status < 0 else f"exit status {status}"
            log.warning("the daemon of %s (pid %d) died (%s): a new one takes the live connection over",
                        self.mountpoint, daemon.proc.pid, why)
            if not self.negotiated or not (self.negotiated.get("resend") or self.negotiated.get("inflight")):
                return self._give_up("the kernel cannot send again the requests the dead daemon had read "
                                     "(FUSE_NOTIFY_RESEND needs Linux 6.9) and no in-flight log was kept")
            quick = time.monotonic() - daemon.serving_since < QUICK
            self.quick_deaths = self.quick_deaths + 1 if quick else 0
            if self.quick_deaths > MAX_QUICK_DEATHS:
                return self._give_up(f"{self.quick_deaths} daemons in a row died within {QUICK:.0f} s of serving")
            if self.quick_deaths > 2:
                time.sleep(min(2.0, 0.05 * 2 ** self.quick_deaths))
            if self.successor is not None:
                successor, self.successor = self.successor, None
            elif self.standby is not None:
                successor, self.standby = self.standby, None
            else:
                successor = self._spawn(None)
        self._take_over(successor)
        return None

    def _take_over(self, successor: _Daemon) -> None:
        """``successor`` serves the connection now: the next generation."""
        self.generation += 1
        self.restarts += 1
        self._go(successor)

    # ---- keeper to keeper (a new node agent's keeper takes the mount: cachefs.launcher.start(adopt)) ----
    def _listen(self) -> None:
        """Accept another keeper's request for this mount on ``CACHE_DIR/keeper.sock`` (root only)."""
        if self.listener is not None or self.cache_dir is None:
            return
        try:
            with _short_path(self.cache_dir, "keeper.sock") as path:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                old = os.umask(0o177)
                try:
                    listener.bind(path)
                finally:
                    os.umask(old)
            listener.listen(1)
            self.listener = listener
        except OSError as exc:
            log.warning("cannot listen for another keeper in %s: %s", self.cache_dir, exc)

    def _on_migrate(self) -> None:
        conn, _ = self.listener.accept()
        message, fds = receive(conn)
        for fd in fds:
            os.close(fd)
        if message is None or message.get("kind") != "migrate" or not self.fds:
            conn.close()
            return
        log.info("another keeper asks for %s: the daemon (pid %d) hands it over", self.mountpoint,
                 self.daemon.proc.pid)
        self.migrating = conn
        self._retire_standby()
        self._tell(self.daemon, {"kind": "stop"})

    def _hand_to_keeper(self, daemon: _Daemon, status: int) -> int | None:
        """The daemon stopped (handed over, or died): the waiting keeper gets the descriptors."""
        conn, self.migrating = self.migrating, None
        try:
            send(conn, {"kind": "adopt", "negotiated": self.negotiated, "devno": self.devno,
                        "generation": self.generation, "restarts": self.restarts}, self.fds)
        except OSError as exc:
            log.error("the keeper that asked for %s is gone (%s): a new daemon here takes the mount back",
                      self.mountpoint, exc)
            conn.close()
            self._take_over(self._spawn(None))
            return None
        conn.close()
        log.info("handed %s to another keeper (the daemon, pid %d, exited %s); this keeper exits",
                 self.mountpoint, daemon.proc.pid, status)
        self._release()
        if self.successor is not None:
            self.successor.proc.kill()
        return 0

    def _adopt(self, first: _Daemon) -> int | None:
        """Take the mount from the keeper that holds it now (on ``CACHE_DIR/keeper.sock``), once
        ``first`` stands by; None when done, else an exit status (that keeper cannot be reached)."""
        message, fds = receive(first.sock)          # "standing_by": imported, its store client built
        for fd in fds:
            os.close(fd)
        if message is None:
            return first.proc.wait() or 1
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with _short_path(self.cache_dir, "keeper.sock") as path:
                conn.connect(path)
            send(conn, {"kind": "migrate"})
            conn.settimeout(ADOPT_TIMEOUT)
            answer, fds = receive(conn)
        except OSError as exc:
            answer, fds = None, []
            log.error("cannot reach the keeper of %s (%s)", self.mountpoint, exc)
        finally:
            conn.close()
        if answer is None or answer.get("kind") != "adopt" or not fds:
            log.error("no keeper handed %s over: nothing to adopt", self.mountpoint)
            first.proc.kill()
            first.proc.wait()
            return 1
        self.fds, self.negotiated, self.devno = fds, answer["negotiated"], answer["devno"]
        self.generation, self.restarts = answer["generation"] + 1, answer["restarts"] + 1
        log.info("took %s from another keeper (connection %s)", self.mountpoint, self.devno)
        self._listen()
        return None

    def _give_up(self, reason: str) -> int:
        from cachefs.fuse.mount import abort
        log.error("%s: aborting the FUSE connection of %s (readers get ENOTCONN; mount it again)", reason,
                  self.mountpoint)
        abort(self.devno)
        self._release()
        return 1

    def _retire_standby(self) -> None:
        if self.standby is not None:
            self.standby.proc.kill()
            self.standby.proc.wait()
            self._close(self.standby)
            self.standby = None

    def _close(self, daemon: _Daemon) -> None:
        daemon.sock.close()
        os.close(daemon.pidfd)
        if daemon.ready_r >= 0:
            os.close(daemon.ready_r)

    def _release(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if self.listener is not None:
            self.listener.close()
            self.listener = None


@contextlib.contextmanager
def _short_path(directory: str, name: str):
    """``directory/name`` as a path short enough for a unix socket (108 bytes): through
    ``/proc/self/fd`` of the directory, however deep it is."""
    fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)


def _mounted(devno: str) -> bool:
    """Whether a mount with device ``devno`` (major:minor) still exists in this namespace."""
    from cachefs.host import mounts
    return any(entry.devno == devno for entry in mounts())


class Link:
    """The daemon's end of the keeper socket."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.go: dict = {}
        self.fds: list[int] = []

    def wait_go(self) -> None:
        """Say we stand by (imported), then block until the keeper says serve (with the
        descriptors of a live mount on a takeover)."""
        send(self.sock, {"kind": "standing_by"})
        message, self.fds = receive(self.sock)
        if message is None or message.get("kind") != "go":
            raise SystemExit("the keeper is gone")
        self.go = message

    @property
    def takeover(self) -> bool:
        return bool(self.fds)

    def mounted(self, fds: list[int], negotiated: dict, devno: str) -> None:
        send(self.sock, {"kind": "mounted", "negotiated": negotiated, "devno": devno}, fds)

    def clone(self, fd: int) -> None:
        send(self.sock, {"kind": "clone"}, [fd])

    def restart(self, config: dict | None = None) -> None:
        send(self.sock, {"kind": "restart", "config": config})

    def status(self) -> dict:
        return {"pid": self.go.get("keeper_pid"), "generation": self.go.get("generation", 0),
                "restarts": self.go.get("restarts", 0)}


def run_keeper(ready_fd: int, adopt: bool = False) -> int:
    """The keeper process (``python -m cachefs _keeper READY_FD [--adopt]``): config on stdin, as the
    daemon's; ``adopt``: take the live mount from the keeper holding it (a new node agent's)."""
    from cachefs.config import build_config

    config_line, _, secrets_line = sys.stdin.read().partition("\n")
    cfg = build_config(json.loads(config_line))
    os.dup2(os.open(os.devnull, os.O_RDWR), 0)
    handler = logging.FileHandler(cfg.log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
    logging.getLogger().handlers[:] = [handler]
    logging.getLogger().setLevel(logging.INFO)
    return Keeper(config_line, secrets_line.strip(), cfg.mountpoint, cfg.keeper_standby,
                  cfg.cache_dir).run(ready_fd, adopt)
