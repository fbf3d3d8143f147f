"""The in-flight log (cachefs/fuse/inflight.py): a request read into a slot is found by the next
daemon until it is answered; nothing else is."""

import struct

import pytest

from cachefs.fuse import abi
from cachefs.fuse.inflight import HEADER_SIZE, PREFIX, InflightLog


def request(opcode: int, unique: int, body: bytes = b"") -> bytes:
    length = abi.IN_HEADER.size + len(body)
    return abi.IN_HEADER.pack(length, opcode, unique, 1, 0, 0, 0, 0, 0) + body


def read_into(log: InflightLog, index: int, data: bytes) -> int:
    """What the session does: a slot, and the kernel's copy of the request into it."""
    slot, buf = log.reserve(index)
    buf[:len(data)] = data
    return slot


def test_unanswered_requests_are_found_by_the_next_daemon(tmp_path):
    path = str(tmp_path / "fuse-inflight")
    first = InflightLog(path, fresh=True, slots=8)
    read = read_into(first, 0, request(abi.READ, 10, b"r" * 40))
    write = read_into(first, 2, request(abi.WRITE, 11, b"w" * 70_000))
    answered = read_into(first, 1, request(abi.GETATTR, 12))
    first.done(answered)
    first.reserve(1)                                   # a loop waiting in read(2): nothing read yet
    assert first.status()["free"] == 5
    first.close()                                      # the daemon dies: no more calls on it

    second = InflightLog(path, fresh=False)
    pending = second.pending()
    assert [(slot, index) for slot, index, _ in pending] == sorted([(read, 0), (write, 2)])
    by_slot = {slot: bytes(data) for slot, _, data in pending}
    assert by_slot[read] == request(abi.READ, 10, b"r" * 40)
    assert by_slot[write] == request(abi.WRITE, 11, b"w" * 70_000)
    assert second.pending() == [] and second.status()["replayed"] == 2
    assert second.status()["free"] == 6                 # the replayed ones hold their slots until answered
    for slot, _, _ in pending:
        second.done(slot)
    del pending
    second.close()
    assert InflightLog(path, fresh=False).pending() == []


def test_requests_without_an_answer_are_not_run_again(tmp_path):
    path = str(tmp_path / "log")
    log = InflightLog(path, fresh=True, slots=8)
    for opcode in (abi.FORGET, abi.BATCH_FORGET, abi.INTERRUPT, abi.INIT):
        read_into(log, 0, request(opcode, 5, b"x" * 16))
    log.close()
    again = InflightLog(path, fresh=False)
    assert again.pending() == [] and again.status()["free"] == 8


@pytest.mark.allow_warnings
def test_a_full_log_counts_what_it_could_not_keep(tmp_path):
    log = InflightLog(str(tmp_path / "log"), fresh=True, slots=2, slot_size=4096)
    assert log.capacity == 4096 - PREFIX.size
    assert log.reserve(0) is not None and log.reserve(0) is not None
    assert log.reserve(0) is None and log.reserve(1) is None
    assert log.status()["unlogged"] == 2


def test_a_fresh_log_forgets_what_was_there(tmp_path):
    path = str(tmp_path / "log")
    old = InflightLog(path, fresh=True, slots=4)
    read_into(old, 0, request(abi.READ, 1))
    old.close()
    assert InflightLog(path, fresh=True, slots=4).pending() == []


@pytest.mark.allow_warnings
def test_a_torn_or_foreign_log_answers_nothing(tmp_path):
    path = tmp_path / "log"
    log = InflightLog(str(path), fresh=True, slots=4, slot_size=4096)
    slot = read_into(log, 0, request(abi.READ, 1))
    log.close()
    with open(path, "r+b") as fh:                      # a length past its slot: not a request
        fh.seek(HEADER_SIZE + slot * 4096 + PREFIX.size)
        fh.write(struct.pack("<I", 1 << 20))
    assert InflightLog(str(path), fresh=False).pending() == []
    path.write_bytes(b"not a log at all")
    again = InflightLog(str(path), fresh=False)
    assert again.pending() == [] and again.status()["free"] == again.slots
    path.write_bytes(struct.pack("<8sII", b"CFSINFL2", 4, 4096))      # right magic, wrong size
    assert InflightLog(str(path), fresh=False).pending() == []
