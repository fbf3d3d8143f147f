"""``cachefs status`` as people read it: the FUSE layer's lines (backend, passthrough, open files,
loop processes and the daemon's answers from their table)."""

from cachefs.control.status_view import render


def status(fuse: dict | None, open_files: int = 0) -> dict:
    tier = {"used_bytes": 1 << 20, "capacity_bytes": 1 << 30, "blocks": 3, "hit_ratio": 0.5, "hits": 1, "misses": 1}
    return {"version": "0", "pid": 1, "uptime_s": 5.0, "url": "s3://b/p", "mountpoint": "/mnt", "cache_dir": "/c",
            "tiers": {"memory": tier, "disk": tier}, "store_requests": {}, "store_read_bytes": 0, "read_bytes": 0,
            "corrupt_blocks": 0, "metrics": None, "open_files": open_files, "fuse": fuse, "writeback": None}


def test_the_fuse_line_names_the_backend_passthrough_and_open_files():
    text = render(status({"backend": "cachefs", "protocol": "7.45", "passthrough": True, "requests": 30113,
                          "loop_processes": None}, open_files=2))
    assert "  fuse    cachefs (FUSE 7.45), passthrough on, 30113 requests read; 2 files open" in text
    assert "table" not in text and "loops " not in text and "poll " not in text
    text = render(status({"backend": "pyfuse3", "passthrough": False}))
    assert "  fuse    pyfuse3, passthrough off; 0 files open" in text


def test_the_loops_poll_is_shown_where_it_runs():
    poll = {"window_us": 50.0, "ceiling_us": 200.0, "found": 812, "grown": 9, "shrunk": 7, "yielded": 3, "busy": 41}
    text = render(status({"backend": "cachefs", "protocol": "7.45", "passthrough": True, "requests": 900,
                          "poll": poll}))
    assert ("  poll    50 of 200 us now; 812 requests found with no wake-up; gave its CPU away 3 times, "
            "held back 41 times (every CPU busy)") in text


def test_loop_processes_and_the_table_are_shown_where_kept():
    loop = {"pid": 7, "running": True, "reading": True, "opens": 40, "releases": 40, "ioctls": 0, "forwarded": 3}
    fuse = {"backend": "cachefs", "protocol": "7.45", "passthrough": True, "requests": 10,
            "loop_processes": {"loops": [loop, {**loop, "running": False, "opens": 2}], "forwarded": 5,
                               "daemon": {"opens": 9, "releases": 9}, "open_files": 1, "published": 12}}
    text = render(status(fuse))
    assert "  loops   1 of 2 loop processes running: 42 opens answered, 5 requests forwarded to the daemon" in text
    assert "  table   12 backings published; 9 opens answered from it by the daemon" in text
    fuse["loop_processes"]["loops"] = []                      # the table alone (no extra loop)
    text = render(status(fuse))
    assert "loops " not in text and "  table   12 backings published; 9 opens" in text


def test_a_status_without_fuse_renders():
    assert "  fuse " not in render(status(None))
