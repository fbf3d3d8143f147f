"""A throw-away single-node Ceph cluster with a RADOS Gateway (S3) on loopback, for tests.

``CephRGW`` starts one mon, one mgr, one bluestore OSD (on a sparse file) and one radosgw,
all as child processes of the test run (no systemd), with every file under one temp dir.
cephx is off; the facts that make that work are in docs/design.md, measured facts and in the comments of
``_CONF`` below. It creates one S3 user and exposes ``endpoint_url``, ``access_key`` and
``secret_key``. Every wait is bounded; a failure names the step and shows the tail of the
log of the daemon that did not come up. Teardown stops the daemons by PID in the order
RGW, OSD, mgr, mon (a daemon whose OSD or mon is gone first hangs in its shutdown) and
removes the temp dir.

Needs Debian's ceph-mon, ceph-osd, ceph-mgr and radosgw (see the Makefile's ``deps``).
Measured here (2 cores): ready in 5-7 s; the four daemons hold ~175 MB RSS at start and ~290 MB
after tests/store/test_rgw.py (the OSD and RGW caches grow; osd_memory_target caps the OSD at 1 GiB).
docs/ceph-rgw.md explains the configuration.
"""

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from testing.s3 import free_port

# util-linux's setpriv sets PR_SET_PDEATHSIG and execs the daemon (same PID): the kernel
# SIGKILLs it when the test process dies. KILL, not TERM: an OSD whose mon is already gone
# spends 5 s trying to report its shutdown.
_DIE_WITH_PARENT = ("setpriv", "--pdeathsig", "KILL", "--")
BINARIES = ("ceph-mon", "ceph-osd", "ceph-mgr", "radosgw", "radosgw-admin", "ceph", "monmaptool", "setpriv")

# cephx off everywhere. Without `ms mon client mode = crc` RGW loops on
# "get_initial_auth_request returned -13". One OSD: pools of size 1 with 8 PGs (RGW creates
# ~7 pools itself; the default 32 PGs each exceed mon_max_pg_per_osd and pool creation fails).
# The beast frontend needs tcp_nodelay=1, or small GETs stall ~45 ms (Nagle + delayed ACK).
# Paxos proposes every 50 ms instead of every 1 s: RGW's start creates 4 pools (and the first
# bucket 3 more), each a few osdmap commits; that alone cut the start from ~18 s to ~8 s.
# The mgr loads no Python modules (an empty module path): they cost ~280 MB RSS and ~3 s of
# start and nothing here needs them; the C++ part still aggregates PG stats for `ceph -s`.
# The always-on modules then report MGR_MODULE_ERROR, muted at start (``_start_mgr``).
_CONF = """\
[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
public addr = 127.0.0.1
cluster addr = 127.0.0.1
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc
keyring = {dir}/keyring
run dir = {dir}/run
admin socket = {dir}/run/$name.asok
pid file = {dir}/run/$name.pid
log file = {dir}/log/$name.log
mon cluster log file = {dir}/log/cluster.log
crash dir = {dir}/crash
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
osd memory target = 1073741824
mgr initial modules =

[mon]
mon data = {dir}/mon/$id
mon data avail warn = 1
mon data avail crit = 1
paxos propose interval = 0.05
paxos min wait = 0.01

[mgr]
mgr data = {dir}/mgr/$id
mgr module path = {dir}/mgr-modules

[osd]
osd data = {dir}/osd/$id
osd objectstore = bluestore
bluestore block path = {dir}/osd/$id.block
bluestore block create = true
bluestore block size = {osd_bytes}
bluestore fsck on mkfs = false

[client.rgw]
rgw data = {dir}/rgw
rgw frontends = beast endpoint=127.0.0.1:{rgw_port} tcp_nodelay=1
rgw thread pool size = 64
rgw init timeout = 60
rgw enable usage log = false
"""


_DIR_PREFIX = "cachefs-ceph-"


def remove_stale_dirs() -> None:
    """Remove the temp dirs of clusters whose test process died without a teardown (its
    daemons died with it: PDEATHSIG). Each dir names its owner in owner.pid."""
    for path in Path(tempfile.gettempdir()).glob(f"{_DIR_PREFIX}*"):
        try:
            owner = int((path / "owner.pid").read_text())
        except (OSError, ValueError):
            continue                    # being created right now, or not ours
        if not _alive(owner):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CephError(RuntimeError):
    """The cluster did not come up (or a ceph command failed); the message carries a log tail."""


@dataclass(frozen=True)
class _Daemon:
    name: str                      # ceph entity name: mon.a, mgr.x, osd.0, client.rgw
    proc: subprocess.Popen


class CephRGW:
    """``with CephRGW() as rgw: boto3.client("s3", endpoint_url=rgw.endpoint_url, ...)``."""

    def __init__(self, ready_timeout: float = 90.0, osd_size: int = 10 << 30) -> None:
        self.ready_timeout = ready_timeout
        self.osd_size = osd_size
        remove_stale_dirs()
        self.dir = Path(tempfile.mkdtemp(prefix=_DIR_PREFIX))
        (self.dir / "owner.pid").write_text(str(os.getpid()))
        self.conf = self.dir / "ceph.conf"
        self.fsid = str(uuid.uuid4())
        self.mon_port = free_port()
        self.rgw_port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.rgw_port}"
        self.access_key = secrets.token_hex(10).upper()
        self.secret_key = secrets.token_urlsafe(30)
        self._daemons: list[_Daemon] = []
        self._deadline = 0.0
        self.start_seconds = 0.0

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @staticmethod
    def missing_binaries() -> list[str]:
        return [name for name in BINARIES if shutil.which(name) is None]

    # --- start-up ---

    def start(self) -> None:
        started = time.monotonic()
        self._deadline = started + self.ready_timeout
        self._write_conf()
        self._start_mon()
        self._start_mgr()
        self._start_osd()
        self._spawn("client.rgw", "radosgw", "-n", "client.rgw")
        self._wait("RGW to answer HTTP", "client.rgw", self._rgw_answers)
        self._create_user()
        self.start_seconds = time.monotonic() - started

    def _write_conf(self) -> None:
        for sub in ("run", "log", "crash", "mon/a", "mgr/x", "osd/0", "rgw", "mgr-modules"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(_CONF.format(fsid=self.fsid, dir=self.dir, mon_port=self.mon_port,
                                          rgw_port=self.rgw_port, osd_bytes=self.osd_size))

    def _start_mon(self) -> None:
        monmap = self.dir / "monmap"
        self._run("monmaptool", "--create", "--fsid", self.fsid, "--addv", "a",
                  f"[v2:127.0.0.1:{self.mon_port}]", str(monmap), name="mon.a")
        self._run("ceph-mon", "--mkfs", "-i", "a", "--monmap", str(monmap), name="mon.a")
        self._spawn("mon.a", "ceph-mon", "-i", "a")
        self._wait("the mon to form a quorum", "mon.a", lambda: self._ceph_ok("mon", "stat"))

    def _start_mgr(self) -> None:
        self._spawn("mgr.x", "ceph-mgr", "-i", "x")
        self._ceph("health", "mute", "MGR_MODULE_ERROR", "--sticky")   # sticky: it is not raised yet

    def _start_osd(self) -> None:
        osd_uuid = str(uuid.uuid4())
        osd_id = self._ceph("osd", "new", osd_uuid).strip()
        if osd_id != "0":
            raise CephError(f"`ceph osd new` gave id {osd_id!r}, expected 0")
        self._run("ceph-osd", "-i", "0", "--mkfs", "--osd-uuid", osd_uuid, name="osd.0")
        self._spawn("osd.0", "ceph-osd", "-i", "0")
        self._wait("the OSD to be up and in", "osd.0", self._osd_up)

    def _osd_up(self) -> bool:
        try:
            dump = json.loads(self._ceph("osd", "dump", "-f", "json"))
        except CephError:
            return False
        return any(osd["up"] and osd["in"] for osd in dump["osds"])

    def _rgw_answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint_url, timeout=2.0):
                return True
        except urllib.error.HTTPError:
            return True        # any S3 answer (403 for an anonymous caller) means it serves
        except OSError:
            return False

    def _create_user(self) -> None:
        self._run("radosgw-admin", "user", "create", "--uid", "cachefs-test", "--display-name", "cachefs tests",
                  "--access-key", self.access_key, "--secret-key", self.secret_key, name="client.rgw")

    # --- processes ---

    def _spawn(self, name: str, binary: str, *args: str) -> None:
        """Start a daemon in the foreground (-f: no fork, so its PID is ours); it logs to its file.
        Its own session keeps a Ctrl-C from stopping the daemons out of order (teardown stops
        them in order); ``_DIE_WITH_PARENT`` ends them if the test process dies without a teardown."""
        out = open(self.dir / "log" / f"{name}.stdout", "wb")     # noqa: SIM115 (the child owns it)
        with out:
            proc = subprocess.Popen([*_DIE_WITH_PARENT, binary, "-f", "-c", str(self.conf), *args],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self._daemons.append(_Daemon(name, proc))

    def _run(self, *cmd: str, name: str, timeout: float = 30.0) -> str:
        """A one-shot ceph tool; its failure raises CephError with its output and the daemon log tail."""
        argv = [cmd[0], "-c", str(self.conf), *cmd[1:]]
        try:
            result = subprocess.run(argv, capture_output=True, text=True, check=False,
                                    timeout=self._bounded(timeout))
        except subprocess.TimeoutExpired as exc:
            raise CephError(f"{' '.join(cmd[:3])} timed out\n{self.log_tail(name)}") from exc
        if result.returncode != 0:
            raise CephError(f"{' '.join(cmd[:3])} failed ({result.returncode}): "
                            f"{(result.stderr or result.stdout)[-1500:]}\n{self.log_tail(name)}")
        return result.stdout

    def _ceph(self, *args: str) -> str:
        return self._run("ceph", "--connect-timeout", "5", *args, name="mon.a", timeout=15.0)

    def _ceph_ok(self, *args: str) -> bool:
        try:
            self._ceph(*args)
            return True
        except CephError:
            return False

    def _bounded(self, timeout: float) -> float:
        return max(1.0, min(timeout, self._deadline - time.monotonic())) if self._deadline else timeout

    def _wait(self, what: str, name: str, ready: Callable[[], bool]) -> None:
        while not ready():
            self._check_alive()
            if time.monotonic() > self._deadline:
                raise CephError(f"timed out after {self.ready_timeout:.0f} s waiting for {what}\n"
                                f"{self.log_tail(name)}")
            time.sleep(0.25)

    def _check_alive(self) -> None:
        for daemon in self._daemons:
            if daemon.proc.poll() is not None:
                raise CephError(f"{daemon.name} exited with {daemon.proc.returncode}\n{self.log_tail(daemon.name)}")

    def log_tail(self, name: str, chars: int = 3000) -> str:
        """The end of a daemon's log file and of its stdout/stderr, for error messages."""
        parts = []
        for path in (self.dir / "log" / f"{name}.log", self.dir / "log" / f"{name}.stdout"):
            if path.exists() and path.stat().st_size:
                parts.append(f"--- {path.name} (tail) ---\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts) or f"(no log for {name})"

    def pids(self) -> dict[str, int]:
        return {d.name: d.proc.pid for d in self._daemons if d.proc.poll() is None}

    def rss_bytes(self) -> dict[str, int]:
        """Resident memory of each running daemon (from /proc)."""
        out = {}
        for name, pid in self.pids().items():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
            out[name] = kb * 1024
        return out

    # --- teardown ---

    def stop(self) -> None:
        """SIGTERM each daemon by PID, RGW first and the mon last; SIGKILL what lingers."""
        for daemon in sorted(self._daemons, key=_stop_rank):
            _terminate(daemon.proc, grace=10.0)
        self._daemons.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


_STOP_ORDER = ("client.rgw", "osd.", "mgr.", "mon.")


def _stop_rank(daemon: _Daemon) -> int:
    return next(i for i, prefix in enumerate(_STOP_ORDER) if daemon.name.startswith(prefix))


def _terminate(proc: subprocess.Popen, grace: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


if __name__ == "__main__":     # a manual check: bring it up, print the endpoint and memory, stop
    with CephRGW() as rgw:
        print(f"{rgw.endpoint_url} ready in {rgw.start_seconds:.1f} s; RSS "
              f"{sum(rgw.rss_bytes().values()) / 1e6:.0f} MB {rgw.rss_bytes()}")
