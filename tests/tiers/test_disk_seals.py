"""Seals of verified cache files (tiers/disk/seals.py): kept across daemons of one boot, void in
another boot or once the file changed (inode, ctime, size), a damaged record ends the reading,
and a daemon that cannot keep them works on, verifying as before."""

import os

import pytest

from cachefs.tiers.disk.seals import Seals

BOOT = b"0f0e0d0c-0000-4000-8000-000000000001"
OTHER = b"0f0e0d0c-0000-4000-8000-000000000002"


def digest(i: int) -> str:
    return f"{i:040x}"


@pytest.fixture
def files(tmp_path):
    paths = []
    for i in range(5):
        path = tmp_path / f"f{i}"
        path.write_bytes(bytes([i]) * (100 + i))
        paths.append(path)
    return paths


def test_a_seal_holds_in_a_later_daemon_of_the_same_boot(tmp_path, files):
    seals = Seals(str(tmp_path / "seals"), boot=BOOT)
    for i, path in enumerate(files):
        seals.seal(digest(i), path.stat())
    seals.close()
    again = Seals(str(tmp_path / "seals"), boot=BOOT)
    assert len(again) == len(files)
    assert all(again.matches(digest(i), path.stat()) for i, path in enumerate(files))
    assert not again.matches(digest(0), files[1].stat())         # another file under that name
    assert not again.matches(digest(99), files[0].stat())        # never sealed


def test_another_boot_voids_every_seal(tmp_path, files):
    seals = Seals(str(tmp_path / "seals"), boot=BOOT)
    seals.seal(digest(0), files[0].stat())
    seals.close()
    later = Seals(str(tmp_path / "seals"), boot=OTHER)
    assert len(later) == 0 and not later.matches(digest(0), files[0].stat())
    later.close()
    assert len(Seals(str(tmp_path / "seals"), boot=BOOT)) == 0     # the file was rewritten for the new boot


def test_a_changed_file_no_longer_matches(tmp_path, files):
    seals = Seals(str(tmp_path / "seals"), boot=BOOT)
    for i, path in enumerate(files):
        seals.seal(digest(i), path.stat())
    with open(files[0], "r+b") as fh:                    # same size, a byte rewritten in place
        fh.write(b"\xff")
    os.truncate(files[1], 50)                            # cut short
    replaced = files[2].read_bytes()                     # the same bytes, another inode
    files[2].unlink()
    files[2].write_bytes(replaced)
    os.chmod(files[3], 0o600)                            # metadata only: still a change (ctime)
    assert not seals.matches(digest(0), files[0].stat())
    assert not seals.matches(digest(1), files[1].stat())
    assert not seals.matches(digest(2), files[2].stat())
    assert not seals.matches(digest(3), files[3].stat())
    assert seals.matches(digest(4), files[4].stat())
    seals.forget(digest(4))
    assert not seals.matches(digest(4), files[4].stat())


@pytest.mark.allow_warnings          # the damaged record is logged
def test_a_damaged_record_ends_the_reading(tmp_path, files):
    path = tmp_path / "seals"
    seals = Seals(str(path), boot=BOOT)
    for i, f in enumerate(files):
        seals.seal(digest(i), f.stat())
    seals.close()
    data = bytearray(path.read_bytes())
    header = data.index(b"\n") + 1
    record = (len(data) - header) // len(files)
    data[header + 2 * record + 5] ^= 0x40                # the third record garbled
    path.write_bytes(bytes(data[:-7]))                   # and the last one torn
    again = Seals(str(path), boot=BOOT)
    assert len(again) == 2
    assert again.matches(digest(1), files[1].stat()) and not again.matches(digest(2), files[2].stat())
    again.seal(digest(2), files[2].stat())               # appends after the rewrite are read back
    again.close()
    assert Seals(str(path), boot=BOOT).matches(digest(2), files[2].stat())


def test_a_rewrite_keeps_only_what_the_tier_holds(tmp_path, files, monkeypatch):
    live = {digest(0), digest(1)}
    seals = Seals(str(tmp_path / "seals"), live=live.__contains__, boot=BOOT)
    seals._rewrite_at = 4
    for i, f in enumerate(files):
        seals.seal(digest(i), f.stat())
    assert len(seals) == 3            # at the fourth record the dead ones went; the fifth came after
    seals.close()
    assert (tmp_path / "seals").stat().st_size < 200


@pytest.mark.allow_warnings          # the place that cannot be written is logged
def test_no_boot_id_or_no_writable_place_means_no_seals(tmp_path, files):
    none = Seals(str(tmp_path / "seals"), boot=b"")
    none.seal(digest(0), files[0].stat())
    assert not none.matches(digest(0), files[0].stat()) and not (tmp_path / "seals").exists()
    blocked = tmp_path / "file"
    blocked.write_bytes(b"x")
    stuck = Seals(str(blocked / "seals"), boot=BOOT)        # its folder is a file
    stuck.seal(digest(0), files[0].stat())
    assert not stuck.matches(digest(0), files[0].stat())
