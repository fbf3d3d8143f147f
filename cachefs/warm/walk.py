"""After a warmup: list the warmed dataset through its mount, so its first epoch sends no LOOKUP.

A loader that opens its files by name (a manifest, a CSV index, a list in a pickle: no listing of
its own) makes the kernel ask the daemon for every file's entry at its first open, a LOOKUP it
waits for. On an ``--immutable`` mount the kernel keeps an entry it was given for a day, so the
warmup lists the dataset once, right after warming it: every entry comes with its attributes
(READDIRPLUS), and the daemon registers each listed file's cache file with the kernel in its idle
moments. The epoch's opens then find their entries in the kernel and their backings in the loops'
table, as a loader that lists first does (ImageFolder).

Client side, not the daemon's (a daemon listing its own mount would wait on itself): `cachefs
warmup` and ``launcher.warm`` (the CSI agent's warmup at stage) call it once the daemon reports
the warmup done. Best effort: an entry that cannot be listed is counted, never an error.
"""

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from cachefs.warm.globs import static_dir

THREADS = 4             # directories listed (and manifest paths looked up) in parallel
_BATCH = 4096           # manifest paths per batch of lookups (bounded memory for a long manifest)


@dataclass
class Listed:
    entries: int = 0            # names the kernel was given (listed, or looked up)
    directories: int = 0
    errors: int = 0             # directories or paths that could not be listed or looked up
    seconds: float = 0.0

    def as_event(self) -> dict:
        return {"event": "listed", "entries": self.entries, "directories": self.directories,
                "errors": self.errors, "seconds": round(self.seconds, 3)}


def list_through(mountpoint: str, paths: list[str], globs: list[str], files: list[str],
                 progress: Callable[[Listed], None] | None = None) -> Listed:
    """List every directory under ``paths`` (mount-relative; "" is the whole mount), the
    directories a glob of ``globs`` can match in, and look up each of ``files`` (a manifest's)."""
    started, tally = time.monotonic(), Listed()
    level = [(os.path.join(mountpoint, p), None) for p in paths]
    level += [(os.path.join(mountpoint, static_dir(g)), _depth(g)) for g in globs]
    pool = ThreadPoolExecutor(THREADS, thread_name_prefix="cachefs-list")
    try:
        for start in range(0, len(files), _BATCH):
            for ok in pool.map(_look_up, [os.path.join(mountpoint, f) for f in files[start:start + _BATCH]]):
                tally.entries += ok
                tally.errors += not ok
            _report(tally, started, progress)
        while level:
            below = []
            for entries, subdirs, kind in pool.map(_scan, level):
                tally.entries += entries
                tally.directories += kind == "dir"
                tally.errors += kind == "error"
                below += subdirs
            level = below
            _report(tally, started, progress)
    finally:                                # Ctrl-C: what is queued is dropped, not waited for
        pool.shutdown(wait=False, cancel_futures=True)
    tally.seconds = time.monotonic() - started
    return tally


def _depth(pattern: str) -> int | None:
    """How many directory levels below a glob's static directory can hold a match (None: any)."""
    parts = pattern.split("/")
    if "**" in parts:
        return None
    static = static_dir(pattern)
    return len(parts) - (len(static.split("/")) if static else 0) - 1


def _scan(item: tuple[str, int | None]) -> tuple[int, list, str]:
    """One directory listed: (entries, its subdirectories to list next, "dir"); a path that is
    a file is looked up instead ("file"); "error" where neither could be done."""
    path, depth = item
    entries, subdirs = 0, []
    try:
        with os.scandir(path) as it:
            for entry in it:
                entries += 1
                if depth != 0 and entry.is_dir(follow_symlinks=False):
                    subdirs.append((entry.path, None if depth is None else depth - 1))
    except NotADirectoryError:
        return (1, [], "file") if _look_up(path) else (0, [], "error")
    except OSError:
        return 0, [], "error"
    return entries, subdirs, "dir"


def _look_up(path: str) -> bool:
    try:
        os.stat(path)
    except OSError:
        return False
    return True


def _report(tally: Listed, started: float, progress: Callable[[Listed], None] | None) -> None:
    if progress is not None:
        tally.seconds = time.monotonic() - started
        progress(tally)
