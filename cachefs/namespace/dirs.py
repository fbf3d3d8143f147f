"""Directories: paths, the listing state of one directory, open directory handles, and the
sources of directory entries.

A ``DirSource`` answers "what lives under this directory" with a ``Listing``: the object store
is one (its ``list_dir``); a packed dataset's index can be another. ``UnionSource`` stacks
sources (the first one to name an entry wins). What the write-back has staged is applied on
top of every fresh listing (``DirState.apply``).
"""

from dataclasses import dataclass
from typing import Protocol

from cachefs.store import Listing, ObjectInfo
from cachefs.writeback.overlay import DirOverlay


def dir_prefix(path: str) -> str:
    return path + "/" if path else ""


def join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def split(path: str) -> tuple[str, str]:
    parent, _, name = path.rpartition("/")
    return parent, name


class DirSource(Protocol):
    def list_dir(self, prefix: str) -> Listing:
        """The files and sub-directories directly under ``prefix`` ("" or "dir/"); blocking
        (called from a worker thread); raises ``StoreError`` when it cannot answer."""


class UnionSource:
    """Several sources as one: names from earlier sources shadow the same names in later ones."""

    def __init__(self, *sources: DirSource) -> None:
        self.sources = sources

    def list_dir(self, prefix: str) -> Listing:
        merged, seen = Listing(), set()
        for source in self.sources:
            listing = source.list_dir(prefix)
            for name in listing.dirs:
                if name not in seen:
                    seen.add(name)
                    merged.dirs.append(name)
            for info in listing.files:
                name = info.path.rsplit("/", 1)[-1]
                if name not in seen:
                    seen.add(name)
                    merged.files.append(info)
        return merged


@dataclass(slots=True)
class DirState:
    listed_at: float
    files: dict[str, ObjectInfo]
    dirs: set[str]

    @classmethod
    def from_listing(cls, listing: Listing, listed_at: float) -> "DirState":
        files = {info.path.rsplit("/", 1)[-1]: info for info in listing.files}
        dirs = set(listing.dirs)
        for name in dirs & files.keys():
            del files[name]   # a directory shadows a file of the same name (as mountpoint-s3 does)
        return cls(listed_at, files, dirs)

    def names(self) -> list[str]:
        return sorted(self.dirs | self.files.keys())

    def apply(self, overlay: DirOverlay) -> None:
        """Show what is written but not yet (or only just) listed by the store."""
        for name in overlay.gone_files:
            self.files.pop(name, None)
        self.dirs -= overlay.gone_dirs
        self.dirs |= overlay.dirs
        self.files.update(overlay.files)


class DirHandle:
    __slots__ = ("node", "names", "state")

    def __init__(self, node, state: DirState) -> None:
        self.node = node
        self.state = state
        self.names = state.names()
