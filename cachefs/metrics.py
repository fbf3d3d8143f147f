"""Prometheus metrics on a dedicated registry, and the exporter.

Labels never carry secrets or unbounded values (no paths, no keys): only tier,
operation, status class and result names from small fixed sets.
"""

import logging
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler, make_server

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """All metrics of one daemon. Create one per daemon (tests create many)."""

    def __init__(self) -> None:
        disable_created_metrics()     # no *_created series: one timestamp per counter doubles the series for nothing
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.mount_info = Info("cachefs_mount", "Which mount this daemon serves: labels mountpoint, url (the dataset, "
                               "never credentials), volume_id (the CSI volume, or empty); join on instance",
                               registry=r)
        self.takeovers = Gauge("cachefs_takeovers", "Daemons that took this live mount over from a dead or "
                               "restarted one so far (its keeper's count; 0 for the daemon that mounted it)",
                               registry=r)
        # tiers: tier in {memory, disk}
        self.tier_hits = Counter("cachefs_tier_hits", "Block reads served by a tier", ["tier"], registry=r)
        self.tier_misses = Counter("cachefs_tier_misses", "Block reads a tier could not serve", ["tier"], registry=r)
        self.tier_hit_bytes = Counter("cachefs_tier_hit_bytes", "Bytes served by a tier", ["tier"], registry=r)
        self.tier_used_bytes = Gauge("cachefs_tier_used_bytes", "Bytes held by a tier", ["tier"], registry=r)
        self.tier_capacity_bytes = Gauge("cachefs_tier_capacity_bytes", "Capacity of a tier", ["tier"], registry=r)
        self.tier_blocks = Gauge("cachefs_tier_blocks", "Blocks held by a tier", ["tier"], registry=r)
        self.evictions = Counter("cachefs_evictions", "Blocks evicted", ["tier"], registry=r)
        self.evicted_bytes = Counter("cachefs_evicted_bytes", "Bytes evicted", ["tier"], registry=r)
        # reason in {queue_full, no_space, unhealthy, error}
        self.dropped_fills = Counter("cachefs_dropped_fills", "Cache fills dropped instead of queued",
                                     ["tier", "reason"], registry=r)
        self.corrupt_blocks = Counter("cachefs_corrupt_blocks", "Disk-tier blocks that failed verification",
                                      registry=r)
        self.packed_crc_errors = Counter("cachefs_packed_crc_errors", "Packed records whose crc32c failed", registry=r)
        self.disk_errors = Counter("cachefs_disk_errors", "I/O errors on the cache disk", ["op"], registry=r)
        # 0 healthy, 1 unstable, 2 down
        self.disk_health = Gauge("cachefs_disk_health", "Cache disk state: 0 healthy, 1 unstable, 2 down",
                                 registry=r)
        self.store_bytes = Counter("cachefs_store_read_bytes", "Bytes read from the object store", registry=r)
        # op in {get, head, list, put, ...}; status: HTTP code class or error kind
        self.store_requests = Counter("cachefs_store_requests", "Object-store requests by operation and status: "
                                      "the HTTP status, 'error' (no answer), 'cancelled' (a hedge that lost, a "
                                      "reader gone: not an error)", ["op", "status"],
                                      registry=r)
        self.store_latency = Histogram("cachefs_store_request_seconds", "Object-store request latency",
                                       ["op"], buckets=_LATENCY_BUCKETS, registry=r)
        self.store_retries = Counter("cachefs_store_retries", "Object-store requests retried", ["op"],
                                     registry=r)
        # kind in {whole_object, range_200_content_range, range_200_etag}: ranged GETs answered 200, accepted
        self.store_range_fallbacks = Counter("cachefs_store_range_fallbacks",
                                             "Ranged GETs answered 200 whose bytes were proven right",
                                             ["kind"], registry=r)
        self.readahead_blocks = Counter("cachefs_readahead_blocks", "Blocks fetched ahead by readahead",
                                        registry=r)
        self.readahead_wasted_bytes = Counter(
            "cachefs_readahead_wasted_bytes", "Bytes fetched by readahead and evicted from memory before any read",
            registry=r)
        self.readahead_cancelled = Counter(
            "cachefs_readahead_cancelled", "Readahead GETs cancelled: their reader closed the file or moved away",
            registry=r)
        self.readahead_window = Histogram(
            "cachefs_readahead_window_bytes", "Readahead window of a sequential reader, at each read that extends it",
            buckets=[1 << n for n in range(17, 28)], registry=r)
        self.lookup_readaheads = Counter("cachefs_lookup_readaheads",
                                         "Small files whose GET a lookup started (the open joins it)", registry=r)
        self.singleflight_joins = Counter("cachefs_singleflight_joins",
                                          "Reads that joined an in-flight download", registry=r)
        self.fuse_ops = Counter("cachefs_fuse_operations", "FUSE operations", ["op"], registry=r)
        self.fuse_errors = Counter("cachefs_fuse_errors", "FUSE operations that failed", ["op", "errno"],
                                   registry=r)
        self.passthrough_opens = Counter("cachefs_passthrough_opens", "Opens the kernel serves from a cache file "
                                         "itself (FUSE passthrough: no READ reaches the daemon)", registry=r)
        # reason in {kernel, no_cap_sys_admin, backing_open, no_xattr, not_cached, busy, mutable, off}
        self.passthrough_fallbacks = Counter("cachefs_passthrough_fallbacks", "Opens (or whole mounts: kernel, "
                                             "mutable, off, no_cap_sys_admin, no_xattr) served without passthrough, "
                                             "by reason", ["reason"], registry=r)
        # result in {assembled, failed}
        self.whole_files = Counter("cachefs_whole_files", "Large objects written as one exact cache file from "
                                   "their cached blocks (so passthrough can hand them to the kernel), by result",
                                   ["result"], registry=r)
        # result in {ok, corrupt}
        self.scrub_files = Counter("cachefs_scrub_files", "Exact cache files verified before their first "
                                   "hand-over or by the background scrub, by result", ["result"], registry=r)
        self.fuse_latency = Histogram("cachefs_fuse_operation_seconds", "FUSE operation latency", ["op"],
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.read_bytes = Counter("cachefs_read_bytes", "Bytes served to readers from any tier or the store, "
                                  "small files pushed into the page cache at open included", registry=r)
        # hedged GETs (cachefs/tiers/hedge.py): result in {won, lost, failed, cancelled}; reason in {budget, busy}
        self.hedged_requests = Counter("cachefs_hedged_requests", "Second GETs started for a straggler, by "
                                       "result (won: answered first; lost: the first GET answered first; failed: the hedge "
                                       "failed; cancelled: the read ended first). Never counted as GET errors",
                                       ["result"],
                                       registry=r)
        self.hedges_skipped = Counter("cachefs_hedges_skipped", "Stragglers not hedged, by reason",
                                      ["reason"], registry=r)
        self.hedge_delay = Gauge("cachefs_hedge_delay_seconds", "A GET of this size class still unanswered "
                                 "after this long is hedged", ["size_class"], registry=r)

    def describe_mount(self, mountpoint: str, url: str, volume_id: str | None) -> None:
        """Set cachefs_mount_info: the mountpoint, the dataset URL (never carries credentials: URLs
        with them are refused) and the CSI volume id (empty outside Kubernetes)."""
        self.mount_info.info({"mountpoint": mountpoint, "url": url, "volume_id": volume_id or ""})

    def counter_value(self, name: str, **labels: str) -> float:
        """The current value of one sample (``name`` as exported, e.g. 'cachefs_tier_hits_total')."""
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


class WritebackMetrics:
    """The write-back's metrics (sync_class in {log, checkpoint}; result in {ok, failed, superseded})."""

    def __init__(self, metrics: Metrics) -> None:
        r = metrics.registry
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


class WarmupMetrics:
    """The warm engine's metrics (result in {fetched, cached, failed}); ``jobs()`` returns the
    running warm jobs (each with ``bytes``, ``done_bytes``, ``fetched_bytes``, ``elapsed()``)."""

    def __init__(self, metrics: Metrics, jobs) -> None:
        r = metrics.registry
        self.files = Counter("cachefs_warmup_files", "Files a warmup finished, by result "
                             "(fetched, cached: already there, failed)", ["result"], registry=r)
        self.bytes = Counter("cachefs_warmup_bytes", "Bytes a warmup fetched or found cached",
                             ["result"], registry=r)
        running = Gauge("cachefs_warmup_jobs_running", "Warmups running", registry=r)
        running.set_function(lambda: len(jobs()))
        left = Gauge("cachefs_warmup_remaining_bytes", "Bytes running warmups have still to do", registry=r)
        left.set_function(lambda: sum(max(0, j.bytes - j.done_bytes) for j in jobs()))
        rate = Gauge("cachefs_warmup_rate_bytes", "Fetch rate of running warmups (bytes/s)", registry=r)
        rate.set_function(lambda: sum(j.fetched_bytes / max(j.elapsed(), 1e-3) for j in jobs()))


class Exporter:
    """Serves /metrics on a loopback address from a daemon thread."""

    def __init__(self, metrics: Metrics, host: str, port: int, tries: int = 10) -> None:
        self._server: WSGIServer | None = None
        app = make_wsgi_app(metrics.registry)
        last: OSError | None = None
        for candidate in range(port, port + tries):
            try:
                self._server = make_server(host, candidate, app, ThreadingWSGIServer,
                                           handler_class=_SilentHandler)
                break
            except OSError as exc:
                last = exc
        if self._server is None:
            raise OSError(f"no free port for metrics in {host}:{port}-{port + tries - 1}: {last}")
        self.address = f"{host}:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def metrics_table(registry: CollectorRegistry) -> str:
    """Every metric family of ``registry`` as the docs' table (name as exported, type, labels,
    meaning): docs/metrics.md is rendered from it (``python -m cachefs.metrics``)."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for family in sorted(registry.collect(), key=lambda f: f.name):
        collector = registry._names_to_collectors.get(family.name) or registry._names_to_collectors.get(
            family.name + "_total") or registry._names_to_collectors.get(family.name + "_info")
        labels = ", ".join(f"`{name}`" for name in getattr(collector, "_labelnames", ()))
        exported = {"counter": f"{family.name}_total", "info": f"{family.name}_info"}.get(family.type, family.name)
        rows.append(f"| `{exported}` | {family.type} | {labels} | {family.documentation} |")
    return "\n".join(rows)


def daemon_registry() -> CollectorRegistry:
    """A registry holding every metric a daemon exports (core, write-back, warmup)."""
    metrics = Metrics()
    WritebackMetrics(metrics)
    WarmupMetrics(metrics, lambda: [])
    return metrics.registry


if __name__ == "__main__":
    print(metrics_table(daemon_registry()))
