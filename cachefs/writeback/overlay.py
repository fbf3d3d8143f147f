"""What the write-back shows under one directory before (or just after) the store has it: the
answer to the namespace's one question, "what is staged under this path?", as plain data."""

from collections.abc import Iterable
from dataclasses import dataclass, field

from cachefs.store import ObjectInfo
from cachefs.writeback.journal import DELETE, MKDIR, RMDIR
from cachefs.writeback.staged import PendingOp, StagedFile


@dataclass(slots=True)
class DirOverlay:
    """Changes to a store listing of one directory: hide ``gone_*`` first, then add the rest."""

    files: dict[str, ObjectInfo] = field(default_factory=dict)   # name -> staged size and mtime
    dirs: set[str] = field(default_factory=set)
    gone_files: set[str] = field(default_factory=set)            # deleted, the tombstone pending
    gone_dirs: set[str] = field(default_factory=set)             # removed, the marker delete pending


def staged_info(entry: StagedFile) -> ObjectInfo:
    return ObjectInfo(entry.path, entry.size, entry.mtime, "")


def overlay(path: str, files: Iterable[StagedFile], ops: Iterable[PendingOp]) -> DirOverlay:
    """The overlay of directory ``path`` ("" for the root) from staged files and pending operations."""
    prefix = path + "/" if path else ""
    found = DirOverlay()
    for op in ops:
        target, kind = op.record.path, op.record.kind
        parent, _, name = target.rpartition("/")
        if parent == path:
            if kind == DELETE:
                found.gone_files.add(name)
            elif kind == RMDIR:
                found.gone_dirs.add(name)
            else:
                found.dirs.add(name)
        elif kind == MKDIR and target.startswith(prefix):
            found.dirs.add(target[len(prefix):].split("/", 1)[0])
    for entry in files:
        if entry.path.startswith(prefix):
            rest = entry.path[len(prefix):]
            if "/" in rest:
                found.dirs.add(rest.split("/", 1)[0])
            else:
                found.files[rest] = staged_info(entry)
    return found
