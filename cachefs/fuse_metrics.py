"""The FUSE adapter's metrics (``fuse_ops.Operations`` counts into them): operations, their
failures and latency, and what the request loop processes did with the requests they read."""

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily

from cachefs.metrics import Metrics, OperationTimes


class FuseMetrics:
    """The FUSE adapter's metrics: operations, their failures and latency, by operation."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.fuse_times = OperationTimes(r, ("cachefs_fuse_operations", "FUSE operations"),
                                         ("cachefs_fuse_operation_seconds", "FUSE operation latency"))
        self.fuse_errors = Counter("cachefs_fuse_errors", "FUSE operations that failed", ["op", "errno"],
                                   registry=r)
        self.loop_requests = LoopRequests(r)


class LoopRequests:
    """What the request loop processes (``--fuse-loop-kind process``) did with the requests they
    read, from their shared table at scrape time: answered there (open, release, ioctl) or sent to
    the daemon (forwarded). Opens answered there are passthrough opens the daemon never sees. And
    what the daemon's own loop answered from that table (the opens of published backings, the
    releases of the loops' handles it read and isatty on them), with or without loop processes."""

    _name, _help = "cachefs_fuse_loop_requests", "Requests the FUSE loop processes read, by what became of them"
    _daemon, _daemon_help = ("cachefs_fuse_table_requests",
                             "Requests the daemon's own FUSE loop answered from the loops' table (no operation run): "
                             "open, release, ioctl (CPython's isatty)")
    _labelnames = ("answer",)         # (both families: metrics_table)

    def __init__(self, registry: CollectorRegistry) -> None:
        self.source = None            # the loops (cachefs/fuse/loop_procs.py) once they run
        registry.register(self)

    def describe(self):
        return [CounterMetricFamily(self._name, self._help, labels=["answer"]),
                CounterMetricFamily(self._daemon, self._daemon_help, labels=["answer"])]

    def collect(self):
        family = CounterMetricFamily(self._name, self._help, labels=["answer"])
        totals = self.source.totals() if self.source is not None else {}
        for answer, kind in (("open", "opens"), ("release", "releases"), ("ioctl", "ioctls"),
                             ("forwarded", "forwarded")):
            family.add_metric([answer], totals.get(kind, 0))
        daemon = CounterMetricFamily(self._daemon, self._daemon_help, labels=["answer"])
        here = self.source.table.stats(0) if self.source is not None else {}
        for answer, kind in (("open", "opens"), ("release", "releases"), ("ioctl", "ioctls")):
            daemon.add_metric([answer], here.get(kind, 0))
        return [family, daemon]


class TimingCache(dict):
    """Each operation's count and latency (``metrics.OperationTimes``), resolved once by name."""

    def __init__(self, metrics: Metrics) -> None:
        super().__init__()
        self._times = metrics.fuse_times          # metrics: the FuseMetrics group

    def __missing__(self, name: str):
        child = self[name] = self._times.child(name)
        return child
