"""The cache disk's health: a small state machine that fences a failing disk off (docs/design.md, invariant 4).

``DiskHealth`` is the pure state machine; ``HealthWatch`` counts the tier's I/O errors into it
(metrics, logs) and probes a sick disk after a quiet cool-down, in a worker thread.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import trio

from cachefs.metrics import Metrics
from cachefs.tiers.disk import format as fmt
from cachefs.tiers.metrics import TierMetrics

log = logging.getLogger(__name__)


class DiskHealth:
    """healthy -> unstable (no new fills) -> down (reads and fills bypass the tier).

    ``unstable_errors`` I/O errors within ``window`` seconds make the disk unstable,
    ``down_errors`` make it down. Errors never improve the state; once ``cooldown`` seconds
    passed since the last error, the owner probes the disk and calls ``recovered``.
    """

    HEALTHY, UNSTABLE, DOWN = 0, 1, 2
    NAMES = ("healthy", "unstable", "down")

    def __init__(self, *, unstable_errors: int = 3, down_errors: int = 10, window: float = 10.0,
                 cooldown: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.unstable_errors = unstable_errors
        self.down_errors = down_errors
        self.window = window
        self.cooldown = cooldown
        self.state = self.HEALTHY
        self._clock = clock
        self._errors: deque[float] = deque()

    @property
    def name(self) -> str:
        return self.NAMES[self.state]

    def record_error(self) -> bool:
        """Count one I/O error; True when the state changed."""
        now = self._clock()
        self._errors.append(now)
        while self._errors[0] < now - self.window:
            self._errors.popleft()
        count = len(self._errors)
        worse = self.DOWN if count >= self.down_errors else (
            self.UNSTABLE if count >= self.unstable_errors else self.HEALTHY)
        old, self.state = self.state, max(self.state, worse)
        return self.state != old

    def probe_due(self) -> bool:
        return self.state != self.HEALTHY and self._clock() - self._errors[-1] >= self.cooldown

    def recovered(self) -> None:
        self.state = self.HEALTHY
        self._errors.clear()


class HealthWatch:
    """Feeds the tier's I/O errors to ``health`` and brings a sick disk back once a probe write
    in ``probe_dir`` succeeds. ``probe`` is a seam for tests (a blocking call that may fail)."""

    def __init__(self, health: DiskHealth, metrics: Metrics, root: Path, probe_dir: Path, *,
                 fsync: bool, limiter: trio.CapacityLimiter) -> None:
        self.health = health
        self._metrics = metrics.group(TierMetrics)
        self._root = root
        self._probe_dir = probe_dir
        self._fsync = fsync
        self._limiter = limiter
        self.probe: Callable[[Path, bool], None] = probe_dir_writable
        self._metrics.disk_health.set(health.state)

    def io_error(self, op: str, exc: OSError) -> None:
        self._metrics.disk_errors.labels(op).inc()
        log.info("cache disk %s: %s failed: %s", self._root, op, exc)
        if self.health.record_error():
            self._metrics.disk_health.set(self.health.state)
            log.warning("cache disk %s is now %s after repeated I/O errors (last: %s)",
                        self._root, self.health.name, exc)

    async def run(self) -> None:
        while True:
            await trio.sleep(min(1.0, self.health.cooldown / 2))
            if not self.health.probe_due():
                continue
            try:
                await trio.to_thread.run_sync(self.probe, self._probe_dir, self._fsync, limiter=self._limiter)
            except OSError as exc:
                self.io_error("probe", exc)
                continue
            self.health.recovered()
            self._metrics.disk_health.set(self.health.state)
            log.info("cache disk %s is healthy again", self._root)


def probe_dir_writable(directory: Path, fsync: bool) -> None:
    """Write, fsync and delete a small file: raises OSError if the disk cannot take writes."""
    path = directory / f"probe.{secrets.token_hex(4)}.tmp"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        fmt.write_all(fd, b"cachefs probe\n")
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
        with suppress(FileNotFoundError):
            os.unlink(path)
