"""A local S3 server on loopback (moto's server mode in a subprocess), for the demo and tests.

moto serves each connection from its own thread (werkzeug ``threaded=True``):
20 small GETs took 0.12 s while four 64 MiB responses sat stalled on unread
sockets, so concurrent GETs work. But the GIL of its one process caps
throughput (numbers in ``LocalS3Server``): it is the faithful server for
behaviour tests (If-Match -> 412, 206 + Content-Range, pagination at 1,000
keys, NoSuchBucket/404), not a benchmark target.
"""

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from types import TracebackType
from typing import Any, Self

import boto3
from botocore.config import Config

_LOCAL_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}

# moto.server's main, with werkzeug's one-line-per-request access log turned off
# (a long benchmark would otherwise fill the log file).
_SERVER_CODE = (
    "import logging, sys\n"
    "logging.getLogger('werkzeug').setLevel(logging.WARNING)\n"
    "from moto.server import main\n"
    "main(sys.argv[1:])\n"
)


def local_credentials_env() -> dict[str, str]:
    """The fake credentials moto accepts (it accepts any); set them in the environment."""
    return dict(_LOCAL_CREDENTIALS)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def s3_client(endpoint_url: str) -> Any:
    """A boto3 S3 client for the local server: path addressing, the fake credentials."""
    creds = _LOCAL_CREDENTIALS
    return boto3.client("s3", endpoint_url=endpoint_url, region_name=creds["AWS_DEFAULT_REGION"],
                        aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
                        config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 3}))


def make_bucket(endpoint_url: str, bucket: str) -> None:
    s3_client(endpoint_url).create_bucket(Bucket=bucket)


class LocalS3Server:
    """moto's S3 server on a free loopback port, started and stopped by its own PID.

    Measured here (2 cores shared with the client, loopback, no injected
    latency, boto3): small GETs ~150-270/s from one client thread and ~300-440/s
    from 8 threads (more threads do not help); PUTs ~215/s with 8 threads (so
    2,500 objects take ~9 s to create); whole 1 MiB GETs ~270 MB/s, but 1 MiB
    ranged GETs of an 8 MiB object only ~80 MB/s. Startup ~0.4 s.
    """

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, start_timeout: float = 30.0) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.endpoint_url = f"http://{host}:{self.port}"
        self._start_timeout = start_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the server)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        cmd = [sys.executable, "-c", _SERVER_CODE, "-H", self.host, "-p", str(self.port)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._start_timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self._proc.returncode}: {self._log_tail()}")
            if self._answers():
                return
            time.sleep(0.05)
        raise RuntimeError(f"moto server on {self.endpoint_url} not ready after {self._start_timeout:.0f} s")

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=1.0):
                return True
        except urllib.error.HTTPError:
            return True    # any HTTP answer means it is serving
        except OSError:
            return False

    def _log_tail(self) -> str:
        self._log.seek(0, os.SEEK_END)
        self._log.seek(max(0, self._log.tell() - 2000))
        return self._log.read().decode("utf-8", "replace").strip()

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._log.close()
