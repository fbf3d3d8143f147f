"""The object store's metrics: requests by operation and status, latency, retries, bytes, accepted
range fallbacks."""

from prometheus_client import CollectorRegistry, Counter, Histogram

from cachefs.metrics import LATENCY_BUCKETS


class StoreMetrics:
    """Registered on a daemon's registry by ``Metrics.group(StoreMetrics)``."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.store_bytes = Counter("cachefs_store_read_bytes", "Bytes read from the object store", registry=r)
        # op in {get, head, list, put, ...}; status: HTTP code class or error kind
        self.store_requests = Counter("cachefs_store_requests", "Object-store requests by operation and status: "
                                      "the HTTP status, 'error' (no answer), 'cancelled' (a hedge that lost, a "
                                      "reader gone: not an error)", ["op", "status"],
                                      registry=r)
        self.store_latency = Histogram("cachefs_store_request_seconds", "Object-store request latency",
                                       ["op"], buckets=LATENCY_BUCKETS, registry=r)
        self.store_retries = Counter("cachefs_store_retries", "Object-store requests retried", ["op"],
                                     registry=r)
        # kind in {whole_object, range_200_content_range, range_200_etag}: ranged GETs answered 200, accepted
        self.store_range_fallbacks = Counter("cachefs_store_range_fallbacks",
                                             "Ranged GETs answered 200 whose bytes were proven right",
                                             ["kind"], registry=r)
