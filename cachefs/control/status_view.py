"""Human-readable rendering of a daemon's status (``cachefs status``)."""


def size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def render(status: dict) -> str:
    lines = [f"cachefs {status['version']}  pid {status['pid']}  up {status['uptime_s']:.0f}s",
             f"  {status['url']} -> {status['mountpoint']}",
             f"  cache dir {status['cache_dir']}" + ("  (immutable)" if status.get("immutable") else "")
             + (f"  blocks of {size(status['block_size'])}" if status.get("block_size") else "")]
    for tier in ("memory", "disk"):
        t = status["tiers"][tier]
        used = f"{size(t.get('used_bytes'))} / {size(t.get('capacity_bytes', t.get('capacity')))}"
        extra = f"  health {t['health']}" if "health" in t else ""
        extra += f"  writes {t['writes']}" if "writes" in t else ""
        lines.append(f"  {tier:<7} {used:<24} {t.get('blocks', 0):>8} blocks  hit ratio "
                     f"{ratio(t['hit_ratio']):>6} ({t['hits']} hits, {t['misses']} misses){extra}")
    requests = ", ".join(f"{k}: {v}" for k, v in sorted(status["store_requests"].items())) or "none"
    lines.append(f"  store   read {size(status['store_read_bytes'])}; requests {requests}")
    lines.append(f"  served  {size(status['read_bytes'])} to readers; corrupt blocks dropped: "
                 f"{status['corrupt_blocks']}")
    lines.append(f"  metrics {'http://' + status['metrics'] + '/metrics' if status['metrics'] else 'off'}")
    lines.extend(_fuse_lines(status.get("fuse"), status.get("open_files")))
    listing = status.get("listing")
    if listing and listing["state"] == "skipped":
        lines.append("  listing ahead skipped: the saved listings are fresh")
    elif listing:
        lines.append(f"  listing ahead {listing['state']}: {listing['folders']} folders in {listing['seconds']:.2f} s, "
                     f"{listing['taken']} taken (--list-ahead {listing['limit']} objects)")
    if loader := status.get("loader_fds"):
        lines.append(f"  local loaders: {loader['served']} cache files handed over, {loader.get('warms', 0)} shard "
                     f"warms asked for ({loader['socket']})")
    lines.extend(_writeback_lines(status.get("writeback")))
    lines.extend(_warmup_lines(status.get("warmup")))
    return "\n".join(lines)


def _fuse_lines(fuse: dict | None, open_files: int | None) -> list[str]:
    """The FUSE layer: backend, protocol, passthrough, requests read, open files; the loop's poll
    (``--fuse-poll-us``); the request loop processes and what the daemon answered from their
    table, where they are kept."""
    if not fuse:
        return []
    head = fuse.get("backend", "?") + (f" (FUSE {fuse['protocol']})" if fuse.get("protocol") else "")
    head += ", passthrough " + ("on" if fuse.get("passthrough") else "off")
    if "requests" in fuse:
        head += f", {fuse['requests']} requests read"
    lines = [f"  fuse    {head}; {open_files if open_files is not None else '-'} files open"]
    if poll := fuse.get("poll"):
        lines.append(f"  poll    {poll['window_us']:g} of {poll['ceiling_us']:g} us now; {poll['found']} requests found "
                     f"with no wake-up; gave its CPU away {poll['yielded']} times, held back {poll['busy']} "
                     f"times (every CPU busy)")
    table = fuse.get("loop_processes")
    if table:
        loops = table["loops"]
        if loops:
            running = sum(1 for loop in loops if loop["running"])
            lines.append(f"  loops   {running} of {len(loops)} loop processes running: "
                         f"{sum(loop['opens'] for loop in loops)} opens answered, "
                         f"{table['forwarded']} requests forwarded to the daemon")
        lines.append(f"  table   {table['published']} backings published; {table['daemon']['opens']} opens "
                     f"answered from it by the daemon")
    return lines


def _writeback_lines(wb: dict | None) -> list[str]:
    if wb is None:
        return ["  writes  refused (read-only mount)"]
    lines = [f"  staging {size(wb['staged_bytes'])} / {size(wb['staging_size'])} in {wb['staged_files']} files; "
             f"{wb['pending_operations']} pending deletes/directories"]
    for cls, c in wb["classes"].items():
        age = "-" if c["oldest_dirty_age_s"] is None else f"{c['oldest_dirty_age_s']:.0f}s"
        lines.append(f"  {cls:<10} dirty {size(c['dirty_bytes']):>10} in {c['dirty_files']} files, oldest {age}, "
                     f"uploading {c['uploading']}, failing {c['failing']}")
    for error in wb.get("errors", []):
        lines.append(f"  upload error: {error}")
    return lines


def pending_line(pending: dict) -> str:
    """'3 files (12.0 MiB), 1 operation, 1 failing' for ``cachefs sync``."""
    if not pending:
        return "unknown"
    text = f"{pending.get('files', 0)} files ({size(pending.get('bytes', 0))}), {pending.get('operations', 0)} operations"
    if pending.get("failing"):
        text += f", {pending['failing']} failing: {'; '.join(pending.get('errors', []))}"
    return text


def _warmup_lines(w: dict | None) -> list[str]:
    """One line per running warmup (files, bytes, rate), else the last one; the pins."""
    if not w:
        return []
    lines = []
    for r in w["running"] or ([w["last"]] if w.get("last") else []):
        lines.append(f"  warmup  {r['dataset']}: {r['state']}, {r['done_files']}/{r['files']} files, "
                     f"{size(r['done_bytes'])}/{size(r['bytes'])}, {r['rate_bytes_s'] / 1e6:.1f} MB/s, "
                     f"{r['failed_files']} failed")
    if w.get("pinned"):
        lines.append(f"  pinned  {len(w['pinned'])} dataset(s), {sum(w['pinned'].values())} blocks")
    shards = w.get("shard_warm")
    if shards and shards["shards"]:
        lines.append(f"  shards  {shards['shards']} read, {size(shards['bytes'])} warmed whole or queued "
                     f"({shards['running']} running, {shards['queued']} queued, {shards['over_budget']} over "
                     f"the {size(shards['budget'])} budget)")
    return lines
