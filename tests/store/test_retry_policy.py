"""RetryPolicy (cachefs/store/retry.py): a restarting server is ridden out for a window of seconds,
a server's Retry-After is honoured, and nothing waits past the window."""

import types

import pytest

from cachefs.store import retry
from cachefs.store.retry import REFUSAL_MAX_DELAY, RetryPolicy, call_with_retries


class Refused(ConnectionError):
    pass


class SlowDown(Exception):
    def __init__(self, wait: float) -> None:
        super().__init__(f"503, Retry-After {wait}")
        self.wait = wait


class Broken(Exception):
    pass


def policy(**kwargs) -> RetryPolicy:
    return RetryPolicy(lambda exc: isinstance(exc, (Refused, SlowDown, Broken)), kwargs.pop("max_attempts", 4),
                       is_refusal=lambda exc: isinstance(exc, Refused),
                       retry_after=lambda exc: getattr(exc, "wait", None), **kwargs)


@pytest.fixture
def clock(monkeypatch):
    """A fake clock: sleeps advance it and are recorded."""
    state = types.SimpleNamespace(now=0.0, slept=[])

    def sleep(seconds: float) -> None:
        state.slept.append(seconds)
        state.now += seconds
    monkeypatch.setattr(retry, "time", types.SimpleNamespace(monotonic=lambda: state.now, sleep=sleep))
    return state


def down_until(clock, until: float):
    """A server that refuses connections until ``until`` seconds, then answers "ok"."""
    calls = []

    def fn():
        calls.append(clock.now)
        if clock.now < until:
            raise Refused("connection refused")
        return "ok"
    return fn, calls


def test_a_restart_longer_than_the_attempts_is_ridden_out_within_the_window(clock):
    fn, calls = down_until(clock, 1.0)                        # a 1 s restart
    assert call_with_retries(fn, op="get", policy=policy(window=2.0)) == "ok"
    assert len(calls) > 4                                     # more than max_attempts
    assert all(s <= REFUSAL_MAX_DELAY for s in clock.slept)   # backoff capped: back soon after the server
    assert clock.now < 1.0 + REFUSAL_MAX_DELAY + 1e-9


def test_a_server_that_stays_down_fails_once_the_window_is_spent(clock):
    fn, calls = down_until(clock, float("inf"))
    with pytest.raises(Refused):
        call_with_retries(fn, op="get", policy=policy(window=2.0))
    assert 2.0 <= calls[-1] < 2.0 + REFUSAL_MAX_DELAY + 1e-9  # the last try starts at most one backoff late


def test_without_a_window_refusals_count_attempts_as_before(clock):
    fn, calls = down_until(clock, float("inf"))
    with pytest.raises(Refused):
        call_with_retries(fn, op="get", policy=policy(window=0.0))
    assert len(calls) == 4


def test_other_errors_are_not_given_the_window(clock):
    errors = iter([Broken("500")] * 10)

    def fn():
        raise next(errors)
    with pytest.raises(Broken):
        call_with_retries(fn, op="get", policy=policy(window=30.0))
    assert len(clock.slept) == 3                              # 4 attempts, 3 sleeps


def test_retry_after_is_waited_for_at_most_the_window(clock):
    answers = iter([SlowDown(1.0), SlowDown(60.0), "ok"])

    def fn():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer
    assert call_with_retries(fn, op="get", policy=policy(window=2.0)) == "ok"
    assert clock.slept[0] >= 1.0                              # asked 1 s: waited at least that
    assert clock.slept[1] == 2.0                              # asked 60 s: the window caps it
