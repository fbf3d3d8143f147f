"""The warm engine's metrics (registered by ``Metrics.group(WarmupMetrics, jobs)``)."""

from prometheus_client import CollectorRegistry, Counter, Gauge


class WarmupMetrics:
    """The warm engine's metrics (result in {fetched, cached, failed}); ``jobs()`` returns the
    running warm jobs (each with ``bytes``, ``done_bytes``, ``fetched_bytes``, ``elapsed()``)."""

    def __init__(self, r: CollectorRegistry, jobs) -> None:
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
