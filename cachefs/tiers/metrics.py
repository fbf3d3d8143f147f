"""The tiers' metrics: what each tier serves and holds, fills, evictions, readahead, hedged GETs,
cache files handed to the kernel."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class TierMetrics:
    """Registered on a daemon's registry by ``Metrics.group(TierMetrics)``."""

    def __init__(self, r: CollectorRegistry) -> None:
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
        self.disk_errors = Counter("cachefs_disk_errors", "I/O errors on the cache disk", ["op"], registry=r)
        # 0 healthy, 1 unstable, 2 down
        self.disk_health = Gauge("cachefs_disk_health", "Cache disk state: 0 healthy, 1 unstable, 2 down",
                                 registry=r)
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
        self.passthrough_opens = Counter("cachefs_passthrough_opens", "Opens the kernel serves from a cache file "
                                         "itself (FUSE passthrough: no READ reaches the daemon)", registry=r)
        # reason in {kernel, no_cap_sys_admin, stacking, backing_open, no_xattr, not_cached, busy, mutable, off,
        # no_open}
        self.passthrough_fallbacks = Counter("cachefs_passthrough_fallbacks", "Opens (or whole mounts: kernel, "
                                             "mutable, off, no_open, no_cap_sys_admin, stacking, no_xattr) served "
                                             "without passthrough, by reason", ["reason"], registry=r)
        # result in {assembled, failed}
        self.whole_files = Counter("cachefs_whole_files", "Large objects written as one exact cache file from "
                                   "their cached blocks (so passthrough can hand them to the kernel), by result",
                                   ["result"], registry=r)
        # result in {ok, corrupt, sealed}
        self.scrub_files = Counter("cachefs_scrub_files", "Exact cache files verified before their first "
                                   "hand-over or by the background scrub, by result (sealed: handed over "
                                   "unread, its seal of this boot matching)", ["result"], registry=r)
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
