import logging

import pytest

from cachefs.metrics import Metrics
from cachefs.store import retry
from cachefs.store.retry import backoff_delay, call_with_retries


class Transient(Exception):
    pass


class Permanent(Exception):
    pass


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, Transient)


class Flaky:
    """Fails with the given errors in turn, then returns "ok"."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(retry.time, "sleep", slept.append)
    return slept


def test_success_after_transient_failures_counts_retries():
    metrics = Metrics()
    fn = Flaky(Transient("a"), Transient("b"))
    assert call_with_retries(fn, op="get", is_temp_failure=is_transient, max_attempts=5, metrics=metrics) == "ok"
    assert fn.calls == 3
    assert metrics.counter_value("cachefs_store_retries_total", op="get") == 2


def test_gives_up_after_max_attempts_with_last_error():
    fn = Flaky(*(Transient(str(i)) for i in range(10)))
    with pytest.raises(Transient, match="^2$"):
        call_with_retries(fn, op="get", is_temp_failure=is_transient, max_attempts=3)
    assert fn.calls == 3


def test_permanent_error_is_not_retried():
    metrics = Metrics()
    fn = Flaky(Permanent("no"))
    with pytest.raises(Permanent):
        call_with_retries(fn, op="head", is_temp_failure=is_transient, max_attempts=5, metrics=metrics)
    assert fn.calls == 1
    assert metrics.counter_value("cachefs_store_retries_total", op="head") == 0


def test_single_attempt_means_no_retry():
    fn = Flaky(Transient("x"))
    with pytest.raises(Transient):
        call_with_retries(fn, op="get", is_temp_failure=is_transient, max_attempts=1)
    assert fn.calls == 1


def test_sleeps_are_jittered_and_bounded(no_sleep):
    fn = Flaky(*(Transient("x") for _ in range(7)))
    call_with_retries(fn, op="get", is_temp_failure=is_transient, max_attempts=8, base_delay=0.1, max_delay=0.5)
    caps = [0.1, 0.2, 0.4, 0.5, 0.5, 0.5, 0.5]
    assert len(no_sleep) == 7
    assert all(0.0 <= slept <= cap for slept, cap in zip(no_sleep, caps, strict=False))


def test_backoff_delay_is_full_jitter():
    samples = [backoff_delay(4, base_delay=0.05, max_delay=5.0) for _ in range(2000)]
    assert max(samples) <= 0.4
    assert min(samples) < 0.05 and max(samples) > 0.35   # spread over [0, cap], not a fixed delay
    assert all(backoff_delay(30, 0.05, 2.0) <= 2.0 for _ in range(100))


def test_retries_log_debug_then_info_never_warning(caplog):
    caplog.set_level(logging.DEBUG, logger="cachefs.store.retry")
    fn = Flaky(*(Transient("x") for _ in range(4)))
    call_with_retries(fn, op="get", is_temp_failure=is_transient, max_attempts=5)
    levels = [r.levelno for r in caplog.records if r.name == "cachefs.store.retry"]
    assert levels == [logging.DEBUG, logging.DEBUG, logging.INFO, logging.INFO]
