"""The benchmarks' readers: every byte checked, opened unbuffered or as PIL opens a file."""

import os

import pytest
import xxhash

from benchmarks import readers
from benchmarks.dataset import Entry


@pytest.mark.parametrize("buffered", [False, True], ids=["unbuffered", "buffered"])
def test_readers_read_and_verify_every_file(tmp_path, buffered):
    entries = []
    for i in range(12):
        data = os.urandom(1000 + 997 * i)
        (tmp_path / f"f{i}").write_bytes(data)
        entries.append(Entry(f"f{i}", len(data), xxhash.xxh3_64(data).hexdigest()))
    result = readers.read_files("t", tmp_path, entries, 3, verify_every=1, buffered=buffered)
    assert result.ok and result.tally.files == 12 and result.tally.verified == 12
    (tmp_path / "f5").write_bytes(b"x" * entries[5].size)          # same size, other bytes
    result = readers.read_files("t", tmp_path, entries, 3, verify_every=1, buffered=buffered)
    assert not result.ok and result.tally.bad_hash == 1


def test_a_buffered_reader_opens_as_pil_does(tmp_path, monkeypatch):
    """``buffered``: ``open(path, "rb")`` with the default buffering (what asks isatty on CPython
    < 3.14); else unbuffered."""
    (tmp_path / "f").write_bytes(b"abc")
    calls = []

    def spy(path, mode, **kwargs):
        calls.append((mode, kwargs))
        return open(path, mode, **kwargs)

    monkeypatch.setattr(readers, "open", spy, raising=False)
    buf = memoryview(bytearray(16))
    assert readers.read_file(str(tmp_path / "f"), buf, None, buffered=True) == 3
    assert readers.read_file(str(tmp_path / "f"), buf, None) == 3
    assert calls == [("rb", {}), ("rb", {"buffering": 0})]
