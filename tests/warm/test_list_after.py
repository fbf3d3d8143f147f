"""The listing after a warmup (warmup/walk.py), on a plain directory tree: what it lists, how
deep a glob takes it, and what it counts when a path cannot be listed."""

import os

import pytest

from cachefs.warm.walk import Listed, _depth, list_through
from warmup.progress import listing_line


def tree(root, names):
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")


def test_a_glob_lists_only_as_deep_as_it_can_match():
    assert _depth("train/*.jpg") == 0
    assert _depth("train/*/img_*.jpg") == 1
    assert _depth("*.jpg") == 0
    assert _depth("train/**/x.jpg") is None
    assert _depth("a/b/c.jpg") == 0


def test_directories_globs_and_manifest_paths(tmp_path):
    tree(tmp_path, ["ds/a/1", "ds/a/2", "ds/b/3", "ds/b/deep/4", "g/c0/x1", "g/c0/y", "g/c1/x2",
                    "g/c1/deeper/x3", "m/f1", "m/f2", "top.bin"])
    seen = []
    listed = list_through(str(tmp_path), ["ds", "top.bin"], ["g/*/x*"], ["m/f1", "m/missing"], seen.append)
    # ds: 2 + a(2) + b(2) + deep(1) = 7 names in 4 directories; top.bin looked up; g: c0, c1
    # listed (2), then c0 (2) and c1 (2: x2, deeper, not descended into); m/f1 looked up
    assert (listed.entries, listed.directories, listed.errors) == (7 + 1 + 6 + 1, 4 + 3, 1)
    assert seen and seen[-1] is listed and listed.seconds > 0
    assert listed.as_event() == {"event": "listed", "entries": 15, "directories": 7, "errors": 1,
                                 "seconds": round(listed.seconds, 3)}
    assert "15 entries in 7 directories" in listing_line(listed) and "1 could not be listed" in listing_line(listed)


def test_the_whole_mount_and_a_path_that_is_gone(tmp_path):
    tree(tmp_path, [f"d{i}/f{j}" for i in range(3) for j in range(5)])
    listed = list_through(str(tmp_path), [""], [], [])
    assert (listed.entries, listed.directories, listed.errors) == (3 + 15, 4, 0)
    os.rename(tmp_path / "d0", tmp_path / "gone")
    gone = list_through(str(tmp_path), ["d0"], [], [])
    assert (gone.entries, gone.directories, gone.errors) == (0, 0, 1)
    assert "could not" not in listing_line(Listed(3, 1, 0, 0.5))


def test_ctrl_c_stops_the_listing_at_once(tmp_path, monkeypatch):
    """A Ctrl-C (here raised by the progress callback after the first level) ends the listing:
    no directory below is listed."""
    from cachefs.warm import walk

    tree(tmp_path, [f"d{i}/e{j}/f" for i in range(4) for j in range(4)])
    scanned = []
    real = walk._scan
    monkeypatch.setattr(walk, "_scan", lambda item: scanned.append(item[0]) or real(item))

    def interrupt(_listed):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        list_through(str(tmp_path), [""], [], [], interrupt)
    assert scanned == [str(tmp_path) + "/"]
