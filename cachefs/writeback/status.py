"""What the write-back still owes the store: ``pending`` (for ``cachefs sync`` and the drain at
unmount) and ``status`` (per sync class, for ``cachefs status`` and the metrics gauges).
Pure functions over the engine's index; they read, never change it."""

import time
from collections.abc import Iterable

from cachefs.writeback.policy import CLASSES, LOG, SyncPolicy
from cachefs.writeback.staged import PendingOp, StagedFile


def pending(files: Iterable[StagedFile], ops: Iterable[PendingOp], policy: SyncPolicy,
            cls: str | None = None) -> dict:
    """Unsynced files of ``cls`` (all when None) and pending operations (log class)."""
    files = [e for e in files if e.dirty and (cls is None or policy.classify(e.path, e.size) == cls)]
    ops = list(ops) if cls in (None, LOG) else []
    return {"files": len(files), "bytes": sum(e.size for e in files), "operations": len(ops),
            "uploading": sum(1 for e in files if e.uploading is not None),
            "failing": sum(1 for e in files if e.failures) + sum(1 for o in ops if o.failures),
            "errors": sorted({e.last_error for e in files if e.last_error}
                             | {o.last_error for o in ops if o.failures})[:5]}


def by_class(files: Iterable[StagedFile], policy: SyncPolicy, now: float | None = None) -> dict:
    """Per sync class: dirty files and bytes, the oldest dirty age, uploading, failing."""
    now = time.time() if now is None else now
    classes = {cls: {"dirty_files": 0, "dirty_bytes": 0, "oldest_dirty_age_s": None, "uploading": 0,
                     "failing": 0} for cls in CLASSES}
    for entry in files:
        if not entry.dirty:
            continue
        c = classes[policy.classify(entry.path, entry.size)]
        c["dirty_files"] += 1
        c["dirty_bytes"] += entry.size
        age = round(now - entry.unsynced_since, 1)
        c["oldest_dirty_age_s"] = max(c["oldest_dirty_age_s"] or 0.0, age)
        c["uploading"] += entry.uploading is not None
        c["failing"] += entry.failures > 0
    return classes


def update_gauges(m, status: dict) -> None:
    """Set the write-back's gauges (``WritebackMetrics`` ``m``) from the engine's ``status``."""
    for cls, c in status["classes"].items():
        m.dirty_bytes.labels(cls).set(c["dirty_bytes"])
        m.dirty_files.labels(cls).set(c["dirty_files"])
        m.oldest_dirty.labels(cls).set(c["oldest_dirty_age_s"] or 0.0)
    m.staged_bytes.set(status["staged_bytes"])
    m.failing.set(status["failing"])
