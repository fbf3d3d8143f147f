"""The source listing: every object below SRC, checked for names a tree cannot hold, sorted."""

import os
from dataclasses import dataclass

from cachefs.packfmt import BadName
from cachefs.store import ObjectStore

_FORBIDDEN_CHARS = ("\n", "\r", "\x00")
DEFAULT_MODE = 0o100644


@dataclass(frozen=True, slots=True)
class SourceFile:
    path: str
    size: int
    mtime: float
    etag: str
    mode: int = DEFAULT_MODE


def list_source(store: ObjectStore, root: str | None) -> list[SourceFile]:
    """Sorted, checked listing; ``root`` (a local directory) also gives each file's mode."""
    files = [SourceFile(o.path, o.size, o.mtime, o.etag, _mode(root, o.path)) for o in store.list_all("")]
    files.sort(key=lambda f: f.path)
    check_names([f.path for f in files])
    return files


def _mode(root: str | None, path: str) -> int:
    if root is None:
        return DEFAULT_MODE
    try:
        return os.stat(os.path.join(root, path)).st_mode
    except OSError:
        return DEFAULT_MODE


def check_name(path: str) -> None:
    shown = path.encode("unicode_escape").decode()
    if any(c in path for c in _FORBIDDEN_CHARS):
        raise BadName(f"source name {shown!r} holds a newline or NUL: it cannot be packed")
    if path.startswith("/"):
        raise BadName(f"source name {shown!r} is absolute: it cannot be packed")
    parts = path.split("/")
    if any(part in ("..", ".") for part in parts):
        raise BadName(f"source name {shown!r} holds a '.' or '..' component: it cannot be packed")
    if any(part == "" for part in parts):
        raise BadName(f"source name {shown!r} holds an empty component ('//'): it cannot be packed")


def check_names(sorted_paths: list[str]) -> None:
    """Each name is a plain relative path; no duplicates; no name both a file and a directory."""
    for path in sorted_paths:
        check_name(path)
    names = set(sorted_paths)
    if len(names) != len(sorted_paths):
        dup = next(a for a, b in zip(sorted_paths, sorted_paths[1:], strict=False) if a == b)
        raise BadName(f"source name {dup!r} appears twice: it cannot be packed")
    for path in sorted_paths:
        parent = path.rpartition("/")[0]
        while parent:
            if parent in names:
                raise BadName(f"source name {parent!r} is both a file and a directory: it cannot be packed")
            parent = parent.rpartition("/")[0]
