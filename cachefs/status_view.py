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
             f"  cache dir {status['cache_dir']}" + ("  (immutable)" if status.get("immutable") else "")]
    for tier in ("memory", "disk"):
        t = status["tiers"][tier]
        used = f"{size(t.get('used_bytes'))} / {size(t.get('capacity_bytes', t.get('capacity')))}"
        extra = f"  health {t['health']}" if "health" in t else ""
        lines.append(f"  {tier:<7} {used:<24} {t.get('blocks', 0):>8} blocks  hit ratio "
                     f"{ratio(t['hit_ratio']):>6} ({t['hits']} hits, {t['misses']} misses){extra}")
    requests = ", ".join(f"{k}: {v}" for k, v in sorted(status["store_requests"].items())) or "none"
    lines.append(f"  store   read {size(status['store_read_bytes'])}; requests {requests}")
    lines.append(f"  served  {size(status['read_bytes'])} to readers; corrupt blocks dropped: "
                 f"{status['corrupt_blocks']}")
    lines.append(f"  metrics {'http://' + status['metrics'] + '/metrics' if status['metrics'] else 'off'}")
    return "\n".join(lines)
