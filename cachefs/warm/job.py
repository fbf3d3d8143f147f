"""One warmup: what it warms (``WarmSpec``), its plan per file, its progress and its replies.

Plain data owned by the trio thread; ``cachefs/warm/engine.py`` (``Warmer``) runs the jobs.
"""

import hashlib
import json
import time
from dataclasses import dataclass, field

import trio

from cachefs.store import ObjectInfo
from cachefs.tiers.cache import FileVersion

MAX_FAILURES_SHOWN = 100


@dataclass(frozen=True)
class WarmSpec:
    """Paths (files or directories, relative to the mount root, "" for all of it) and globs
    ("**" crosses directories, "*" does not), or the paths of an uploaded manifest."""

    paths: tuple[str, ...] = ()
    globs: tuple[str, ...] = ()

    @classmethod
    def from_args(cls, args: dict, uploaded: list[str] | None) -> "WarmSpec":
        paths = [_clean(p) for p in list(args.get("paths", [])) + (uploaded or [])]
        globs = [_clean(g) for g in args.get("globs", [])]
        return cls(tuple(dict.fromkeys(paths)), tuple(dict.fromkeys(globs)))

    @property
    def name(self) -> str:
        """Stable identity: a second warmup of the same data joins the first; pins use it."""
        if len(self.paths) + len(self.globs) <= 4:
            return json.dumps({"paths": sorted(self.paths), "globs": sorted(self.globs)}, sort_keys=True)
        body = "\n".join(sorted(self.paths)) + "\0" + "\n".join(sorted(self.globs))
        digest = hashlib.blake2b(body.encode(), digest_size=10).hexdigest()
        return f"manifest of {len(self.paths) + len(self.globs)} entries {digest}"


def _clean(path: str) -> str:
    parts = [p for p in str(path).split("/") if p and p != "."]
    if ".." in parts:
        raise ValueError(f"path must stay inside the mount: {path!r}")
    return "/".join(parts)


class FileWork:
    """One file of a warmup: the version being warmed and its blocks still to do."""

    __slots__ = ("failed", "fetched", "pending", "restarts", "version")

    def __init__(self, info: ObjectInfo) -> None:
        self.version = FileVersion(info.path, info.etag, info.size)
        self.pending = 0
        self.fetched = 0
        self.failed = False
        self.restarts = 0


@dataclass(eq=False)
class WarmJob:
    spec: WarmSpec
    concurrency: int
    bandwidth: float | None = None      # bytes/s, None: unlimited
    force: bool = False
    pin: bool = False
    budget: int | None = None           # a --prefetch-dataset warm: refused above this many bytes
    label: str = ""
    keep: bool = False                  # fetched blocks go to the memory tier too (a shard warm)
    state: str = "listing"              # listing, warming, done, refused, cancelled, failed
    error: str | None = None
    files: int = 0
    bytes: int = 0
    done_files: int = 0
    done_bytes: int = 0
    cached_files: int = 0
    cached_bytes: int = 0
    fetched_files: int = 0
    fetched_bytes: int = 0
    need_bytes: int = 0
    room: dict = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    detached: bool = False
    subscribers: int = 0
    active: int = 0
    cache_full: bool = False
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)
    held: set[str] = field(default_factory=set)
    warmed: list = field(default_factory=list)      # large file versions warmed whole (Tiers.write_whole_soon)
    limiter: trio.CapacityLimiter | None = None

    def __post_init__(self) -> None:
        self.limiter = trio.CapacityLimiter(self.concurrency)

    @property
    def name(self) -> str:
        return self.spec.name

    def elapsed(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    def fail(self, path: str, error: str) -> None:
        self.failures[path] = error

    def report(self, event: str = "progress") -> dict:
        elapsed = max(self.elapsed(), 1e-6)
        rate = self.fetched_bytes / elapsed
        left = max(0, self.bytes - self.done_bytes)
        reply = {"event": event, "state": self.state, "dataset": self.label or self.name,
                 "files": self.files, "bytes": self.bytes, "done_files": self.done_files,
                 "done_bytes": self.done_bytes, "fetched_files": self.fetched_files,
                 "fetched_bytes": self.fetched_bytes, "cached_files": self.cached_files,
                 "cached_bytes": self.cached_bytes, "failed_files": len(self.failures),
                 "elapsed_s": round(elapsed, 3), "rate_bytes_s": round(rate),
                 "files_s": round(self.fetched_files / elapsed, 1),
                 "eta_s": round(left / rate, 1) if rate > 0 and self.state == "warming" else None,
                 "concurrency": self.concurrency}
        if self.error:
            reply["error_detail"] = self.error
        if event != "progress":
            reply["failures"] = [{"path": p, "error": e}
                                 for p, e in list(self.failures.items())[:MAX_FAILURES_SHOWN]]
            reply["need_bytes"], reply["room"] = self.need_bytes, self.room
        return reply


class Bandwidth:
    """A pacing token bucket: ``take(n)`` returns when n more bytes fit the rate."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.rate = bytes_per_s
        self._next = 0.0

    async def take(self, n: int) -> None:
        if not self.rate:
            return
        start = max(trio.current_time(), self._next)
        self._next = start + n / self.rate
        await trio.sleep_until(start)
