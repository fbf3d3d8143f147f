"""The progress bar (on a terminal), the final summary and the --check report."""

import sys

from cachefs.control.status_view import size


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class ProgressBar:
    """One line redrawn in place on stderr: files, bytes, MB/s, ETA."""

    def __init__(self, stream=sys.stderr, width: int = 24) -> None:
        self.stream = stream
        self.width = width
        self.drawn = False

    def update(self, r: dict) -> None:
        total = r["bytes"] or 1
        filled = int(self.width * min(1.0, r["done_bytes"] / total)) if r["bytes"] else self.width * (
            r["state"] != "listing")
        bar = "#" * filled + "." * (self.width - filled)
        text = (f"\rwarmup [{bar}] {r['done_files']}/{r['files']} files  {size(r['done_bytes'])}/"
                f"{size(r['bytes'])}  {r['rate_bytes_s'] / 1e6:6.1f} MB/s  ETA {_duration(r['eta_s'])} ")
        if r["state"] == "listing":
            text = "\rwarmup: listing the dataset..."
        self.stream.write(text)
        self.stream.flush()
        self.drawn = True

    def listing(self, listed) -> None:
        """The listing through the mount after a warmup (cachefs/warm/walk.py)."""
        self.stream.write(f"\rwarmup: listing through the mount: {listed.entries} entries, "
                          f"{listed.directories} directories ")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


def summary(r: dict, interrupted: bool = False) -> str:
    state = "interrupted" if interrupted else r["state"]
    elapsed = max(r["elapsed_s"], 1e-6)
    lines = [f"warmup of {r['dataset']}: {state} in {elapsed:.1f} s",
             f"  files    {r['files']} ({size(r['bytes'])}): {r['fetched_files']} fetched "
             f"({size(r['fetched_bytes'])}), {r['cached_files']} already cached ({size(r['cached_bytes'])}), "
             f"{r['failed_files']} failed",
             f"  rate     {r['fetched_bytes'] / elapsed / 1e6:.1f} MB/s, {r['fetched_files'] / elapsed:.0f} files/s "
             f"({r['concurrency']} parallel GETs)"]
    if r.get("error_detail"):
        lines.append(f"  reason   {r['error_detail']}")
    for failure in r.get("failures", []):
        lines.append(f"  failed   {failure['path']}: {failure['error']}")
    if r["failed_files"] > len(r.get("failures", [])):
        lines.append(f"  ... and {r['failed_files'] - len(r['failures'])} more")
    if interrupted:
        lines.append("  run the same command again to fetch only what is missing")
    return "\n".join(lines)


def listing_line(listed) -> str:
    errors = f", {listed.errors} could not be listed" if listed.errors else ""
    dirs = f"{listed.directories} director{'y' if listed.directories == 1 else 'ies'}"
    return (f"  listed   {listed.entries} entries in {dirs} through the mount in "
            f"{listed.seconds:.1f} s{errors} (a first epoch opens them with no lookup)")


def check_report(label: str, c: dict) -> str:
    pct = 100.0 * c["cached_bytes"] / c["bytes"] if c["bytes"] else 100.0
    lines = [f"{label}: {c['files']} files, {size(c['bytes'])}; cached {c['cached_files']} files, "
             f"{size(c['cached_bytes'])} ({pct:.1f}%){'; pinned' if c.get('pinned') else ''}"]
    for tier in ("memory", "disk"):
        t = c[tier]
        lines.append(f"  {tier:<7} {t['files']:>8} whole files  {t['blocks']:>8} blocks  {size(t['bytes']):>10}")
    for path in c.get("missing", []):
        lines.append(f"  not found: {path}")
    return "\n".join(lines)
