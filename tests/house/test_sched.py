"""The scheduler-pass-free primitives (cachefs.sched), on pipes and socket pairs: no kernel FUSE
needed here."""

import os
import socket
import threading
import time

import pytest
import trio
import trio.testing

from cachefs.sched import held, in_thread, send_all


class Passes:
    """Counts the scheduler passes that went by: a task that checkpoints in a loop."""

    def __init__(self) -> None:
        self.count = 0

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self.count += 1
            await trio.lowlevel.checkpoint()


@pytest.fixture
def pipe():
    r, w = os.pipe()
    os.set_blocking(r, False)      # a read of an empty pipe fails the test instead of hanging it
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


# ---- held -----------------------------------------------------------------------------------

def test_held_takes_a_free_token_with_no_pass_and_queues_when_none_is_free():
    async def main():
        limiter = trio.CapacityLimiter(1)
        passes = Passes()
        async with trio.open_nursery() as nursery:
            await nursery.start(passes.run)
            before = passes.count
            async with held(limiter):
                assert passes.count == before          # no pass: the token was free
                assert limiter.borrowed_tokens == 1
                got = []

                async def second():
                    async with held(limiter):
                        got.append(limiter.borrowed_tokens)

                nursery.start_soon(second)
                await trio.sleep(0.05)
                assert got == []                       # waits for the token
            await trio.sleep(0.05)
            assert got == [1] and limiter.borrowed_tokens == 0
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_held_does_not_jump_the_queue():
    """A token freed while a task waits goes to that task, not to one that asks after it."""
    async def main():
        limiter = trio.CapacityLimiter(1)
        order = []

        async def user(name):
            async with held(limiter):
                order.append(name)

        async with trio.open_nursery() as nursery:
            async with held(limiter):
                nursery.start_soon(user, "waiter")
                await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(user, "newcomer")    # runs in the same pass as the waiter
        assert order == ["waiter", "newcomer"]

    for _ in range(20):          # trio shuffles each pass's order: try both
        trio.run(main)


def test_held_releases_on_error():
    async def main():
        limiter = trio.CapacityLimiter(2)
        with pytest.raises(ValueError):
            async with held(limiter):
                raise ValueError("boom")
        assert limiter.borrowed_tokens == 0

    trio.run(main)


# ---- in_thread ------------------------------------------------------------------------------

def test_in_thread_runs_the_call_in_a_worker_and_returns_its_value_and_errors():
    async def main():
        limiter = trio.CapacityLimiter(2)
        here = threading.get_ident()
        ident, total = await in_thread(lambda a, b: (threading.get_ident(), a + b), 2, 3, limiter=limiter)
        assert ident != here and total == 5
        with pytest.raises(OSError, match="disk on fire"):
            await in_thread(_fail, "disk on fire", limiter=limiter)
        assert limiter.borrowed_tokens == 0

    trio.run(main)


def _fail(text):
    raise OSError(text)


def test_in_thread_leaves_the_worker_threads_name_alone():
    """trio.to_thread renames the worker for each call and back (two ctypes calls): not here."""
    async def main():
        limiter = trio.CapacityLimiter(1)
        first = await in_thread(lambda: threading.current_thread().name, limiter=limiter)
        assert first.startswith("Trio thread")
        assert await in_thread(lambda: threading.current_thread().name, limiter=limiter) == first

    trio.run(main)


def test_in_thread_holds_a_limiter_token_per_running_call():
    async def main():
        limiter = trio.CapacityLimiter(2)
        running, peak, lock = [0], [0], threading.Lock()

        def work():
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            time.sleep(0.05)
            with lock:
                running[0] -= 1

        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(lambda: in_thread(work, limiter=limiter))
        assert peak[0] == 2 and limiter.borrowed_tokens == 0

    trio.run(main)


def test_in_thread_is_not_abandoned_when_its_caller_is_cancelled():
    """Like to_thread's default: a started write or read finishes (and its token comes back)
    before the caller sees the cancellation."""
    async def main():
        limiter = trio.CapacityLimiter(1)
        done = []
        start = time.monotonic()
        with trio.move_on_after(0.02):
            await in_thread(lambda: (time.sleep(0.2), done.append(1)), limiter=limiter)
            await trio.lowlevel.checkpoint()
        assert done == [1] and time.monotonic() - start >= 0.2
        assert limiter.borrowed_tokens == 0

    trio.run(main)


# ---- send_all -------------------------------------------------------------------------------

def test_send_all_writes_a_small_request_with_no_pass():
    async def main():
        a, b = trio.socket.socketpair()
        stream = trio.SocketStream(a)
        passes = Passes()
        async with trio.open_nursery() as nursery:
            await nursery.start(passes.run)
            before = passes.count
            await send_all(stream, b"GET / HTTP/1.1\r\n\r\n")
            assert passes.count == before
            assert await b.recv(100) == b"GET / HTTP/1.1\r\n\r\n"
            nursery.cancel_scope.cancel()
        a.close()
        b.close()

    trio.run(main)


def test_send_all_falls_back_to_trio_for_what_the_buffer_does_not_take():
    """More than the send buffer holds: the rest goes through trio's send_all, in order."""
    async def main():
        a, b = trio.socket.socketpair()
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        data = os.urandom(4 << 20)
        got = bytearray()

        async def drain():
            while len(got) < len(data):
                chunk = await b.recv(1 << 16)
                assert chunk
                got.extend(chunk)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            await send_all(trio.SocketStream(a), data)
        assert bytes(got) == data
        a.close()
        b.close()

    trio.run(main)


def test_send_all_on_a_closed_peer_raises_an_oserror():
    async def main():
        a, b = trio.socket.socketpair()
        b.close()
        with pytest.raises(OSError):
            for _ in range(3):
                await send_all(trio.SocketStream(a), b"x" * 1024)
        a.close()

    trio.run(main)
