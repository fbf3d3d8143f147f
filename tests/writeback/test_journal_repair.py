"""Journal replay on a damaged staging dir (bug 6 in docs/reliability.md): every bad record is
kept aside with one warning line, its data file kept; nothing stops the replay."""

import logging

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
