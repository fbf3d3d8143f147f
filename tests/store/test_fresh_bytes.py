"""``cachefs.store.s3.fresh``: a response body received straight into the bytes object returned."""

import platform
import socket
import threading

import pytest

from cachefs.store.s3 import fresh


@pytest.mark.parametrize("make", [fresh.new, fresh._fallback], ids=["fresh", "fallback"])
def test_bytes_written_through_the_view_are_the_bytes_returned(make):
    payload = bytes(range(256)) * 4099               # not a multiple of a page
    body, view = make(len(payload))
    for start in range(0, len(payload), 65536):      # in pieces, as receives fill it
        view[start:start + 65536] = payload[start:start + 65536]
    view.release()
    data = fresh.finish(body)
    assert type(data) is bytes
    assert data == payload and hash(data) == hash(payload)
    assert fresh.finish(make(len(payload))[0]) is not data     # a new object each time, never shared


def test_on_cpython_the_kernel_writes_into_the_returned_object_once():
    """``recv_into`` through the view fills the very object ``finish`` returns (no copy)."""
    if platform.python_implementation() != "CPython":
        pytest.skip("the fresh path is CPython's; elsewhere the fallback copies")
    assert fresh._new is fresh._fresh
    payload = bytes(range(251)) * 2000
    left, right = socket.socketpair()
    with left, right:
        body, view = fresh.new(len(payload))
        sender = threading.Thread(target=left.sendall, args=(payload,))
        sender.start()
        right.settimeout(30)
        have = 0
        while have < len(payload):
            have += right.recv_into(view[have:], len(payload) - have)
        view.release()
        sender.join(30)
        assert fresh.finish(body) is body and body == payload


@pytest.mark.parametrize("length", [0, 1])
def test_lengths_that_may_be_shared_objects_are_refused(length):
    with pytest.raises(ValueError):
        fresh.new(length)


def test_the_view_keeps_its_bytes_alive():
    """A view that outlives every other reference (an error mid-body, a traceback holding it)
    still points at live memory."""
    body, view = fresh.new(8192)
    del body
    view[:] = b"\x07" * 8192
    assert bytes(view) == b"\x07" * 8192
    view.release()
