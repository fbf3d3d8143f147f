"""Shared pieces of the CSI tests (no tests here): the node agent and the plugin as real processes,
a gRPC client, a moto bucket. The processes run without AWS credentials in their environment, so
a volume mounts only with the credentials of the CSI request's secrets."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from mounts import require_fuse

from cachefs.host import mounts
from cachefs.launcher import process_alive
from csi.proto import pb, rpc
from testing.s3 import local_credentials_env

SECRETS = {"accessKeyID": local_credentials_env()["AWS_ACCESS_KEY_ID"],
           "secretAccessKey": local_credentials_env()["AWS_SECRET_ACCESS_KEY"]}
MODE = pb.VolumeCapability.AccessMode


def clean_env() -> dict[str, str]:
    """This environment minus AWS credentials (the driver must get them from the request)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}


def capability(mode=MODE.SINGLE_NODE_WRITER) -> "pb.VolumeCapability":
    return pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(),
                               access_mode=pb.VolumeCapability.AccessMode(mode=mode))


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Driver:
    """A node agent and a CSI plugin (`--mode both`) on sockets under ``root``."""

    def __init__(self, root: Path, plugin_prefix: list[str] | None = None, metrics_port: int = 0,
                 agent_metrics_port: int = 0, agent_prefix: list[str] | None = None,
                 agent_args: list[str] | None = None) -> None:
        self.root = root
        self.agent_socket = str(root / "agent.sock")
        self.csi_socket = str(root / "csi.sock")
        self.state_dir = root / "state"
        self.cache_root = root / "cache"
        self.plugin_prefix = plugin_prefix or []
        self.agent_prefix = agent_prefix or []
        self.agent_args = agent_args or []
        self.agent_starts = 0
        self.metrics_port = metrics_port
        self.agent_metrics_port = agent_metrics_port
        self.agent: subprocess.Popen | None = None
        self.plugin: subprocess.Popen | None = None
        self._channel = None

    def _spawn(self, args: list[str], log: str, prefix: list[str]) -> subprocess.Popen:
        out = open(self.root / log, "ab")
        try:
            return subprocess.Popen([*prefix, sys.executable, "-m", "cachefs", *args], stdout=out, stderr=out,
                                    cwd=self.root, env=clean_env(), start_new_session=True)
        finally:
            out.close()

    def start_agent(self, *, replace: bool = False) -> None:
        """Start an agent; ``replace``: beside the running one, which it takes the volumes from
        (a rolling update); returns once the new one is ready (its ``--ready-file``, the pod's
        readiness probe: written once it serves, after any take-over). A socket's inode number
        says nothing: a new socket may get the number of the one it replaced."""
        if not replace:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.agent_socket)      # a killed agent's socket
        self.agent_starts += 1
        ready = self.root / f"agent-ready-{self.agent_starts}"
        self.agent = self._spawn(["csi-agent", "--socket", self.agent_socket, "--state-dir", str(self.state_dir),
                                  "--cache-root", str(self.cache_root), "--cache-size", "2G",
                                  "--metrics-port", str(self.metrics_port), "--check-interval", "0.5",
                                  "--agent-metrics-port", str(self.agent_metrics_port), "--ready-file", str(ready),
                                  *self.agent_args],
                                 "agent.log",
                                 self.agent_prefix)
        wait_for(lambda: ready.exists() or self.agent.poll() is not None, 60, "the agent to be ready")
        assert self.agent.poll() is None, self.log("agent.log")
        assert os.path.exists(self.agent_socket)

    def start_plugin(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.csi_socket)
        self.plugin = self._spawn(["csi", "--endpoint", f"unix://{self.csi_socket}", "--node-id", "node-1",
                                   "--agent-socket", self.agent_socket], "plugin.log", self.plugin_prefix)
        wait_for(lambda: os.path.exists(self.csi_socket) or self.plugin.poll() is not None, 30, "the CSI socket")
        assert self.plugin.poll() is None, self.log("plugin.log")
        self._channel = grpc.insecure_channel(f"unix://{self.csi_socket}")

    def log(self, name: str) -> str:
        path = self.root / name
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    @property
    def node(self) -> "rpc.NodeStub":
        return rpc.NodeStub(self._channel)

    @property
    def controller(self) -> "rpc.ControllerStub":
        return rpc.ControllerStub(self._channel)

    @property
    def identity(self) -> "rpc.IdentityStub":
        return rpc.IdentityStub(self._channel)

    def kill_plugin(self) -> None:
        """SIGKILL the plugin's whole process group (with unshare: the namespace dies with it)."""
        os.killpg(self.plugin.pid, signal.SIGKILL)
        self.plugin.wait()
        if self._channel is not None:
            self._channel.close()

    def stop(self) -> None:
        for proc in (self.plugin, self.agent):
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self._channel is not None:
            self._channel.close()

    def daemon_pids(self) -> list[int]:
        """Live cachefs daemons serving a volume under this driver's cache root (each holds its
        cache dir's lock; a keeper's standby daemon holds none yet)."""
        return [pid for pid in self._pids(b"_daemon") if "/cachefs.lock" in _open_files(pid)]

    def kill_volume_processes(self) -> None:
        """SIGKILL every keeper and daemon of this driver's volumes (keepers first)."""
        for pid in self.process_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def process_pids(self) -> list[int]:
        """Every cachefs process of this driver's volumes: keepers first (so a kill in this order
        leaves none to start a new daemon), then daemons, standbys included."""
        return self._pids(b"_keeper") + self._pids(b"_daemon")

    def _pids(self, role: bytes) -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
                if role in cmd and process_alive(int(entry)) and \
                        str(self.cache_root) in os.readlink(f"/proc/{entry}/cwd") + _open_files(int(entry)):
                    pids.append(int(entry))
        return pids


def _open_files(pid: int) -> str:
    names = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                names.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return " ".join(names)


def mounted_under(root: Path) -> list[str]:
    return [m.mountpoint for m in mounts() if m.mountpoint.startswith(str(root) + "/")]


def cleanup_mounts(root: Path) -> None:
    for path in sorted(mounted_under(root), key=len, reverse=True):
        subprocess.run(["umount", "-l", path], capture_output=True)


@pytest.fixture
def driver(tmp_path: Path):
    """A started agent + plugin; every daemon and mount under tmp_path is gone afterwards."""
    require_fuse()
    drv = Driver(tmp_path)
    drv.start_agent()
    drv.start_plugin()
    yield drv
    pids = drv.process_pids()
    drv.stop()
    cleanup_mounts(tmp_path)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def static_context(endpoint: str, bucket: str, prefix: str = "data", **extra: str) -> dict[str, str]:
    return {"url": f"s3://{bucket}/{prefix}", "endpoint": endpoint, "memCacheSize": "64M", **extra}
