"""Which sync class a staged file belongs to, when it is due, and how it is cut into parts.

*checkpoint* names are tried first, then *log* names; a name matching neither is *log* below
``small_file_size`` and *checkpoint* above. A log file is due ``log_period`` after its first
unsynced write; a checkpoint file once closed and unchanged for ``quiet_period``, or
``checkpoint_period`` after its first unsynced write at the latest.
"""

import fnmatch
from dataclasses import dataclass

LOG, CHECKPOINT = "log", "checkpoint"
CLASSES = (LOG, CHECKPOINT)
MAX_PARTS = 10_000      # S3 (and Ceph RGW) refuse a multipart upload of more parts


@dataclass(frozen=True, slots=True)
class SyncPolicy:
    log_patterns: tuple[str, ...]
    checkpoint_patterns: tuple[str, ...]
    small_file_size: int
    log_period: float
    quiet_period: float
    checkpoint_period: float

    @classmethod
    def from_config(cls, cfg) -> "SyncPolicy":
        return cls(cfg.log_patterns, cfg.checkpoint_patterns, cfg.small_file_size, cfg.log_sync_period,
                   cfg.checkpoint_quiet_period, cfg.checkpoint_sync_period)

    def classify(self, path: str, size: int) -> str:
        name = path.rsplit("/", 1)[-1]
        if any(fnmatch.fnmatchcase(name, p) for p in self.checkpoint_patterns):
            return CHECKPOINT
        if any(fnmatch.fnmatchcase(name, p) for p in self.log_patterns):
            return LOG
        return LOG if size < self.small_file_size else CHECKPOINT

    def due(self, path: str, size: int, *, dirty_since: float, last_write: float, open_for_write: bool) -> float:
        """When a file whose first unstarted write is ``dirty_since`` should start uploading."""
        if self.classify(path, size) == LOG:
            return dirty_since + self.log_period
        due = dirty_since + self.checkpoint_period
        return due if open_for_write else min(due, last_write + self.quiet_period)


def part_size_for(size: int, configured: int) -> int:
    """The configured part size, grown (to whole MiB) only where it would need more than
    MAX_PARTS parts: without this a file over MAX_PARTS x part size could never be uploaded."""
    if -(-size // configured) <= MAX_PARTS:
        return configured
    needed = -(-size // MAX_PARTS)
    return -(-needed // (1 << 20)) << 20


@dataclass(frozen=True, slots=True)
class WritebackOptions:
    """What a mount's configuration says of its write-back: the sync classes, the staging area's
    size and how long a write waits for room in it, the part size and the uploads at once."""
    policy: SyncPolicy
    staging_size: int
    staging_wait: float
    part_size: int
    upload_concurrency: int
    log_concurrency: int

    @classmethod
    def from_config(cls, cfg) -> "WritebackOptions":
        return cls(SyncPolicy.from_config(cfg), cfg.staging_size, cfg.staging_wait, cfg.upload_part_size,
                   cfg.upload_concurrency, cfg.log_upload_concurrency)
