"""The write-back's metrics (registered by ``Metrics.group(WritebackMetrics)``)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class WritebackMetrics:
    """The write-back's metrics (sync_class in {log, checkpoint}; result in {ok, failed, superseded})."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.dirty_bytes = Gauge("cachefs_dirty_bytes", "Bytes of staged files not yet in the store",
                                 ["sync_class"], registry=r)
        self.dirty_files = Gauge("cachefs_dirty_files", "Staged files not yet in the store", ["sync_class"],
                                 registry=r)
        self.oldest_dirty = Gauge("cachefs_oldest_dirty_seconds", "Age of the oldest unsynced write",
                                  ["sync_class"], registry=r)
        self.staged_bytes = Gauge("cachefs_staged_bytes", "Bytes in the staging area", registry=r)
        self.failing = Gauge("cachefs_upload_failing", "Staged files and operations whose last try failed",
                             registry=r)
        self.uploads = Counter("cachefs_uploads", "Uploads by sync class and result", ["sync_class", "result"],
                               registry=r)
        self.uploaded_bytes = Counter("cachefs_uploaded_bytes", "Bytes uploaded", ["sync_class"], registry=r)
        self.sync_lag = Histogram("cachefs_sync_lag_seconds", "First unsynced write to object complete",
                                  ["sync_class"], registry=r,
                                  buckets=(0.1, 0.5, 1, 2, 5, 6, 7.5, 10, 20, 30, 60, 120, 300, 600, 1800))
        self.staging_full = Counter("cachefs_staging_full", "Writes refused with ENOSPC", registry=r)
        self.journal_errors = Counter("cachefs_journal_errors", "Journal writes or removals that failed (the "
                                      "record stays for the next start; the staging area is fenced)", registry=r)
        self.kept_aside = Counter("cachefs_staged_kept_aside", "Staged files a start did not trust (the staging "
                                  "filesystem lost unsynced pages), in staging/lost+found", registry=r)
