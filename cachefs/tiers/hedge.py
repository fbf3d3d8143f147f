"""Hedged GETs (docs/design.md, components): a GET still unanswered after a latency percentile of
its size class gets a second, identical GET on another connection; the first answer wins and
the other is cancelled.

* ``LatencyEstimator``: a rolling quantile of successful GET latencies in bounded memory: a
  histogram over log-spaced buckets (10% wide, 0.1 ms to ~4 min) whose counts are halved every
  ``half_life`` observations, so it follows a store that speeds up or slows down.
* ``Hedger.get(call, length, limiter)``: runs ``call`` (one GET, If-Match pinned: both
  attempts return the same version or fail the same way) under a slot of ``limiter``; after
  ``max(min_delay, quantile(percentile))`` it may start the same call again, under a second
  slot. A hedge costs one token of a bucket that earns ``budget`` per GET (so hedges stay
  under that fraction of GETs) and is never started while the limiter is saturated, readers
  wait, or the trio thread wakes up late for it (a hedge under overload adds load where it
  hurts). If the first attempt fails while the hedge runs, the hedge may still win; if both
  fail, the first one's error is raised. Retries stay in the store layer.

Cost: the first attempt runs in the caller's task inside a cancel scope, and its deadline goes
into a heap served by one clock task (``Hedger.run``, deadlines rounded to 2 ms ticks), which
starts the hedges in its own nursery. A nursery and a task per GET cost ~5x more CPU
(measured: +240 vs +46 us per GET on this loaded 2-CPU VM, against ~250 us of client CPU per GET).

The loser is cancelled inside a trio cancel scope: the S3 client (``store/s3/http.py``) closes
a connection interrupted in any way, so no half-read connection goes back to its pool. Stores
whose GETs run in worker threads cannot be cancelled (trio waits for the thread): they are
never hedged (``cancellable_gets``).
"""

import heapq
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from cachefs.errors import StoreError
from cachefs.metrics import Metrics
from cachefs.sched import held
from cachefs.store import ObjectStore
from cachefs.tiers.metrics import TierMetrics

_BASE_S = 1e-4          # lower edge of the first bucket
_GROWTH = 1.1           # each bucket 10% wider than the one before
_BUCKETS = 160          # up to 0.1 ms * 1.1**160 = ~4 min
_LOG_GROWTH = math.log(_GROWTH)
# Size classes by requested bytes: a small object and a full 4 MiB block differ in latency.
SIZE_CLASSES = ((64 << 10, "le64k"), (256 << 10, "le256k"), (1 << 20, "le1m"), (4 << 20, "le4m"))
_LARGEST = "gt4m"
_REFRESH = 10           # GETs between two updates of a size class's hedge delay
# The trio thread woke this late for the hedge: it is overloaded (or starved of CPU), and the
# first GET's answer may be waiting unread in its socket; a second GET would only add load.
_LATE_S = 0.025
_TICK_S = 0.002         # hedge deadlines are rounded up to this: the clock wakes once per tick at most


def size_class(length: int) -> str:
    for limit, name in SIZE_CLASSES:
        if length <= limit:
            return name
    return _LARGEST


def cancellable_gets(store: ObjectStore) -> bool:
    """Whether ``store.get_async`` is a trio task a cancel scope stops at once (not a thread);
    S3Store says no when it falls back to the thread path (see s3/store.py)."""
    return store.cancellable_gets


class LatencyEstimator:
    """A decaying log-bucket histogram of latencies; ``quantile(q)`` is an upper bucket edge
    (at most 10% above the true value)."""

    __slots__ = ("_counts", "_total", "_seen", "half_life")

    def __init__(self, half_life: int = 1000) -> None:
        self._counts = [0.0] * _BUCKETS
        self._total = 0.0
        self._seen = 0
        self.half_life = half_life

    @property
    def samples(self) -> int:
        """Observations so far (not decayed)."""
        return self._seen

    def observe(self, seconds: float) -> None:
        self._counts[_bucket(seconds)] += 1.0
        self._total += 1.0
        self._seen += 1
        if self._seen % self.half_life == 0:
            self._counts = [c * 0.5 for c in self._counts]
            self._total *= 0.5

    def quantile(self, q: float) -> float | None:
        """The latency below which a fraction ``q`` of the (weighted) observations fall."""
        if self._total <= 0:
            return None
        want, seen = q * self._total, 0.0
        for index, count in enumerate(self._counts):
            seen += count
            if seen >= want and count:
                return _upper_edge(index)
        return _upper_edge(_BUCKETS - 1)


def _bucket(seconds: float) -> int:
    if seconds <= _BASE_S:
        return 0
    return min(_BUCKETS - 1, int(math.log(seconds / _BASE_S) / _LOG_GROWTH))


def _upper_edge(index: int) -> float:
    return _BASE_S * _GROWTH ** (index + 1)


@dataclass(frozen=True, slots=True)
class HedgePolicy:
    percentile: float = 95.0    # hedge a GET slower than this percentile of its size class
    budget: float = 0.05        # most hedges per GET (long-run); 0 disables hedging
    min_delay: float = 0.05     # never hedge earlier than this (seconds)
    min_samples: int = 20       # a size class hedges only once it has seen this many GETs
    # Tokens saved up for a burst of stragglers (a stall of the store or of this node makes
    # several GETs straggle at once). The bucket starts empty, so hedges never exceed
    # ``budget`` x GETs so far, whatever the burst.
    burst: float = 20.0

    @property
    def enabled(self) -> bool:
        return self.budget > 0


class _Flight:
    """One hedgeable GET: its first attempt runs in the caller's task inside ``scope``; the
    clock may start a second one (``hedge_scope``) in the hedger's nursery. The first success
    wins and cancels the other scope."""

    __slots__ = ("call", "limiter", "busy", "delay", "scope", "hedge_scope", "done", "hedging", "winner",
                 "value", "errors", "settled")

    def __init__(self, call: Callable[[], Awaitable[bytes]], limiter: trio.CapacityLimiter,
                 busy: Callable[[], bool], delay: float) -> None:
        self.call, self.limiter, self.busy, self.delay = call, limiter, busy, delay
        self.scope = trio.CancelScope()
        self.hedge_scope: trio.CancelScope | None = None
        self.done = False             # the first attempt has ended (a pending timer is then void)
        self.hedging = False          # a second attempt is running
        self.winner: int | None = None
        self.value = b""
        self.errors: list[Exception | None] = [None, None]
        self.settled: trio.Event | None = None    # set when the hedge ends, if the first waits for it

    def win(self, index: int, value: bytes) -> None:
        if self.winner is None:
            self.winner, self.value = index, value
            other = self.scope if index == 1 else self.hedge_scope
            if other is not None and (index == 1 or self.hedging):
                other.cancel()


class Hedger:
    """The hedging policy of one daemon's GETs (owned by the trio thread, like ``Tiers``)."""

    def __init__(self, policy: HedgePolicy, metrics: Metrics) -> None:
        self.policy = policy
        self._registry = metrics
        self.metrics = metrics.group(TierMetrics)
        self._estimators: dict[str, LatencyEstimator] = {}
        self._delays: dict[str, float] = {}      # per size class, refreshed as GETs are observed
        self._tokens = 0.0
        self._pending: list[tuple[float, int, _Flight]] = []     # (deadline, seq, flight): a heap
        self._seq = 0
        self._clock: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None

    def delay(self, length: int) -> float | None:
        """Seconds after which a GET of ``length`` bytes is hedged; None: not (yet) hedged."""
        return self._delays.get(size_class(length)) if self.policy.enabled else None

    def observe(self, length: int, seconds: float) -> None:
        """Count one successful GET's latency; every ``_REFRESH`` of them, update its class's delay."""
        cls = size_class(length)
        estimator = self._estimators.get(cls)
        if estimator is None:
            estimator = self._estimators[cls] = LatencyEstimator()
        estimator.observe(seconds)
        if estimator.samples >= self.policy.min_samples and estimator.samples % _REFRESH == 0:
            delay = max(self.policy.min_delay, estimator.quantile(self.policy.percentile / 100.0))
            self._delays[cls] = delay
            self.metrics.hedge_delay.labels(cls).set(delay)

    async def get(self, call: Callable[[], Awaitable[bytes]], length: int, limiter: trio.CapacityLimiter,
                  busy: Callable[[], bool] = lambda: False) -> bytes:
        """``call()`` under a slot of ``limiter``, hedged once if it runs past ``delay(length)``
        and the budget, ``limiter`` and ``busy()`` allow."""
        self._tokens = min(self.policy.burst, self._tokens + self.policy.budget)
        async with held(limiter):
            started = trio.current_time()
            delay = self.delay(length)
            if delay is None or self._nursery is None:
                data = await call()
            else:
                data = await self._first(call, delay, limiter, busy)
            self.observe(length, trio.current_time() - started)
            return data

    async def _first(self, call: Callable[[], Awaitable[bytes]], delay: float, limiter: trio.CapacityLimiter,
                     busy: Callable[[], bool]) -> bytes:
        """The first attempt, in this task; the clock (``run``) may start a hedge at its deadline."""
        flight = _Flight(call, limiter, busy, delay)
        self._schedule(flight, trio.current_time() + delay)
        try:
            with flight.scope:
                flight.win(0, await call())
        except Exception as exc:
            flight.errors[0] = exc
        finally:
            flight.done = True
        if flight.winner is None and flight.hedging:          # failed: the hedge may still answer
            flight.settled = trio.Event()
            await flight.settled.wait()
        if flight.winner is None:
            raise flight.errors[0] or flight.errors[1] or StoreError("hedged GET ended without an answer")
        value, flight.value = flight.value, b""      # the heap keeps the flight until its deadline
        return value

    def _schedule(self, flight: _Flight, deadline: float) -> None:
        deadline = math.ceil(deadline / _TICK_S) * _TICK_S        # one clock wake-up serves a tick
        self._seq += 1
        heapq.heappush(self._pending, (deadline, self._seq, flight))
        if self._clock is not None and deadline < self._clock.deadline:
            self._clock.deadline = deadline

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The clock that starts hedges at their deadlines, and the nursery they run in, until
        cancelled. Without it running, GETs are not hedged."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                while True:
                    with trio.CancelScope(deadline=self._pending[0][0] if self._pending else math.inf) as clock:
                        self._clock = clock
                        await trio.sleep_forever()
                    self._clock = None
                    self._fire(trio.current_time())
            finally:
                self._nursery = self._clock = None

    def _fire(self, now: float) -> None:
        while self._pending and self._pending[0][0] <= now:
            deadline, _, flight = heapq.heappop(self._pending)
            if flight.done:
                continue
            late = now - deadline > max(_LATE_S, flight.delay / 2)
            release = self._take_slot(flight.limiter, lambda f=flight, late=late: late or f.busy())
            if release is not None:
                flight.hedging = True
                flight.hedge_scope = trio.CancelScope()
                self._nursery.start_soon(self._hedge, flight, release)

    async def _hedge(self, flight: _Flight, release: Callable[[], None]) -> None:
        try:
            with flight.hedge_scope:
                flight.win(1, await flight.call())
        except Exception as exc:
            flight.errors[1] = exc
        finally:
            release()
            flight.hedging = False
            result = ("won" if flight.winner == 1 else "lost" if flight.winner == 0
                      else "failed" if flight.errors[1] is not None else "cancelled")
            self.metrics.hedged_requests.labels(result).inc()
            if flight.settled is not None:
                flight.settled.set()

    def _take_slot(self, limiter: trio.CapacityLimiter, busy: Callable[[], bool]) -> Callable[[], None] | None:
        """A second slot of ``limiter`` and a budget token for a hedge (its release), or None."""
        if self._tokens < 1.0:
            self.metrics.hedges_skipped.labels("budget").inc()
            return None
        token = object()
        if busy() or limiter.statistics().tasks_waiting:
            self.metrics.hedges_skipped.labels("busy").inc()
            return None
        try:
            limiter.acquire_on_behalf_of_nowait(token)
        except trio.WouldBlock:
            self.metrics.hedges_skipped.labels("busy").inc()
            return None
        self._tokens -= 1.0
        return lambda: limiter.release_on_behalf_of(token)

    def stats(self) -> dict:
        """Hedges by result, skipped ones by reason, and each size class's current delay (ms)."""
        def count(name: str, **labels: str) -> int:
            return int(self._registry.counter_value(name, **labels))
        out = {result: count("cachefs_hedged_requests_total", result=result) for result in ("won", "lost", "failed", "cancelled")}
        out.update({f"skipped_{reason}": count("cachefs_hedges_skipped_total", reason=reason)
                    for reason in ("budget", "busy")})
        out["delay_ms"] = {cls: round(d * 1000, 1) for cls, d in sorted(self._delays.items())}
        return out
