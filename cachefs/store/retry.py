"""The one place transient failures are retried: full-jitter exponential backoff.

The caller says which exceptions are transient (``is_temp_failure``, asked of
the backend, as in S3QL); everything else propagates at once. Retries are
logged at DEBUG for the first two and INFO after, never WARNING: a failure
that outlives its retries is the caller's to report, once, with context.
"""

import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from cachefs.metrics import Metrics

log = logging.getLogger(__name__)

T = TypeVar("T")

_QUIET_RETRIES = 2   # retries logged at DEBUG before escalating to INFO


def backoff_delay(retry: int, base_delay: float, max_delay: float) -> float:
    """Seconds to sleep before retry number ``retry`` (1-based): uniform in [0, cap]."""
    cap = min(max_delay, base_delay * (2 ** (retry - 1)))
    return random.uniform(0.0, cap)


def call_with_retries(fn: Callable[[], T], *, op: str, is_temp_failure: Callable[[BaseException], bool],
                      max_attempts: int, metrics: Metrics | None = None,
                      base_delay: float = 0.05, max_delay: float = 5.0) -> T:
    """Call ``fn()`` up to ``max_attempts`` times while it fails transiently.

    Returns its result, or re-raises the first non-transient error, or the last
    transient one when attempts run out.
    """
    attempt = 1
    while True:
        try:
            return fn()
        except Exception as exc:
            if attempt >= max_attempts or not is_temp_failure(exc):
                raise
            _note_retry(op, attempt, max_attempts, exc, metrics)
        time.sleep(backoff_delay(attempt, base_delay, max_delay))
        attempt += 1


async def call_with_retries_async(fn: Callable[[], Awaitable[T]], *, op: str,
                                  is_temp_failure: Callable[[BaseException], bool], max_attempts: int,
                                  metrics: Metrics | None = None, base_delay: float = 0.05,
                                  max_delay: float = 5.0) -> T:
    """``call_with_retries`` for a coroutine function: the same policy, trio sleeps."""
    attempt = 1
    while True:
        try:
            return await fn()
        except Exception as exc:
            if attempt >= max_attempts or not is_temp_failure(exc):
                raise
            _note_retry(op, attempt, max_attempts, exc, metrics)
        await trio.sleep(backoff_delay(attempt, base_delay, max_delay))
        attempt += 1


def _note_retry(op: str, attempt: int, max_attempts: int, exc: BaseException, metrics: Metrics | None) -> None:
    if metrics is not None:
        metrics.store_retries.labels(op).inc()
    level = logging.DEBUG if attempt <= _QUIET_RETRIES else logging.INFO
    log.log(level, "%s: attempt %d of %d failed (%s: %s), retrying", op, attempt, max_attempts,
            type(exc).__name__, exc)
