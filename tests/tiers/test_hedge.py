"""Hedged GETs (cachefs/tiers/hedge.py): the latency estimator, the race and its budget, on
trio's virtual clock with scripted calls; the wiring in Tiers with a fake async store; and a
real trio HTTP client whose losing connection must be closed, not pooled."""

import functools
import random

import pytest
import trio
import trio.testing
from botocore.credentials import Credentials

from cachefs.errors import StoreError
from cachefs.metrics import Metrics
from cachefs.store import ObjectStore
from cachefs.store.s3.http import AsyncGetter
from cachefs.tiers.cache import FileVersion, Tiers
from cachefs.tiers.hedge import HedgePolicy, Hedger, LatencyEstimator, cancellable_gets, size_class
from cachefs.tiers.memory import MemoryTier

LENGTH = 100_000


def run_virtual(fn, hedger: Hedger | None = None, clock: trio.testing.MockClock | None = None):
    """Run ``fn`` with ``hedger``'s clock task on a virtual clock that jumps as soon as every
    task sleeps."""
    async def main():
        error = None
        async with trio.open_nursery() as nursery:
            if hedger is not None:
                await nursery.start(hedger.run)
            try:
                result = await fn()
            except Exception as exc:        # noqa: BLE001 - raised below, outside the nursery
                error = exc
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error
        return result
    return trio.run(main, clock=clock or trio.testing.MockClock(autojump_threshold=0))


def hedges(metrics: Metrics, result: str) -> int:
    return int(metrics.counter_value("cachefs_hedged_requests_total", result=result))


def skipped(metrics: Metrics, reason: str) -> int:
    return int(metrics.counter_value("cachefs_hedges_skipped_total", reason=reason))


class Script:
    """A GET whose attempts take scripted times: ``plan(call_no, attempt_no) -> (seconds, error)``."""

    def __init__(self, plan) -> None:
        self.plan = plan
        self.started = 0
        self.cancelled = 0
        self.call_no = 0

    def call(self, call_no: int):
        attempt = [0]

        async def one() -> bytes:
            seconds, error = self.plan(call_no, attempt[0])
            attempt[0] += 1
            self.started += 1
            try:
                await trio.sleep(seconds)
            except trio.Cancelled:
                self.cancelled += 1
                raise
            if error is not None:
                raise error
            return b"data-%d" % call_no
        return one


async def primed(hedger: Hedger, seconds: float = 0.010, n: int = 20) -> None:
    for _ in range(n):
        hedger.observe(LENGTH, seconds)


# --- the estimator ------------------------------------------------------------------------------

def test_estimator_quantiles_within_a_bucket():
    est = LatencyEstimator()
    assert est.quantile(0.95) is None
    rng = random.Random(1)
    values = sorted(rng.uniform(0.010, 0.020) for _ in range(999))
    for v in values:
        est.observe(v)
    for q in (0.5, 0.95, 0.99):
        true = values[int(q * len(values)) - 1]
        assert true <= est.quantile(q) <= true * 1.1 + 1e-9, (q, true, est.quantile(q))


def test_estimator_follows_a_slower_store_and_stays_bounded():
    est = LatencyEstimator(half_life=1000)
    for _ in range(3000):
        est.observe(0.010)
    assert est.quantile(0.5) < 0.012
    for _ in range(3000):
        est.observe(0.100)
    assert 0.100 <= est.quantile(0.5) <= 0.11          # the old weight decayed away
    est.observe(1e-9)
    est.observe(1e9)                                    # out of range: clamped into the end buckets
    assert est.quantile(0.999999) > 100
    assert est.samples == 6002


def test_size_classes():
    assert size_class(1) == size_class(64 << 10) == "le64k"
    assert size_class((64 << 10) + 1) == "le256k"
    assert size_class(4 << 20) == "le4m" and size_class((4 << 20) + 1) == "gt4m"


# --- the race -----------------------------------------------------------------------------------

def test_no_hedge_before_enough_samples_or_when_disabled():
    metrics = Metrics()
    hedger = Hedger(HedgePolicy(min_samples=20), metrics)
    assert hedger.delay(LENGTH) is None
    for _ in range(19):
        hedger.observe(LENGTH, 0.01)
    assert hedger.delay(LENGTH) is None
    hedger.observe(LENGTH, 0.01)
    assert hedger.delay(LENGTH) == pytest.approx(0.05)        # the floor: p95 is ~11 ms
    assert hedger.delay(10 << 20) is None                     # another size class
    assert metrics.registry.get_sample_value("cachefs_hedge_delay_seconds", {"size_class": "le256k"}) == 0.05
    off = Hedger(HedgePolicy(budget=0.0), metrics)
    for _ in range(40):
        off.observe(LENGTH, 0.01)
    assert off.delay(LENGTH) is None


def test_a_slow_first_get_is_hedged_and_the_hedge_wins():
    metrics = Metrics()
    hedger = Hedger(HedgePolicy(), metrics)
    script = Script(lambda call_no, attempt: (5.0 if attempt == 0 else 0.010, None))

    async def main():
        await primed(hedger)
        for _ in range(20):                 # earn a budget token (0.05 per GET)
            await hedger.get(Script(lambda c, a: (0.010, None)).call(0), LENGTH, trio.CapacityLimiter(4))
        started = trio.current_time()
        data = await hedger.get(script.call(7), LENGTH, trio.CapacityLimiter(4))
        return data, trio.current_time() - started

    data, elapsed = run_virtual(main, hedger)
    assert data == b"data-7"
    assert elapsed == pytest.approx(0.05 + 0.010, abs=0.0021)     # hedge deadlines tick every 2 ms      # the delay, then one normal GET: not 5 s
    assert script.started == 2 and script.cancelled == 1
    assert hedges(metrics, "won") == 1 and hedges(metrics, "lost") == 0


def test_a_fast_answer_after_the_hedge_started_wins_and_cancels_the_hedge():
    metrics = Metrics()
    hedger = Hedger(HedgePolicy(), metrics)
    hedger._tokens = 5.0
    script = Script(lambda c, attempt: (0.070 if attempt == 0 else 1.0, None))

    async def main():
        await primed(hedger)
        started = trio.current_time()
        data = await hedger.get(script.call(1), LENGTH, trio.CapacityLimiter(4))
        return data, trio.current_time() - started

    data, elapsed = run_virtual(main, hedger)
    assert data == b"data-1" and elapsed == pytest.approx(0.070)
    assert script.cancelled == 1 and hedges(metrics, "lost") == 1


def test_fast_gets_are_never_hedged():
    metrics = Metrics()
    hedger = Hedger(HedgePolicy(), metrics)
    script = Script(lambda c, a: (0.001 + 0.0001 * (c % 30), None))

    async def main():
        limiter = trio.CapacityLimiter(4)
        for i in range(500):
            await hedger.get(script.call(i), LENGTH, limiter)

    run_virtual(main, hedger)
    assert script.started == 500 and script.cancelled == 0
    assert sum(hedges(metrics, r) for r in ("won", "lost", "failed")) == 0


def test_budget_holds_hedges_to_five_percent_over_1000_gets():
    metrics = Metrics()
    # p80 is a normal GET, so every straggler (10% of GETs) runs past the delay and wants a hedge
    hedger = Hedger(HedgePolicy(percentile=80, budget=0.05), metrics)
    rng = random.Random(3)
    slow = {i for i in range(1000) if rng.random() < 0.10}
    script = Script(lambda c, attempt: (1.0 if c in slow and attempt == 0 else 0.010, None))

    async def main():
        limiter = trio.CapacityLimiter(64)       # never saturated: ~10 stragglers at a time
        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(hedger.get, script.call(i), LENGTH, limiter)
                await trio.sleep(0.010)

    run_virtual(main, hedger)
    started_hedges = script.started - 1000
    assert started_hedges == sum(hedges(metrics, r) for r in ("won", "lost", "failed"))
    assert 40 <= started_hedges <= 50, started_hedges          # <= 5% of 1,000 GETs, and used
    assert skipped(metrics, "budget") > 0


def test_saved_tokens_cover_a_burst_of_stragglers_and_no_more():
    metrics = Metrics()
    hedger = Hedger(HedgePolicy(budget=0.05, burst=20), metrics)
    script = Script(lambda c, attempt: (2.0 if c >= 1000 and attempt == 0 else 0.010, None))

    async def main():
        limiter = trio.CapacityLimiter(64)
        for i in range(1000):                  # 50 tokens earned, 20 kept
            await hedger.get(script.call(i), LENGTH, limiter)
        async with trio.open_nursery() as nursery:
            for i in range(1000, 1030):         # then 30 stragglers at once
                nursery.start_soon(hedger.get, script.call(i), LENGTH, limiter)

    run_virtual(main, hedger)
    assert hedges(metrics, "won") == 20        # the saved tokens (the burst's own earnings hit the cap)
    assert skipped(metrics, "budget") == 10


def test_no_hedge_when_the_limiter_is_saturated_or_readers_wait():
    metrics = Metrics()
    hedger = Hedger(HedgePolicy(), metrics)
    hedger._tokens = 5.0
    script = Script(lambda c, attempt: (0.5, None))

    async def main():
        await primed(hedger)
        await hedger.get(script.call(0), LENGTH, trio.CapacityLimiter(1))     # the GET holds the only slot
        await hedger.get(script.call(1), LENGTH, trio.CapacityLimiter(4), busy=lambda: True)
        limiter = trio.CapacityLimiter(2)
        async with trio.open_nursery() as nursery:                            # a third GET waits for a slot
            for i in range(3):
                nursery.start_soon(hedger.get, script.call(2 + i), LENGTH, limiter)
        assert script.started == 6

    run_virtual(main, hedger)
    assert skipped(metrics, "busy") == 4
    # once the first two finished, the third GET had a free slot and no one waiting: hedged (and lost)
    assert hedges(metrics, "lost") == 1 and script.cancelled == 1


def test_no_hedge_when_the_trio_thread_wakes_up_late():
    metrics = Metrics()
    hedger = Hedger(HedgePolicy(), metrics)
    hedger._tokens = 5.0
    script = Script(lambda c, attempt: (0.5, None))
    clock = trio.testing.MockClock(autojump_threshold=0)

    async def hog() -> None:
        await trio.sleep(0.04)
        clock.jump(0.1)          # the thread was busy (no checkpoint) past the 50 ms hedge delay

    async def main():
        await primed(hedger)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hog)
            await hedger.get(script.call(0), LENGTH, trio.CapacityLimiter(4))
        await hedger.get(script.call(1), LENGTH, trio.CapacityLimiter(4))     # on time: hedged

    run_virtual(main, hedger, clock)
    assert skipped(metrics, "busy") == 1
    assert hedges(metrics, "lost") == 1


def test_first_fails_while_the_hedge_runs_the_hedge_answers():
    metrics = Metrics()
    hedger = Hedger(HedgePolicy(), metrics)
    hedger._tokens = 5.0
    script = Script(lambda c, attempt: (0.1, StoreError("reset")) if attempt == 0 else (0.2, None))

    async def main():
        await primed(hedger)
        return await hedger.get(script.call(4), LENGTH, trio.CapacityLimiter(4))

    assert run_virtual(main, hedger) == b"data-4"
    assert hedges(metrics, "won") == 1


def test_both_fail_the_first_error_surfaces():
    metrics = Metrics()
    hedger = Hedger(HedgePolicy(), metrics)
    hedger._tokens = 5.0
    first, second = StoreError("first"), StoreError("second")
    script = Script(lambda c, attempt: (0.2, first) if attempt == 0 else (0.01, second))

    async def main():
        await primed(hedger)
        await hedger.get(script.call(0), LENGTH, trio.CapacityLimiter(4))

    with pytest.raises(StoreError) as info:
        run_virtual(main, hedger)
    assert info.value is first
    assert hedges(metrics, "failed") == 1


def test_a_fast_failure_is_not_hedged():
    metrics = Metrics()
    hedger = Hedger(HedgePolicy(), metrics)
    hedger._tokens = 5.0
    script = Script(lambda c, attempt: (0.001, StoreError("denied")))

    async def main():
        await primed(hedger)
        await hedger.get(script.call(0), LENGTH, trio.CapacityLimiter(4))

    with pytest.raises(StoreError, match="denied"):
        run_virtual(main, hedger)
    assert script.started == 1


# --- the wiring in Tiers ------------------------------------------------------------------------

class SlowStore(ObjectStore):
    """An object store whose GETs are trio tasks of scripted duration (the first GET of ``slow_path``
    straggles); it records the limiter each GET was given."""

    identity, url = "fake|slow", "fake://slow"

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.gets: list[str] = []
        self.limiters: set[int] = set()
        self.slow_path = ""

    async def get_async(self, path, start, end, etag, size, *, limiter):
        straggles = path == self.slow_path and path not in self.gets
        self.gets.append(path)
        self.limiters.add(id(limiter))
        async with limiter:
            await trio.sleep(10.0 if straggles else 0.010)
        return self.data[start:end]

    def check(self): ...
    def list_dir(self, prefix): raise NotImplementedError
    def list_all(self, prefix=""): raise NotImplementedError
    def head(self, path): raise NotImplementedError
    def get(self, path, start, end, etag, size): raise NotImplementedError


def test_tiers_hedge_a_straggling_block_get():
    metrics = Metrics()
    data = random.Random(5).randbytes(LENGTH)
    store = SlowStore(data)
    assert cancellable_gets(store)
    tiers = Tiers(store, MemoryTier(16 << 20, metrics), None, metrics, block_size=1 << 20, readahead_size=0,
                  max_fetches=8, max_readaheads=2, hedger=Hedger(HedgePolicy(), metrics))
    store.slow_path = "f40"

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(tiers.run)
            for i in range(40):
                assert await tiers.read(FileVersion(f"f{i}", "e", LENGTH), 0, LENGTH) == data
            started = trio.current_time()
            got = await tiers.read(FileVersion("f40", "e", LENGTH), 1000, 5000)
            nursery.cancel_scope.cancel()
        return got, trio.current_time() - started

    got, elapsed = run_virtual(main)
    assert got == data[1000:6000]
    assert elapsed == pytest.approx(0.05 + 0.010, abs=0.0021)     # hedge deadlines tick every 2 ms
    assert store.gets.count("f40") == 2
    assert len(store.limiters) == 1 and id(tiers._fetch_limiter) not in store.limiters    # slots taken by Tiers
    assert tiers._fetch_limiter.borrowed_tokens == 0
    hedge = tiers.stats()["hedge"]
    assert hedge["won"] == 1 and hedge["delay_ms"] == {"le256k": 50.0}


def test_thread_backed_stores_and_a_zero_budget_are_not_hedged():
    class ThreadStore(SlowStore):
        get_async = ObjectStore.get_async

    metrics = Metrics()
    tiers = Tiers(ThreadStore(b""), MemoryTier(16 << 20, metrics), None, metrics, block_size=1 << 20,
                  readahead_size=0, max_fetches=8, max_readaheads=2, hedger=Hedger(HedgePolicy(), metrics))
    assert "hedge" not in tiers.stats()
    off = Tiers(SlowStore(b""), MemoryTier(16 << 20, metrics), None, metrics, block_size=1 << 20,
                readahead_size=0, max_fetches=8, max_readaheads=2, hedger=Hedger(HedgePolicy(budget=0), metrics))
    assert "hedge" not in off.stats()          # --hedge-budget 0: GETs go straight to the store


# --- the loser's connection -----------------------------------------------------------------------

def test_the_losing_get_closes_its_connection():
    """A real AsyncGetter against a loopback server whose first connection never answers: the
    hedge (second connection) wins, and the first connection is closed, not pooled."""
    state = {"connections": 0, "closed_by_client": trio.Event()}

    async def handler(stream: trio.SocketStream) -> None:
        state["connections"] += 1
        first = state["connections"] == 1
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some(65536)
        if first:                                  # a straggler: answer nothing, watch for the close
            while await stream.receive_some(65536):
                pass
            state["closed_by_client"].set()
            return
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nETag: \"e\"\r\n\r\nhello")
        while await stream.receive_some(65536):     # keep-alive until the client lets go
            pass

    async def main():
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            getter = AsyncGetter(f"http://127.0.0.1:{port}", "us-east-1", Credentials("AK", "SK"),
                                 max_idle=4, connect_timeout=2, read_timeout=5)
            hedger = Hedger(HedgePolicy(), Metrics())
            hedger._tokens = 5.0
            await primed(hedger)
            await nursery.start(hedger.run)

            async def call() -> bytes:
                return (await getter.get("bucket", "key", {}))[1]

            with trio.fail_after(3):
                assert await hedger.get(call, LENGTH, trio.CapacityLimiter(4)) == b"hello"
                await state["closed_by_client"].wait()
            assert len(getter._idle) == 1              # only the winner's connection is pooled
            assert state["connections"] == 2
            getter.close()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_finished_gets_leave_no_data_behind_in_the_deadline_heap():
    metrics = Metrics()
    hedger = Hedger(HedgePolicy(), metrics)
    script = Script(lambda c, attempt: (0.001, None))

    async def main():
        await primed(hedger)
        for i in range(10):
            await hedger.get(script.call(i), LENGTH, trio.CapacityLimiter(4))
        pending = [flight for _, _, flight in hedger._pending]
        assert len(pending) == 10 and all(f.value == b"" and f.done for f in pending)
        await trio.sleep(0.1)
        assert hedger._pending == []                 # popped once due

    run_virtual(main, hedger)


def test_hedge_options_are_validated():
    from cachefs.config import build_config
    from cachefs.errors import ConfigError
    base = {"url": "s3://b", "mountpoint": "/mnt/x"}
    cfg = build_config({**base, "hedge_percentile": "90", "hedge_budget": "0", "hedge_min_delay": "0.2"})
    assert (cfg.hedge_percentile, cfg.hedge_budget, cfg.hedge_min_delay) == (90.0, 0.0, 0.2)
    for bad in ({"hedge_percentile": 100}, {"hedge_percentile": 10}, {"hedge_budget": 1.5},
                {"hedge_budget": -0.1}, {"hedge_min_delay": -1}):
        with pytest.raises(ConfigError, match="hedge_"):
            build_config({**base, **bad})
