"""A throw-away single-node Ceph cluster with a RADOS Gateway (S3) on loopback, for tests.

``CephRGW`` starts one mon, one mgr, one bluestore OSD (on a sparse file) and one radosgw,
all as child processes of the test run (no systemd), with every file under one temp dir.
cephx is off; the facts that make that work are in DESIGN section 3 and in the comments of
``_CONF`` below. It creates one S3 user and exposes ``endpoint_url``, ``access_key`` and
``secret_key``. Every wait is bounded; a failure names the step and shows the tail of the
log of the daemon that did not come up. Teardown stops the daemons by PID in the order
RGW, OSD, mgr, mon (RGW blocks on an OSD that is gone) and removes the temp dir.

Needs Debian's ceph-mon, ceph-osd, ceph-mgr and radosgw (see the Makefile's ``deps``).
Measured here (2 cores): ready in ~15-20 s, ~0.8 GB RSS for the four daemons.
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
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from cachefs.local_s3 import free_port

BINARIES = ("ceph-mon", "ceph-osd", "ceph-mgr", "radosgw", "radosgw-admin", "ceph", "monmaptool")

# cephx off everywhere. Without `ms mon client mode = crc` RGW loops on
# "get_initial_auth_request returned -13". One OSD: pools of size 1 with 8 PGs (RGW creates
# ~7 pools itself; the default 32 PGs each exceed mon_max_pg_per_osd and pool creation fails).
# The beast frontend needs tcp_nodelay=1, or small GETs stall ~45 ms (Nagle + delayed ACK).
_CONF = """\
[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
public addr = 127.0.0.1
cluster addr = 127.0.0.1
auth cluster required = none
auth service required = none
auth client required = none
auth allow insecure global id reclaim = false
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
mon allow pool delete = true
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

[osd]
osd data = {dir}/osd/$id
osd objectstore = bluestore
bluestore block path = {dir}/osd/$id.block
bluestore block create = true
bluestore block size = {osd_bytes}
bluestore fsck on mkfs = false
osd max object name len = 460

[client.rgw]
rgw data = {dir}/rgw
rgw frontends = beast endpoint=127.0.0.1:{rgw_port} tcp_nodelay=1
rgw thread pool size = 64
rgw init timeout = 60
rgw enable usage log = false
"""


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
        self.dir = Path(tempfile.mkdtemp(prefix="cachefs-ceph-"))
        self.conf = self.dir / "ceph.conf"
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
        self._spawn("mgr.x", "ceph-mgr", "-i", "x")
        self._start_osd()
        self._spawn("client.rgw", "radosgw", "-n", "client.rgw")
        self._wait("RGW to answer HTTP", "client.rgw", self._rgw_answers)
        self._create_user()
        self.start_seconds = time.monotonic() - started

    def _write_conf(self) -> None:
        for sub in ("run", "log", "crash", "mon/a", "mgr/x", "osd/0", "rgw"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(_CONF.format(fsid=uuid.uuid4(), dir=self.dir, mon_port=self.mon_port,
                                          rgw_port=self.rgw_port, osd_bytes=self.osd_size))

    def _start_mon(self) -> None:
        monmap = self.dir / "monmap"
        fsid = _conf_value(self.conf, "fsid")
        self._run("monmaptool", "--create", "--fsid", fsid, "--addv", "a",
                  f"[v2:127.0.0.1:{self.mon_port}]", str(monmap), name="mon.a")
        self._run("ceph-mon", "--mkfs", "-i", "a", "--monmap", str(monmap), name="mon.a")
        self._spawn("mon.a", "ceph-mon", "-i", "a")
        self._wait("the mon to form a quorum", "mon.a", lambda: self._ceph_ok("mon", "stat"))

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
        """Start a daemon in the foreground (-f: no fork, so its PID is ours); it logs to its file."""
        out = open(self.dir / "log" / f"{name}.stdout", "wb")     # noqa: SIM115 (the child owns it)
        with out:
            proc = subprocess.Popen([binary, "-f", "-c", str(self.conf), *args], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self._daemons.append(_Daemon(name, proc))

    def _run(self, *cmd: str, name: str, timeout: float = 30.0) -> str:
        """A one-shot ceph tool; its failure raises CephError with its output and the daemon log tail."""
        argv = [cmd[0], "-c", str(self.conf), *cmd[1:]]
        try:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=self._bounded(timeout))
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

    def _wait(self, what: str, name: str, ready) -> None:
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


def _conf_value(conf: Path, key: str) -> str:
    for line in conf.read_text().splitlines():
        name, _, value = line.partition("=")
        if name.strip() == key:
            return value.strip()
    raise KeyError(key)


if __name__ == "__main__":     # a manual check: bring it up, print the endpoint and memory, stop
    with CephRGW() as rgw:
        print(f"{rgw.endpoint_url} ready in {rgw.start_seconds:.1f} s; RSS "
              f"{sum(rgw.rss_bytes().values()) / 1e6:.0f} MB {rgw.rss_bytes()}")
