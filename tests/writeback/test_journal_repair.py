"""Journal replay on a damaged staging dir (bug 6 in docs/reliability.md): every bad record is
kept aside with one warning line, its data file kept; nothing stops the replay."""

import logging
import os
import random
import subprocess
import sys
import time

import pytest

from cachefs.writeback.journal import Journal, Record

pytestmark = pytest.mark.allow_warnings      # the journal warns about each record it keeps aside


def write_record(root, record: Record, data: bytes | None = b"staged") -> None:
    (root / "records" / f"{record.id:016x}.json").write_bytes(record.to_json())
    if data is not None:
        (root / "data" / f"{record.id:016x}").write_bytes(data)


@pytest.mark.parametrize("raw", [b'"x"', b"1", b"[]", b"null", b'{"v": 1, "id": "00000000000000aa", "seq": '
                                 b'"00000000000000aa", "kind": "file", "path": null, "created": 1}',
                                 b'{"v": 1, "id": "00000000000000aa", "seq": "00000000000000aa", "kind": "file", '
                                 b'"path": "a//b", "created": 1}',
                                 b'{"v": 1, "id": "0x0000000000000a", "seq": "00000000000000aa", "kind": "file", '
                                 b'"path": "a", "created": 1}'])
def test_a_bad_record_is_kept_aside_with_its_data(tmp_path, caplog, raw):
    journal = Journal(str(tmp_path))
    write_record(tmp_path, Record(0x10, 0x10, "file", "good.log", 1.0), b"keep me")
    (tmp_path / "records" / "00000000000000aa.json").write_bytes(raw)
    (tmp_path / "data" / "00000000000000aa").write_bytes(b"maybe someone's bytes")
    with caplog.at_level(logging.WARNING):
        assert [r.path for r in journal.replay()] == ["good.log"]
    assert (tmp_path / "records" / "00000000000000aa.json.bad").read_bytes() == raw
    assert (tmp_path / "data" / "00000000000000aa").read_bytes() == b"maybe someone's bytes"
    assert (tmp_path / "data" / "0000000000000010").read_bytes() == b"keep me"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()
    # a second start leaves the kept-aside record alone (no .bad.bad, no second warning)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert [r.path for r in Journal(str(tmp_path)).replay()] == ["good.log"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert sorted(p.name for p in (tmp_path / "records").iterdir()) == [
        "0000000000000010.json", "00000000000000aa.json.bad"]


def test_a_directory_with_a_hex_name_under_data_is_left_alone(tmp_path):
    journal = Journal(str(tmp_path))
    write_record(tmp_path, Record(0x10, 0x10, "file", "good.log", 1.0))
    (tmp_path / "data" / "00000000000000ff").mkdir()
    (tmp_path / "data" / "00000000000000ff" / "inner").write_bytes(b"x")
    (tmp_path / "data" / "00000000000000fe").write_bytes(b"orphan")         # a real orphan still goes
    assert [r.path for r in journal.replay()] == ["good.log"]
    assert (tmp_path / "data" / "00000000000000ff" / "inner").exists()
    assert not (tmp_path / "data" / "00000000000000fe").exists()
    assert journal.next_seq() > 0xff                                          # ids never reused


# ---- a write the daemon died in the middle of (step 2's exception) -------------------------------
def marked_write_left_unfinished(root, ident: int, before: bytes, part: bytes) -> None:
    """What a SIGKILL inside ``write_data`` leaves: the mark armed, ``part`` of the write on disk
    (a forked child dies inside its ``pwrite``: no ``finally`` runs, as at a SIGKILL)."""
    journal = Journal(str(root), fsync=False)
    write_record(root, Record(ident, ident, "file", "logs/a.log", 1.0), before)
    fd = os.open(root / "data" / f"{ident:016x}", os.O_RDWR)
    try:
        pid = os.fork()
        if pid == 0:
            original = os.pwrite

            def dies_half_way(fd_, data, offset):
                original(fd_, bytes(data[:len(part)]), offset)
                os._exit(0)
            os.pwrite = dies_half_way
            journal.write_data(ident, fd, part + b"rest of the record", len(before), len(before))
            os._exit(1)
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        os.close(fd)


def test_writes_that_finish_leave_nothing_to_cut(tmp_path):
    journal = Journal(str(tmp_path), fsync=False)
    write_record(tmp_path, Record(0x20, 0x20, "file", "logs/a.log", 1.0), b"one\n")
    fd = os.open(tmp_path / "data" / f"{0x20:016x}", os.O_RDWR)
    try:
        journal.write_data(0x20, fd, b"two\n", 4, 4)          # grows the file: marked, then cleared
        journal.write_data(0x20, fd, b"ONE\n", 0, 8)          # inside it: not marked
    finally:
        os.close(fd)
    again = Journal(str(tmp_path), fsync=False)
    assert [r.path for r in again.replay(trusted=True)] == ["logs/a.log"] and again.cut_back == 0
    assert (tmp_path / "data" / f"{0x20:016x}").read_bytes() == b"ONE\ntwo\n"


def test_a_write_cut_short_by_the_daemons_death_is_cut_back_at_replay(tmp_path, caplog):
    before = b"record one\n"
    marked_write_left_unfinished(tmp_path, 0x21, before, b"rec")
    data = tmp_path / "data" / f"{0x21:016x}"
    assert data.read_bytes() == before + b"rec"
    with caplog.at_level(logging.INFO):
        journal = Journal(str(tmp_path), fsync=False)
        assert [r.path for r in journal.replay(trusted=True)] == ["logs/a.log"]
    assert data.read_bytes() == before and journal.cut_back == 1
    assert any("cut back" in r.getMessage() for r in caplog.records)
    # the mark is cleared: a second start cuts nothing (a later write may have grown the file)
    data.write_bytes(before + b"a whole later record\n")
    journal = Journal(str(tmp_path), fsync=False)
    journal.replay(trusted=True)
    assert data.read_bytes() == before + b"a whole later record\n" and journal.cut_back == 0


def test_an_untrusted_replay_leaves_the_mark_to_the_sealed_size(tmp_path):
    """After a reboot the mark may be older than what fsync made durable: only ``sealed`` counts."""
    before = b"record one\n"
    marked_write_left_unfinished(tmp_path, 0x22, before, b"rec")
    sealed = before + b"rec"                    # say a later write grew it this far and was fsynced
    write_record(tmp_path, Record(0x22, 0x23, "file", "logs/a.log", 1.0, sealed=len(sealed)), sealed)
    journal = Journal(str(tmp_path), fsync=False)
    assert [r.path for r in journal.replay(trusted=False)] == ["logs/a.log"]
    assert (tmp_path / "data" / f"{0x22:016x}").read_bytes() == sealed and journal.cut_back == 0


def test_a_mark_for_a_file_no_longer_staged_cuts_nothing(tmp_path):
    marked_write_left_unfinished(tmp_path, 0x24, b"old\n", b"part")
    (tmp_path / "records" / f"{0x24:016x}.json").unlink()              # retired since (an orphan now)
    write_record(tmp_path, Record(0x25, 0x25, "file", "logs/b.log", 1.0), b"other file, grown\n")
    journal = Journal(str(tmp_path), fsync=False)
    assert [r.path for r in journal.replay(trusted=True)] == ["logs/b.log"]
    assert (tmp_path / "data" / f"{0x25:016x}").read_bytes() == b"other file, grown\n" and journal.cut_back == 0


_WRITER = """
import os, sys
from cachefs.writeback.journal import Journal, Record
root, size = sys.argv[1], int(sys.argv[2])
journal = Journal(root, fsync=False)
journal.write_record(Record(0x31, 0x31, "file", "logs/big.log", 1.0))
fd = journal.create_data(0x31)
chunk, length = os.urandom(size), 0
os.write(1, b"ready\\n")
while True:
    journal.write_data(0x31, fd, chunk, length, length)
    length += size
    if length >= 4 * size:
        os.ftruncate(fd, 0)
        length = 0
"""


def test_sigkilled_writers_leave_only_whole_writes_staged(tmp_path):
    """Real SIGKILLs of a process writing 32 MiB at a time through ``write_data``: the kernel
    stops a buffered write at a fatal signal part way (seen here: the file is not whole writes),
    and replay cuts every such file back to whole writes."""
    size, torn = 32 << 20, 0
    for trial in range(12):
        root = tmp_path / f"t{trial}"
        root.mkdir()
        child = subprocess.Popen([sys.executable, "-c", _WRITER, str(root), str(size)], stdout=subprocess.PIPE)
        try:
            assert child.stdout.readline() == b"ready\n"
            time.sleep(random.uniform(0.05, 0.25))
        finally:
            child.kill()
            child.wait()
        data = root / "data" / f"{0x31:016x}"
        torn += data.stat().st_size % size != 0
        Journal(str(root), fsync=False).replay(trusted=True)
        assert data.stat().st_size % size == 0, f"trial {trial}: {data.stat().st_size} bytes"
        data.unlink()
        if torn >= 2:
            break
    assert torn, "no SIGKILL stopped a write part way: the test did not test the cut"
