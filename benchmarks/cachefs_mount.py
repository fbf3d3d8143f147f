"""Drive the ``cachefs`` CLI for benchmarks: mount, status, peak RSS, unmount.

    with CachefsMount(url, mountpoint, endpoint_url=..., cache_dir=...) as mnt:
        ... read files under mnt.mountpoint ...
        mnt.peak_rss()        # daemon VmHWM, bytes

Also ``drop_page_cache()``: ``sync; echo 3 > /proc/sys/vm/drop_caches`` (root only).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

from cachefs import host


def cachefs_command() -> list[str]:
    exe = Path(sys.executable).with_name("cachefs")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "cachefs"]


def cachefs_available() -> str | None:
    """None if ``cachefs mount --help`` works, else why not."""
    try:
        result = subprocess.run(cachefs_command() + ["mount", "--help"], capture_output=True,
                                text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if result.returncode == 0 else (result.stderr.strip()[-500:] or "failed")


def cannot_run(bench: str) -> str | None:
    """Why benchmark ``bench`` cannot run its cachefs rows here (None: it can): it needs root
    (drop_caches, FUSE mounts) and a working ``cachefs`` CLI."""
    if os.geteuid() != 0:
        return f"{bench}: needs root (drop_caches and FUSE mounts)"
    if why := cachefs_available():
        return f"{bench}: the cachefs CLI does not work ({why})"
    return None


def drop_page_cache(keep_inodes: bool = False) -> None:
    """Drop the page cache, and the kernel's dentries and inodes too unless ``keep_inodes`` (a
    dataset larger than RAM: its pages go between epochs, its inodes stay)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("1\n" if keep_inodes else "3\n")


def vm_hwm(pid: int) -> int:
    """Peak resident set size (VmHWM) of ``pid`` in bytes."""
    peak = host.vm_hwm(pid)
    if peak is None:
        raise RuntimeError(f"no VmHWM for pid {pid}")
    return peak


def is_mounted(path: Path) -> bool:
    target = str(Path(path).absolute())
    with open("/proc/self/mountinfo") as fh:
        return any(line.split()[4] == target for line in fh)


class CachefsMount:
    """One ``cachefs mount`` (a daemon process) for the life of the ``with`` block."""

    def __init__(self, url: str, mountpoint: Path, *, endpoint_url: str | None, cache_dir: Path,
                 cache_size: str = "50G", mem_cache_size: str = "1G", immutable: bool = True,
                 extra: tuple[str, ...] = (), env: dict | None = None):
        self.url = url
        self.mountpoint = Path(mountpoint)
        self.cache_dir = Path(cache_dir)
        self.args = [url, str(self.mountpoint), *(["--endpoint-url", endpoint_url] if endpoint_url else []),
                     "--cache-dir", str(cache_dir), "--cache-size", cache_size,
                     "--mem-cache-size", mem_cache_size, "--metrics-port", "0", *extra]
        if immutable:
            self.args.append("--immutable")
        self.env = {**os.environ, **(env or {})}
        self.pid: int | None = None

    def run(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run(cachefs_command() + list(args), capture_output=True, text=True,
                              env=self.env, timeout=timeout, check=False)

    def __enter__(self) -> Self:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        result = self.run("mount", *self.args)
        if result.returncode != 0:
            raise RuntimeError(f"cachefs mount failed ({result.returncode}): {result.stderr.strip()}"
                               f"\n(log: {self.cache_dir / 'cachefs.log'})")
        try:
            self.pid = int(self.status()["pid"])
        except BaseException:
            self.unmount()
            raise
        return self

    def status(self) -> dict:
        result = self.run("status", str(self.mountpoint), "--json", timeout=30)
        if result.returncode != 0:
            raise RuntimeError(f"cachefs status failed: {result.stderr.strip()}")
        return json.loads(result.stdout)

    def peak_rss(self) -> int:
        return vm_hwm(self.pid)

    def unmount(self) -> None:
        if not is_mounted(self.mountpoint):
            return
        result = self.run("umount", str(self.mountpoint), timeout=90)
        if result.returncode != 0 and is_mounted(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True,
                           check=False)
        self._wait_daemon_exit(30.0)

    def _wait_daemon_exit(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.pid and time.monotonic() < deadline:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        self.unmount()


def mounts_under(path: Path) -> list[str]:
    top = str(Path(path).absolute())
    with open("/proc/self/mountinfo") as fh:
        points = [line.split()[4] for line in fh]
    return [p for p in points if p == top or p.startswith(top + "/")]


def remove_tree(path: Path) -> None:
    """rm -rf, but never into a mount that is still there."""
    if busy := mounts_under(path):
        print(f"not removing {path}: still mounted: {', '.join(busy)}", file=sys.stderr)
        return
    shutil.rmtree(path, ignore_errors=True)
