"""Views of a volume's mount (csi/agent/mounts.py) on real mounts, with tmpfs standing in for the
FUSE connection: a view placed on top of another reaches containers' slave copies with its own
flags, never spreads to the other views, and the stale-view search finds private copies."""

import contextlib
import subprocess
import time
from pathlib import Path

import pytest

from cachefs.host import find_mount, mounts, top_mount
from csi.agent import mounts as views

# A container: its own mount namespace (a slave copy of the host's), the view bound at its own path,
# made private when asked; it prints what it reads and whether it may write, every 20 ms.
CONTAINER = r"""
mount --bind "$1" "$2" || exit 1
[ "$3" = private ] && mount --make-private "$2"
while true; do
  { cat "$2/marker" 2>&1; touch "$2/probe" 2>/dev/null && echo writable; } > "$4.tmp"; mv "$4.tmp" "$4"
  sleep 0.02
done
"""


@pytest.fixture
def tree(tmp_path: Path):
    """A shared root (as kubelet's tree) with a staging path and two targets; an outside home."""
    root = tmp_path / "kubelet"
    for sub in ("staging", "target", "target-ro"):
        (root / sub).mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(root), str(root)], check=True)
    subprocess.run(["mount", "--make-rshared", str(root)], check=True)
    containers: list[subprocess.Popen] = []
    yield root, containers
    for proc in containers:
        proc.kill()
        proc.wait()
    for entry in sorted(mounts(), key=lambda e: -len(e.mountpoint)):
        if entry.mountpoint.startswith(str(tmp_path)):
            subprocess.run(["umount", "-l", entry.mountpoint], capture_output=True)


def tmpfs(path: Path, marker: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", marker, str(path)], check=True)
    (path / "marker").write_text(marker)


def container(containers: list, view: Path, own: Path, propagation: str) -> Path:
    own.mkdir(parents=True)
    out = own.with_suffix(".out")
    containers.append(subprocess.Popen(["unshare", "--mount", "--propagation", "slave", "sh", "-c", CONTAINER,
                                        "c", str(view), str(own), propagation, str(out)]))
    return out


def seen(out: Path, expected: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            text = out.read_text()
            if text.startswith(expected):
                return text
        time.sleep(0.02)
    raise AssertionError(f"{out.name} shows {text!r}, not {expected!r}")


@pytest.mark.parametrize("new_api", [True, False], ids=["new-mount-api", "bind-fallback"])
def test_a_view_on_top_reaches_slave_copies_and_keeps_each_targets_flags(tree, tmp_path, monkeypatch, new_api):
    root, containers = tree
    monkeypatch.setattr(views, "_new_api", new_api)
    tmpfs(tmp_path / "home", "first")
    views.place_view(str(tmp_path / "home"), str(root / "staging"), False)
    views.place_view(str(root / "staging"), str(root / "target"), False)
    views.place_view(str(root / "staging"), str(root / "target-ro"), True)
    slave = container(containers, root / "target", tmp_path / "c/slave", "slave")
    private = container(containers, root / "target", tmp_path / "c/private", "private")
    slave_ro = container(containers, root / "target-ro", tmp_path / "c/slave-ro", "slave")
    assert seen(slave, "first") == "firstwritable\n"
    assert seen(slave_ro, "first") == "first"
    seen(private, "first")

    # the daemon "dies" and a new one mounts at home: views go on top of the old ones
    subprocess.run(["umount", "-l", str(tmp_path / "home")], check=True)
    tmpfs(tmp_path / "home", "second")
    old = find_mount(str(root / "target"))
    views.place_view(str(tmp_path / "home"), str(root / "staging"), False)
    assert find_mount(str(root / "target")) == old     # each view is its own peer group: no spreading
    for target, readonly in (("target", False), ("target-ro", True)):
        views.place_view(str(root / "staging"), str(root / target), readonly)
    assert (root / "target" / "marker").read_text() == "second"
    assert seen(slave, "second").startswith("second")
    assert seen(private, "first") == "firstwritable\n"          # a private copy cannot be reached
    # read-only in the container too; the fallback's flag, set after attaching, stays on the host
    assert seen(slave_ro, "second") == ("second" if new_api else "secondwritable\n")
    with pytest.raises(OSError):
        (root / "target-ro" / "x").write_text("x")

    # stacked views: the top one is the visible one; unmount removes every layer
    table = mounts()
    stack = [e for e in table if e.mountpoint == str(root / "target")]
    assert len(stack) == 2 and top_mount(table, str(root / "target")).devno == find_mount(str(tmp_path / "home"))[0]
    views.unmount(str(root / "target"), lazy=True)
    assert views.entry(str(root / "target")) is None


def test_stale_views_counts_private_copies_of_a_dead_connection(tree, tmp_path):
    root, containers = tree
    tmpfs(tmp_path / "home", "first")
    views.place_view(str(tmp_path / "home"), str(root / "staging"), False)
    views.place_view(str(root / "staging"), str(root / "target"), False)
    dead = {views.entry(str(root / "target")).devno}
    own = {str(root / "staging"), str(root / "target"), str(tmp_path / "home")}
    slave = container(containers, root / "target", tmp_path / "c/slave", "slave")
    private = container(containers, root / "target", tmp_path / "c/private", "private")
    seen(slave, "first")
    seen(private, "first")
    assert views.stale_views(dead, own) == 2                     # nothing on top of either copy yet
    tmpfs(tmp_path / "home2", "second")
    views.place_view(str(tmp_path / "home2"), str(root / "target"), False)
    seen(slave, "second")
    assert views.stale_views(dead, own) == 1                     # only the private copy is left
    containers.pop().kill()
    deadline = time.monotonic() + 5
    while views.stale_views(dead, own) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert views.stale_views(dead, own) == 0
    assert views.stale_views(set(), own) == 0
