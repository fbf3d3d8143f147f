"""The scheduler-pass-free primitives (cachefs.sched) and the FUSE request intake
(cachefs.fuse_intake), on pipes and socket pairs: no kernel FUSE needed here; the real mount
is in test_mount_read.py (test_free_workers_read_queued_requests_at_once)."""

import os
import socket
import threading
import time
import types

import pytest
import trio
import trio.testing

from cachefs import fuse_intake
from cachefs.fuse_intake import STREAK, Intake
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


# ---- Intake ---------------------------------------------------------------------------------

class FakePyfuse3:
    """pyfuse3's wait as its internal.pxi has it (the idle-worker count, one read lock, the
    device's waiter, the session's end), over a pipe: ``fuse_intake.install`` wraps it."""

    __version__ = "fake"

    def __init__(self, fd: int) -> None:
        self.trio = trio            # looked up at each call, as the Cython module does
        self.fd = fd
        self.active_readers = 0
        self.read_lock = None
        self.exited = False
        self.stock_waits = 0
        self._wait_fuse_readable = self._stock_wait

    async def _stock_wait(self) -> bool:
        self.stock_waits += 1
        if self.read_lock is None:
            self.read_lock = self.trio.Lock()
        self.active_readers += 1
        try:
            async with self.read_lock:
                if self.exited:
                    return False
                await self.trio.lowlevel.wait_readable(self.fd)
        except trio.ClosedResourceError:
            return False
        finally:
            self.active_readers -= 1
        return True


def installed(fd: int, counted: list | None = None) -> tuple[FakePyfuse3, Intake]:
    fake = FakePyfuse3(fd)
    intake = fuse_intake.install(fake, (lambda: counted.append(1)) if counted is not None else (lambda: None), fd=fd)
    assert intake is not None and fake._wait_fuse_readable == intake.wait
    return fake, intake


def test_a_queued_request_is_taken_with_no_pass(pipe):
    r, w = pipe
    counted = []
    fake, intake = installed(r, counted)

    async def main():
        passes = Passes()
        async with trio.open_nursery() as nursery:
            await nursery.start(passes.run)
            os.write(w, b"x")
            before = passes.count
            assert await fake._wait_fuse_readable() is True
            assert passes.count == before
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert counted == [1] and fake.stock_waits == 0


def test_an_empty_device_leaves_workers_to_pyfuse3s_wait_one_parked(pipe):
    r, w = pipe
    fake, intake = installed(r)
    woke = []

    async def worker(name):
        assert await fake._wait_fuse_readable() is True
        woke.append(name)
        os.read(r, 1)            # the "request" is read right away, as _session_loop does

    async def main():
        async with trio.open_nursery() as nursery:
            for name in ("a", "b", "c"):
                nursery.start_soon(worker, name)       # one parked on the device, two on the lock
            await trio.testing.wait_all_tasks_blocked()
            assert woke == [] and intake.parked
            assert fake.active_readers == 3             # pyfuse3 sees its idle workers: no new ones
            for expected in (1, 2, 3):
                os.write(w, b"x")
                with trio.fail_after(2):
                    while len(woke) < expected:
                        await trio.sleep(0.001)
                await trio.testing.wait_all_tasks_blocked()
                assert len(woke) == expected           # one request, one worker
            assert fake.active_readers == 0 and not intake.parked

    trio.run(main)


def test_no_worker_takes_the_request_a_parked_worker_was_woken_for():
    """Parked worker A is woken by a request; B, back from its own request before A runs,
    must not read it (A would then read an empty blocking device). Trio shuffles the order of
    each pass, so the race is run many times."""
    for _ in range(30):
        r, w = os.pipe()
        os.set_blocking(r, False)
        try:
            trio.run(_parked_and_newcomer, r, w)
        finally:
            os.close(r)
            os.close(w)


async def _parked_and_newcomer(r: int, w: int) -> None:
    fake, intake = installed(r)
    order = []

    async def worker(name):
        assert await fake._wait_fuse_readable() is True
        order.append(name)
        os.read(r, 1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker, "parked")
        await trio.testing.wait_all_tasks_blocked()
        assert intake.parked
        os.write(w, b"x")
        # B arrives while A is still parked (woken, not yet run): it waits in pyfuse3's wait and
        # is given a request only when one is there for it
        nursery.start_soon(worker, "second")
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["parked"]
        os.write(w, b"y")
        with trio.fail_after(2):
            while len(order) < 2:
                await trio.sleep(0.001)
    assert order == ["parked", "second"]


def test_a_streak_of_requests_taken_at_once_ends_in_pyfuse3s_wait(pipe):
    r, w = pipe
    fake, intake = installed(r)

    async def main():
        passes = Passes()
        async with trio.open_nursery() as nursery:
            await nursery.start(passes.run)
            os.write(w, b"x" * (3 * STREAK))
            before = passes.count
            for _ in range(STREAK):
                assert await fake._wait_fuse_readable() is True
                os.read(r, 1)
            assert passes.count == before and fake.stock_waits == 0    # STREAK in a row, no pass
            assert await fake._wait_fuse_readable() is True
            assert fake.stock_waits == 1                               # then pyfuse3's wait
            os.read(r, 1)
            for _ in range(STREAK):
                assert await fake._wait_fuse_readable() is True
                os.read(r, 1)
            assert fake.stock_waits == 1                               # and a new streak
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_the_sessions_end_ends_every_worker(pipe):
    r, w = pipe
    fake, intake = installed(r)
    results = []

    async def worker():
        results.append(await fake._wait_fuse_readable())

    async def main():
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(worker)
            await trio.testing.wait_all_tasks_blocked()
            fake.exited = True
            fake.trio.lowlevel.notify_closing(r)      # what pyfuse3.terminate() does
        assert results == [False] * 4

    trio.run(main)


def test_pyfuse3_sees_trio_but_for_the_devices_wait(pipe):
    r, _ = pipe
    fake, intake = installed(r)
    assert fake.trio.Lock is trio.Lock and fake.trio.ClosedResourceError is trio.ClosedResourceError
    assert fake.trio.lowlevel.current_task is trio.lowlevel.current_task
    assert fake.trio.lowlevel.wait_readable == intake.wait_readable
    fuse_intake.uninstall(fake, intake)
    assert fake.trio is trio and fake._wait_fuse_readable == fake._stock_wait


def test_install_needs_pyfuse3s_wait_on_trio_and_one_fuse_descriptor():
    if not os.path.exists("/dev/fuse"):
        if os.environ.get("CI") == "true":
            pytest.fail("no /dev/fuse in CI")
        pytest.skip("no /dev/fuse")
    assert fuse_intake.fuse_fds() == []
    fake = FakePyfuse3(-1)
    assert fuse_intake.install(fake) is None               # no session open: pyfuse3's wait
    fd = os.open("/dev/fuse", os.O_RDWR)
    try:
        intake = fuse_intake.install(fake)
        assert intake is not None and intake.fd == fd
        fuse_intake.uninstall(fake, intake)
        fd2 = os.open("/dev/fuse", os.O_RDWR)
        try:
            assert fuse_intake.install(fake) is None       # two: which one is the session's?
        finally:
            os.close(fd2)
        assert fuse_intake.install(types.SimpleNamespace(trio=trio)) is None          # no wait to wrap
        assert fuse_intake.install(types.SimpleNamespace(trio=object(),                # asyncio mode
                                                         _wait_fuse_readable=fake._stock_wait)) is None
    finally:
        os.close(fd)
