"""The write-back journal on disk: atomic records and the crash repairs of ``replay``."""

import os

from cachefs.writeback.journal import DELETE, FILE, MKDIR, RMDIR, Journal, Record


def staged(journal: Journal, path: str, data: bytes, *, record: bool = True) -> Record:
    seq = journal.next_seq()
    fd = journal.create_data(seq)
    os.write(fd, data)
    os.close(fd)
    rec = Record(seq, seq, FILE, path, 1.0)
    if record:
        journal.write_record(rec)
    return rec


def op(journal: Journal, kind: str, path: str) -> Record:
    seq = journal.next_seq()
    rec = Record(seq, seq, kind, path, 1.0)
    journal.write_record(rec)
    return rec


def test_records_round_trip_and_survive_a_restart(tmp_path):
    journal = Journal(str(tmp_path))
    a = staged(journal, "a/b.log", b"hello")
    d = op(journal, DELETE, "old.bin")
    m = op(journal, MKDIR, "dir")
    again = Journal(str(tmp_path))
    assert again.replay() == [a, d, m]
    assert open(again.data_path(a.id), "rb").read() == b"hello"
    assert again.next_seq() > m.seq          # the counter moves past every id seen


def test_unacknowledged_data_and_temporary_records_are_removed(tmp_path):
    journal = Journal(str(tmp_path))
    orphan = staged(journal, "x", b"never acknowledged", record=False)
    kept = staged(journal, "y", b"kept")
    open(os.path.join(journal.records_dir, "00000000000000aa.json.1.tmp"), "w").write("{torn")
    assert Journal(str(tmp_path)).replay() == [kept]
    assert not os.path.exists(journal.data_path(orphan.id))
    assert [n for n in os.listdir(journal.records_dir) if n.endswith(".tmp")] == []


def test_newest_record_of_a_path_wins(tmp_path):
    journal = Journal(str(tmp_path))
    old = staged(journal, "f", b"old")
    new = staged(journal, "f", b"new")               # a rename over f, crash before dropping the old
    dead = staged(journal, "g", b"deleted")
    tomb = op(journal, DELETE, "g")                  # unlink: tombstone written, file record not yet gone
    mk = op(journal, MKDIR, "d")
    rm = op(journal, RMDIR, "d")
    live = Journal(str(tmp_path)).replay()
    assert live == [new, tomb, rm]
    assert not os.path.exists(journal.data_path(old.id)) and not os.path.exists(journal.data_path(dead.id))
    assert mk not in live


def test_a_file_record_renamed_keeps_its_data(tmp_path):
    journal = Journal(str(tmp_path))
    rec = staged(journal, "before", b"data")
    rec.path, rec.seq = "after", journal.next_seq()
    journal.write_record(rec)                         # rewrite in place: same id, new seq
    live = Journal(str(tmp_path)).replay()
    assert [(r.path, r.id) for r in live] == [("after", rec.id)]


def test_record_without_data_and_unreadable_records_are_dropped(tmp_path, caplog):
    journal = Journal(str(tmp_path))
    rec = staged(journal, "lost", b"x")
    os.unlink(journal.data_path(rec.id))
    open(os.path.join(journal.records_dir, "00000000000000ff.json"), "w").write("not json")
    caplog.set_level("CRITICAL")      # the two errors are expected here
    assert Journal(str(tmp_path)).replay() == []
    assert os.path.exists(os.path.join(journal.records_dir, "00000000000000ff.json.bad"))
