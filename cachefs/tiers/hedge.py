"""Hedged GETs (DESIGN §4 "Stragglers"): a GET still unanswered after a latency percentile of
its size class gets a second, identical GET on another connection; the first answer wins and
the other is cancelled.

* ``LatencyEstimator``: a rolling quantile of successful GET latencies in bounded memory: a
  histogram over log-spaced buckets (10% wide, 0.1 ms to ~3 min) whose counts are halved every
  ``half_life`` observations, so it follows a store that speeds up or slows down.
* ``Hedger.get(call, length, limiter)``: runs ``call`` (one GET, If-Match pinned: both
  attempts return the same version or fail the same way) under a slot of ``limiter``; after
  ``max(min_delay, quantile(percentile))`` it may start the same call again, under a second
  slot. A hedge costs one token of a bucket that earns ``budget`` per GET (so hedges stay
  under that fraction of GETs) and is never started while the limiter is saturated, readers
  wait, or the trio thread wakes up late for it (a hedge under overload adds load where it
  hurts). If the first attempt fails while the hedge runs, the hedge may still win; if both
  fail, the first one's error is raised. Retries stay in the store layer.

The loser is cancelled inside a trio cancel scope: the S3 client (``store/s3/http.py``) closes
a connection interrupted in any way, so no half-read connection goes back to its pool. Stores
whose GETs run in worker threads cannot be cancelled (trio waits for the thread): they are
never hedged (``cancellable_gets``).
"""

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from cachefs.metrics import Metrics
from cachefs.store import ObjectStore

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


def size_class(length: int) -> str:
    for limit, name in SIZE_CLASSES:
        if length <= limit:
            return name
    return _LARGEST


def cancellable_gets(store: ObjectStore) -> bool:
    """Whether ``store.get_async`` is a trio task a cancel scope stops at once (not a thread)."""
    if type(store).get_async is ObjectStore.get_async:
        return False
    # S3Store falls back to the thread path when its trio client is unusable (see s3/store.py)
    return getattr(store, "_async_getter", True) is not None


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


class _Race:
    """Two attempts at one GET; the first success wins and cancels the other."""

    __slots__ = ("value", "winner", "errors", "running", "done", "scope")

    def __init__(self, scope: trio.CancelScope) -> None:
        self.value: bytes | None = None
        self.winner: int | None = None
        self.errors: list[Exception | None] = [None, None]
        self.running = 0
        self.done = trio.Event()
        self.scope = scope

    async def attempt(self, index: int, call: Callable[[], Awaitable[bytes]],
                      release: Callable[[], None] | None = None) -> None:
        self.running += 1
        try:
            value = await call()
        except Exception as exc:
            self.errors[index] = exc
        else:
            if self.winner is None:
                self.winner, self.value = index, value
                self.scope.cancel()         # the other attempt, and the wait for the hedge delay
        finally:
            self.running -= 1
            if release is not None:
                release()
            if self.winner is not None or self.running == 0:
                self.done.set()


class Hedger:
    """The hedging policy of one daemon's GETs (owned by the trio thread, like ``Tiers``)."""

    def __init__(self, policy: HedgePolicy, metrics: Metrics) -> None:
        self.policy = policy
        self.metrics = metrics
        self._estimators: dict[str, LatencyEstimator] = {}
        self._delays: dict[str, float] = {}      # per size class, refreshed as GETs are observed
        self._tokens = 0.0

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
        async with limiter:
            started = trio.current_time()
            delay = self.delay(length)
            if delay is None:
                data = await call()
            else:
                data = await self._race(call, delay, limiter, busy)
            self.observe(length, trio.current_time() - started)
            return data

    async def _race(self, call: Callable[[], Awaitable[bytes]], delay: float, limiter: trio.CapacityLimiter,
                    busy: Callable[[], bool]) -> bytes:
        hedged = False
        async with trio.open_nursery() as nursery:
            race = _Race(nursery.cancel_scope)
            nursery.start_soon(race.attempt, 0, call)
            deadline = trio.current_time() + delay
            with trio.move_on_at(deadline):
                await race.done.wait()
            if not race.done.is_set():
                late = trio.current_time() - deadline > max(_LATE_S, delay / 2)
                release = self._take_slot(limiter, lambda: late or busy())
                if release is not None:
                    hedged = True
                    nursery.start_soon(race.attempt, 1, call, release)
        if hedged:
            result = "won" if race.winner == 1 else "lost" if race.winner == 0 else "failed"
            self.metrics.hedged_requests.labels(result).inc()
        if race.winner is None:
            raise race.errors[0] or race.errors[1]
        return race.value

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
            return int(self.metrics.counter_value(name, **labels))
        out = {result: count("cachefs_hedged_requests_total", result=result) for result in ("won", "lost", "failed")}
        out.update({f"skipped_{reason}": count("cachefs_hedges_skipped_total", reason=reason)
                    for reason in ("budget", "busy")})
        out["delay_ms"] = {cls: round(d * 1000, 1) for cls, d in sorted(self._delays.items())}
        return out
