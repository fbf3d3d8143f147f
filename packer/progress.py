"""Progress of a pack or unpack: a bar on a terminal (stderr), JSON lines with --json (stdout),
nothing with --quiet; and the one-paragraph summary."""

import json
import os
import resource
import sys
import threading
import time

from cachefs.control.status_view import size
from cachefs.host import vm_hwm

_EVERY = 0.5   # seconds between redraws / JSON lines
# A test's hold: after this many shards the command reports its progress and waits there until it
# is interrupted, so a test interrupts it mid-way on any machine, fast or slow (0: never).
_HOLD_ENV = "CACHEFS_TEST_HOLD_AFTER_SHARDS"


class Progress:
    def __init__(self, verb: str, *, json_lines: bool = False, quiet: bool = False, stream=None) -> None:
        self.verb = verb
        self.json_lines = json_lines
        self.quiet = quiet
        self.bar = not quiet and not json_lines and sys.stderr.isatty()
        self.stream = stream or (sys.stdout if json_lines else sys.stderr)
        self.counts = {"files": 0, "bytes": 0, "shards": 0, "done_files": 0, "done_bytes": 0,
                       "done_shards": 0, "skipped_shards": 0}
        self._started = time.monotonic()
        self._last = 0.0
        self._lock = threading.Lock()
        self._drawn = False
        self._hold = int(os.environ.get(_HOLD_ENV, "0") or 0)

    def plan(self, files: int, nbytes: int, shards: int) -> None:
        self.counts.update(files=files, bytes=nbytes, shards=shards)
        self._emit(force=True)

    def file_done(self, nbytes: int) -> None:
        with self._lock:
            self.counts["done_files"] += 1
            self.counts["done_bytes"] += nbytes
        self._emit()

    def shard_done(self, files: int, nbytes: int, skipped: bool = False) -> None:
        with self._lock:
            self.counts["done_shards"] += 1
            if skipped:
                self.counts["skipped_shards"] += 1
                self.counts["done_files"] += files
                self.counts["done_bytes"] += nbytes
        held = self._hold and self.counts["done_shards"] == self._hold
        self._emit(force=held)
        while held:
            time.sleep(3600)          # until Ctrl-C (KeyboardInterrupt) ends the command

    def report(self) -> dict:
        elapsed = time.monotonic() - self._started
        return {**self.counts, "elapsed_s": round(elapsed, 3),
                "rate_bytes_s": round(self.counts["done_bytes"] / max(elapsed, 1e-6))}

    def _emit(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < _EVERY:
            return
        self._last = now
        if self.json_lines:
            self._line({"event": "progress", "command": self.verb, **self.report()})
        elif self.bar:
            self._draw(self.report())

    def _draw(self, r: dict) -> None:
        total = r["bytes"] or 1
        filled = int(24 * min(1.0, r["done_bytes"] / total))
        self.stream.write(f"\r{self.verb} [{'#' * filled}{'.' * (24 - filled)}] {r['done_files']}/{r['files']} "
                          f"files  {size(r['done_bytes'])}/{size(r['bytes'])}  shards {r['done_shards']}/"
                          f"{r['shards']}  {r['rate_bytes_s'] / 1e6:6.1f} MB/s ")
        self.stream.flush()
        self._drawn = True

    def _line(self, record: dict) -> None:
        self.stream.write(json.dumps(record) + "\n")
        self.stream.flush()

    def finish(self, summary: dict, text: str) -> None:
        """The final summary: a JSON line or text on stderr (unless quiet)."""
        if self._drawn:
            self.stream.write("\n")
            self._drawn = False
        if self.json_lines:
            self._line({"event": "summary", "command": self.verb, **self.report(), **summary,
                        "peak_rss_bytes": peak_rss()})
        elif not self.quiet:
            print(text, file=sys.stderr)


def peak_rss() -> int:
    """This process's peak resident set, in bytes: VmHWM, the high-water mark of its own memory
    since it exec'd. Not ``getrusage``'s ``ru_maxrss``: on Linux that also counts what the parent
    had resident when it spawned this process (exec records the forked copy's high-water mark),
    so a packer started from a 500 MiB process reads 500 MiB there."""
    own = vm_hwm()
    if own is not None:
        return own
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # no /proc: the best there is
