"""The lock-free operation timings (cachefs/metrics.py ``OperationTimes``) export what
prometheus_client's own Counter and Histogram would for the same observations."""

import random
import threading
import urllib.request

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from cachefs.metrics import LATENCY_BUCKETS, Exporter, Metrics, OperationTimes, metrics_table


def test_operation_times_export_as_a_counter_and_a_histogram_would():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    times = OperationTimes(ours, ("t_ops", "Ops"), ("t_op_seconds", "Op latency"))
    count = Counter("t_ops", "Ops", ["op"], registry=theirs)
    latency = Histogram("t_op_seconds", "Op latency", ["op"], buckets=LATENCY_BUCKETS, registry=theirs)
    rng = random.Random(1)
    samples = [*LATENCY_BUCKETS, 0.0, 1e-7, 99.0, *(rng.expovariate(2000) for _ in range(500))]
    for seconds in samples:
        op = rng.choice(["open", "lookup", "release"])
        times.child(op).observe(seconds)
        count.labels(op).inc()
        latency.labels(op).observe(seconds)

    def lines(registry):
        text = generate_latest(registry).decode().splitlines()
        return sorted(line for line in text if not line.startswith("#") and "_created" not in line)

    mine, reference = lines(ours), lines(theirs)
    assert len(mine) == len(reference) > 3 * (len(LATENCY_BUCKETS) + 3)
    for a, b in zip(mine, reference, strict=True):
        name_a, value_a = a.rsplit(" ", 1)
        name_b, value_b = b.rsplit(" ", 1)
        assert name_a == name_b and abs(float(value_a) - float(value_b)) < 1e-9, (a, b)
    table = metrics_table(ours)
    assert "| `t_ops_total` | counter | `op` | Ops |" in table and "| `t_op_seconds` | histogram | `op` |" in table


def test_the_exporter_runs_its_hook_before_each_scrape_and_serves_what_it_counted():
    """A daemon counts some answers in batches; the scrape's thread first has them counted
    (``Exporter(before=...)``), so a scrape never shows less than what was answered before it."""
    metrics = Metrics()
    pending = Counter("t_batched", "Counted in batches", registry=metrics.registry)
    calls = []

    def before():
        calls.append(threading.current_thread().name)
        pending.inc(3)

    exporter = Exporter(metrics, "127.0.0.1", 0, before=before)          # (0: a free port)
    try:
        for expected in (3, 6):
            with urllib.request.urlopen(f"http://{exporter.address}/metrics", timeout=10) as answer:
                text = answer.read().decode()
            assert f"t_batched_total {float(expected)}" in text.splitlines()
        assert len(calls) == 2 and threading.current_thread().name not in calls
    finally:
        exporter.close()
