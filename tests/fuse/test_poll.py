"""The request loop's adaptive poll (``cachefs/fuse/poll.py``) on a pipe: how long it polls, how it
learns, and that it gives its CPU to a thread that needs it."""

import os
import subprocess
import sys
import time

import pytest

from cachefs.fuse import poll as poll_module
from cachefs.fuse.poll import Poll

CEILING = 2.0 ** -10          # ~977 us: halving and doubling stay exact


@pytest.fixture
def free_cpus(monkeypatch):
    """Whatever else runs on the machine (a test's own subject is the rule that no poll starts
    while every CPU is busy: ``test_no_poll_starts_while_every_cpu_has_a_thread_to_run``)."""
    monkeypatch.setattr(poll_module, "_busy", lambda cpus: False)


@pytest.fixture
def alone(free_cpus, monkeypatch):
    """... and never switched out (a kernel thread may take the CPU for a moment: the poll would
    end early, rightly, but these tests are about something else)."""
    monkeypatch.setattr(poll_module, "_switches", lambda: 0)


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    os.close(r)
    os.close(w)


def test_the_window_grows_while_requests_come_within_the_ceiling_and_stops_when_they_do_not(pipe):
    poll = Poll(pipe[0], CEILING)
    assert poll.window == CEILING / 4
    poll.slept(CEILING / 2)                  # a longer poll would have caught it
    assert poll.window == CEILING / 2
    poll.slept(CEILING)
    poll.slept(CEILING)                      # (at the ceiling it stays)
    assert (poll.window, poll.grown) == (CEILING, 2)
    for expected in (CEILING / 2, CEILING / 4, CEILING / 8, CEILING / 16, 0.0):
        poll.slept(CEILING * 3)              # it would have run out: wasted
        assert poll.window == expected
    poll.slept(CEILING * 3)
    assert poll.shrunk == 5                  # (off, nothing more to halve)
    assert poll() is False and poll.found == 0      # off: no poll at all
    poll.slept(CEILING / 8)                  # a request soon after the loop slept: polling again
    assert poll.window == CEILING / 16


def test_a_poll_runs_for_its_window_and_finds_a_request_that_is_there(pipe, alone):
    r, w = pipe
    poll = Poll(r, 0.008)                    # a first window of 2 ms
    began = time.monotonic()
    assert poll() is False
    took = time.monotonic() - began
    assert 0.002 <= took < 0.5, took
    os.write(w, b"x")
    assert poll() is True and poll.found == 1


def spinners(cpus) -> list[subprocess.Popen]:
    """One process spinning on each of ``cpus`` (for at most 10 s), started once they all spin."""
    procs = [subprocess.Popen([sys.executable, "-c", (
        "import os, time\n"
        f"os.sched_setaffinity(0, {{{cpu}}})\n"
        "print('spinning', flush=True)\n"
        "end = time.monotonic() + 10\n"
        "while time.monotonic() < end: pass\n")], stdout=subprocess.PIPE, text=True) for cpu in cpus]
    for proc in procs:
        assert proc.stdout.readline() == "spinning\n"
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_a_poll_gives_its_cpu_to_a_thread_that_needs_it_and_then_stops(pipe, free_cpus):
    """On a CPU another process wants, the poll yields it (``sched_yield``), notices it was
    switched out, and ends long before its window, halving it: the readers need the core."""
    mask = os.sched_getaffinity(0)
    poll = Poll(pipe[0], 8.0)                 # a first window of 2 s (on the CPUs of ``mask``)
    procs = spinners([min(mask)])
    try:
        os.sched_setaffinity(0, {min(mask)})   # this thread on the spinner's CPU
        began = time.monotonic()
        assert poll() is False
        took = time.monotonic() - began
    finally:
        os.sched_setaffinity(0, mask)
        stop(procs)
    assert (poll.yielded, poll.busy, poll.window) == (1, 0, 1.0)
    assert took < 1.0, took


def test_no_poll_starts_while_every_cpu_has_a_thread_to_run(pipe):
    """8 readers on 2 CPUs: a poll would only take a core from them, so it does not start."""
    mask = sorted(os.sched_getaffinity(0))
    poll = Poll(pipe[0], 8.0)
    procs = spinners(mask)
    try:
        began = time.monotonic()
        assert poll() is False
        took = time.monotonic() - began
    finally:
        stop(procs)
    assert (poll.busy, poll.yielded, poll.window) == (1, 0, 2.0)
    assert took < 0.1, took
    os.write(pipe[1], b"x")
    assert poll() is True and (poll.found, poll.busy) == (1, 1)      # the CPUs free again: it polls


def test_a_poll_ends_at_the_loops_next_timer_or_when_other_work_comes(pipe, alone):
    """The loop's thread has other work than requests: a timer (``limit``: the poll ends by it)
    and results handed over from worker threads (``other()``: the poll ends once one waits)."""
    poll = Poll(pipe[0], 8.0)                 # a first window of 2 s
    began = time.monotonic()
    assert poll(limit=0.005) is False
    assert time.monotonic() - began < 0.5
    calls = []

    def other() -> int:
        calls.append(1)
        return len(calls) >= 3                # a result comes on the third look
    began = time.monotonic()
    assert poll(other=other) is False
    assert time.monotonic() - began < 0.5 and (poll.other, len(calls)) == (1, 3)
    assert poll.window == 2.0                 # (not the poll's fault: nothing learnt)
