"""Manifest parsing of `cachefs warmup --manifest`: lines, CSV, Parquet."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cachefs.errors import UsageError
from warmup.manifest import read_manifest
from warmup.progress import summary


def test_lines_csv_and_parquet(tmp_path):
    (tmp_path / "m.txt").write_text("# comment\na/b.jpg\n\n  c.jpg \n")
    assert read_manifest(str(tmp_path / "m.txt")) == ["a/b.jpg", "c.jpg"]
    (tmp_path / "m.csv").write_text("label,path\n1,x/1.jpg\n2,x/2.jpg\n")
    assert read_manifest(str(tmp_path / "m.csv")) == ["x/1.jpg", "x/2.jpg"]
    (tmp_path / "n.csv").write_text("label,where\n1,x/1.jpg\n")
    assert read_manifest(str(tmp_path / "n.csv"), "where") == ["x/1.jpg"]
    with pytest.raises(UsageError, match="no path column"):
        read_manifest(str(tmp_path / "n.csv"))
    pq.write_table(pa.table({"file": ["p/1", "p/2"], "n": [1, 2]}), tmp_path / "m.parquet")
    assert read_manifest(str(tmp_path / "m.parquet")) == ["p/1", "p/2"]
    (tmp_path / "bad.parquet").write_text("nope")
    with pytest.raises(UsageError, match="Parquet"):
        read_manifest(str(tmp_path / "bad.parquet"))
    with pytest.raises(UsageError, match="manifest"):
        read_manifest(str(tmp_path / "missing.txt"))


def test_summary_lists_failures():
    reply = {"state": "done", "dataset": "ds", "files": 3, "bytes": 30, "fetched_files": 1, "fetched_bytes": 10,
             "cached_files": 1, "cached_bytes": 10, "failed_files": 1, "elapsed_s": 2.0, "concurrency": 4,
             "failures": [{"path": "ds/x", "error": "boom"}]}
    text = summary(reply)
    assert "1 fetched" in text and "1 already cached" in text and "ds/x: boom" in text
    assert "again" in summary(reply, interrupted=True)


def test_warmup_request_payload_is_in_the_commands_schema(monkeypatch):
    """What `cachefs warmup` sends passes the daemon's schema for the warmup command (no mount needed)."""
    from cachefs.cli import build_parser
    from cachefs.control.commands import WARM_COMMANDS
    from cachefs.control.protocol import validate_args
    from warmup import cli

    sent = {}
    monkeypatch.setattr(cli, "_payload", lambda args, command: ("/mnt", {"label": "ds", "paths": ["ds"], "globs": []},
                                                                None))
    monkeypatch.setattr(cli, "_warm", lambda mountpoint, payload, args, walk: sent.update(payload) or 0)
    args = build_parser().parse_args(["warmup", "/mnt/ds", "--bandwidth-limit", "200M", "--pin", "--concurrency", "4"])
    assert cli.run(args) == 0
    assert sent["bandwidth_limit"] == 200 << 20 and sent["pin"] is True and sent["concurrency"] == 4
    assert validate_args("warmup", WARM_COMMANDS["warmup"][1], sent) == {k: v for k, v in sent.items() if v is not None}
    bad = build_parser().parse_args(["warmup", "/mnt/ds", "--bandwidth-limit", "lots"])
    with pytest.raises(UsageError, match="--bandwidth-limit"):
        cli.run(bad)
