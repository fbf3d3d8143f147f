"""The one place transient failures are retried: full-jitter exponential backoff.

The caller says which exceptions are transient (``is_temp_failure``, asked of
the backend, as in S3QL); everything else propagates at once. Retries are
logged at DEBUG for the first two and INFO after, never WARNING: a failure
that outlives its retries is the caller's to report, once, with context.

Two refinements for a server that restarts or sheds load:

- a refused or reset connection (``is_refusal``) is retried for ``window``
  seconds from the first attempt even when the attempts have run out, with
  backoff capped at ``REFUSAL_MAX_DELAY``: a restart of a second or two is
  ridden out, a server that stays down still fails after ``window``;
- a server that says how long to wait (``retry_after``, e.g. 503 SlowDown with
  ``Retry-After``) is waited for at least that long, at most ``window`` (or
  ``max_delay`` without a window).
"""

import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import trio

from cachefs.metrics import Metrics
from cachefs.store.metrics import StoreMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")

_QUIET_RETRIES = 2        # retries logged at DEBUG before escalating to INFO
REFUSAL_MAX_DELAY = 0.5   # seconds: a restarted server is tried again this soon after it is back


def backoff_delay(retry: int, base_delay: float, max_delay: float) -> float:
    """Seconds to sleep before retry number ``retry`` (1-based): uniform in [0, cap]."""
    cap = min(max_delay, base_delay * (2 ** (retry - 1)))
    return random.uniform(0.0, cap)


def _never(exc: BaseException) -> bool:
    return False


def _no_hint(exc: BaseException) -> float | None:
    return None


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    is_temp_failure: Callable[[BaseException], bool]
    max_attempts: int
    base_delay: float = 0.05
    max_delay: float = 5.0
    window: float = 0.0                                          # seconds refusals are retried
    is_refusal: Callable[[BaseException], bool] = _never          # a refused/reset connection
    retry_after: Callable[[BaseException], float | None] = _no_hint   # the server's asked wait

    def delay(self, attempt: int, elapsed: float, exc: BaseException) -> float | None:
        """Seconds to sleep before attempt ``attempt + 1`` after ``exc``, ``elapsed`` seconds after
        the first attempt started; None to give up (re-raise ``exc``)."""
        if not self.is_temp_failure(exc):
            return None
        refusal = self.is_refusal(exc)
        if attempt >= self.max_attempts and not (refusal and elapsed < self.window):
            return None
        if refusal:
            return backoff_delay(attempt, self.base_delay, min(self.max_delay, REFUSAL_MAX_DELAY))
        sleep = backoff_delay(attempt, self.base_delay, self.max_delay)
        asked = self.retry_after(exc)
        if asked is not None and asked > 0:
            sleep = max(sleep, min(asked, self.window or self.max_delay))
        return sleep


def call_with_retries(fn: Callable[[], T], *, op: str, is_temp_failure: Callable[[BaseException], bool] = _never,
                      max_attempts: int = 1, metrics: Metrics | None = None,
                      base_delay: float = 0.05, max_delay: float = 5.0, policy: RetryPolicy | None = None) -> T:
    """Call ``fn()`` up to ``max_attempts`` times while it fails transiently (or as ``policy``, when
    given, says: then its fields replace the other arguments).

    Returns its result, or re-raises the first non-transient error, or the last
    transient one when attempts run out.
    """
    policy = policy or RetryPolicy(is_temp_failure, max_attempts, base_delay, max_delay)
    attempt, started = 1, time.monotonic()
    while True:
        try:
            return fn()
        except Exception as exc:
            sleep = policy.delay(attempt, time.monotonic() - started, exc)
            if sleep is None:
                raise
            _note_retry(op, attempt, policy.max_attempts, exc, metrics)
        time.sleep(sleep)
        attempt += 1


async def call_with_retries_async(fn: Callable[[], Awaitable[T]], *, op: str,
                                  is_temp_failure: Callable[[BaseException], bool] = _never, max_attempts: int = 1,
                                  metrics: Metrics | None = None, base_delay: float = 0.05,
                                  max_delay: float = 5.0, policy: RetryPolicy | None = None) -> T:
    """``call_with_retries`` for a coroutine function: the same policy, trio sleeps."""
    policy = policy or RetryPolicy(is_temp_failure, max_attempts, base_delay, max_delay)
    attempt, started = 1, time.monotonic()
    while True:
        try:
            return await fn()
        except Exception as exc:
            sleep = policy.delay(attempt, time.monotonic() - started, exc)
            if sleep is None:
                raise
            _note_retry(op, attempt, policy.max_attempts, exc, metrics)
        await trio.sleep(sleep)
        attempt += 1


def _note_retry(op: str, attempt: int, max_attempts: int, exc: BaseException, metrics: Metrics | None) -> None:
    if metrics is not None:
        metrics.group(StoreMetrics).store_retries.labels(op).inc()
    level = logging.DEBUG if attempt <= _QUIET_RETRIES else logging.INFO
    log.log(level, "%s: attempt %d of %d failed (%s: %s), retrying", op, attempt, max_attempts,
            type(exc).__name__, exc)
