"""Bad-input fuzzing, with Hypothesis: config files and flags of `cachefs mount`, the
write-back journal's records, the listing snapshot and ListObjectsV2 answers. Each input either
works or is refused with a one-line message and a documented exit code (2 for bad config); never a
traceback, never wrong data, never lost staged data the daemon can still read.

``CACHEFS_FUZZ_EXAMPLES`` (default 200) sets the examples per property; the inputs tried are
recorded in docs/reliability.md (the bugs it found there are fixed; their properties now pass)."""

import dataclasses
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachefs.cli import build_parser, config_from_args
from cachefs.config import MountConfig, option_fields
from cachefs.errors import ConfigError, ExitCode

EXAMPLES = int(os.environ.get("CACHEFS_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
OPTIONS = [f.name for f in option_fields()]


def _list_parser():
    """Our ListObjectsV2 parser."""
    from cachefs.store.s3.requests import parse_list_page
    return parse_list_page


# ---- config files and flags ----------------------------------------------------------------------
toml_scalars = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1), st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(), st.text(max_size=20), st.sampled_from(["512M", "50G", "1.5T", "0644", "0", "-1", "inf", ""]))
toml_values = st.one_of(toml_scalars, st.lists(toml_scalars, max_size=3))


def toml_literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(value), repr(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)        # a TOML basic string is JSON-compatible for these characters
    return "[" + ", ".join(toml_literal(v) for v in value) + "]"


def mount_config(tmp_path: Path, toml_text: str | None, flags: list[str]) -> MountConfig:
    argv = ["mount", "s3://bucket/prefix", str(tmp_path / "mnt")]
    if toml_text is not None:
        (tmp_path / "c.toml").write_text(toml_text)
        argv += ["--config", str(tmp_path / "c.toml")]
    return config_from_args(build_parser().parse_args(argv + flags))


def refused_cleanly(exc: ConfigError) -> None:
    message = str(exc)
    assert message and "\n" not in message and exc.exit_code == ExitCode.USAGE


@FUZZ
@given(st.dictionaries(st.one_of(st.sampled_from(OPTIONS), st.text(min_size=1, max_size=12)), toml_values,
                       max_size=5))
def test_config_file_values_work_or_are_refused_in_one_line(tmp_path_factory, values):
    tmp_path = tmp_path_factory.mktemp("cfg")
    lines = [f"{json.dumps(key)} = {toml_literal(value)}" for key, value in values.items()]
    try:
        cfg = mount_config(tmp_path, "\n".join(lines), [])
    except ConfigError as exc:
        refused_cleanly(exc)
        return
    assert isinstance(cfg, MountConfig)
    for key in values:                       # what was accepted is what the config holds, validated
        assert key.replace("-", "_") in OPTIONS


@FUZZ
@given(st.binary(max_size=300))
def test_config_file_bytes_work_or_are_refused_in_one_line(tmp_path_factory, raw):
    tmp_path = tmp_path_factory.mktemp("cfgb")
    (tmp_path / "c.toml").write_bytes(raw)
    try:
        config_from_args(build_parser().parse_args(["mount", "s3://b/p", str(tmp_path / "m"), "--config",
                                                    str(tmp_path / "c.toml")]))
    except ConfigError as exc:
        refused_cleanly(exc)


flag_values = st.one_of(st.text(max_size=12), st.sampled_from(["0", "-1", "1e309", "nan", "inf", "64K", "0o644",
                                                              "9" * 30, "true", "remote"]))


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(OPTIONS), flag_values), max_size=4))
def test_mount_flags_work_or_are_refused_in_one_line(tmp_path_factory, pairs):
    tmp_path = tmp_path_factory.mktemp("flags")
    bools = {f.name for f in option_fields() if "bool" in str(f.type)}
    flags = []
    for name, value in pairs:
        flag = "--" + name.replace("_", "-")
        flags += [flag] if name in bools else [f"{flag}={value}"]
    try:
        mount_config(tmp_path, None, flags)
    except ConfigError as exc:
        refused_cleanly(exc)
    except SystemExit as exc:                # argparse: usage error
        assert exc.code == ExitCode.USAGE


@pytest.mark.parametrize("toml_text, flags", [
    ("cache_size = \"lots\"", []), ("block_size = \"3K\"", []), ("nonsense = 1", []), ("= broken", []),
    (None, ["--max-fetches=0"]), (None, ["--fsync=sometimes"]), (None, ["--read-timeout=nan"]),
])
def test_real_cachefs_mount_refuses_bad_config_with_exit_2(tmp_path, toml_text, flags):
    argv = [sys.executable, "-m", "cachefs", "mount", "s3://bucket/prefix", str(tmp_path)]
    if toml_text is not None:
        (tmp_path / "c.toml").write_text(toml_text)
        argv += ["--config", str(tmp_path / "c.toml")]
    result = subprocess.run(argv + flags, capture_output=True, text=True, timeout=120)
    assert result.returncode == ExitCode.USAGE, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr
    assert lines[-1].startswith("cachefs: error: ") and len([ln for ln in lines if "error" in ln]) == 1


def test_nonfinite_timeouts_and_periods_are_refused(tmp_path):
    """Found by the fuzzer: inf/nan passed validation (nan compares false both ways)."""
    for flag in ("--read-timeout=inf", "--connect-timeout=nan", "--metadata-ttl=nan", "--staging-wait=inf",
                 "--log-sync-period=nan", "--drain-timeout=nan", "--free-space-ratio=nan"):
        with pytest.raises(ConfigError) as info:
            mount_config(tmp_path, None, [flag])
        refused_cleanly(info.value)


# ---- ListObjectsV2 answers -----------------------------------------------------------------------
ALLOWED_LIST_ERRORS = (ET.ParseError, ValueError, KeyError)     # what list_page turns into a clean error
text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=12)
fields = {"Key": text, "Size": st.one_of(st.integers(-5, 10**12).map(str), text),
          "LastModified": st.one_of(st.just("2024-05-01T10:00:00.000Z"), st.just("2024-05-01T10:00:00+02:00"),
                                    text),
          "ETag": text}


@st.composite
def list_answers(draw) -> bytes:
    parts = ["<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"]
    if draw(st.booleans()):
        parts.append(f"<EncodingType>{draw(st.sampled_from(['url', 'URL', 'none', '']))}</EncodingType>")
    parts.append(f"<IsTruncated>{draw(st.sampled_from(['true', 'false', 'maybe', '']))}</IsTruncated>")
    for _ in range(draw(st.integers(0, 3))):
        chosen = draw(st.lists(st.sampled_from(sorted(fields)), unique=True))
        body = "".join(f"<{name}>{escape(draw(fields[name]))}</{name}>" for name in chosen)
        parts.append(f"<Contents>{body}</Contents>")
    for _ in range(draw(st.integers(0, 2))):
        prefix = draw(st.one_of(st.none(), text))
        parts.append("<CommonPrefixes>" + ("" if prefix is None else f"<Prefix>{escape(prefix)}</Prefix>")
                     + "</CommonPrefixes>")
    if draw(st.booleans()):
        parts.append(f"<NextContinuationToken>{escape(draw(text))}</NextContinuationToken>")
    parts.append("</ListBucketResult>")
    return "".join(parts).encode()


def escape(value: str) -> str:
    return value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def check_page(page) -> None:
    for item in page.objects:
        assert isinstance(item.key, str) and isinstance(item.size, int) and isinstance(item.mtime, float)
        assert item.size >= 0, f"negative size accepted: {item}"
    for prefix in page.prefixes:
        assert isinstance(prefix, str) and prefix != "None", f"invented prefix: {prefix}"


@FUZZ
@given(st.binary(max_size=400))
def test_list_parser_on_arbitrary_bytes(body):
    parse = _list_parser()
    try:
        check_page(parse(body))
    except ALLOWED_LIST_ERRORS:
        pass


@FUZZ
@given(list_answers())
def test_list_parser_on_odd_answers(body):
    parse = _list_parser()
    try:
        page = parse(body)
    except ALLOWED_LIST_ERRORS:
        return
    check_page(page)


# ---- the journal's records -----------------------------------------------------------------------
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), text),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                           max_leaves=6)
record_fields = st.fixed_dictionaries({}, optional={
    "v": st.one_of(st.just(1), json_values), "id": st.one_of(st.just("00000000000000aa"), json_values),
    "seq": st.one_of(st.just("00000000000000ab"), json_values),
    "kind": st.one_of(st.sampled_from(["file", "delete", "mkdir", "rmdir"]), json_values),
    "path": st.one_of(st.just("a/b.log"), json_values), "created": st.one_of(st.just(1.5), json_values)})


def replay_with(tmp_path: Path, raw: bytes):
    from cachefs.writeback.journal import Journal
    journal = Journal(str(tmp_path))
    (tmp_path / "records" / "00000000000000aa.json").write_bytes(raw)
    (tmp_path / "data" / "00000000000000aa").write_bytes(b"staged bytes")
    return journal.replay()


@pytest.mark.allow_warnings
@FUZZ
@given(st.one_of(json_values.map(lambda v: json.dumps(v).encode()), record_fields.map(lambda d: json.dumps(d).encode()),
                 st.binary(max_size=80)))
def test_journal_replay_survives_any_record(tmp_path_factory, raw):
    tmp_path = tmp_path_factory.mktemp("journal")
    live = replay_with(tmp_path, raw)
    for record in live:                      # a record kept is a sane one
        assert isinstance(record.path, str) and record.path not in ("", "None")
    if not live:                             # a record refused is kept aside, its data not lost
        assert list((tmp_path / "records").glob("*.bad")) or not (tmp_path / "records").glob("*")


@pytest.mark.allow_warnings     # the journal logs each record it keeps aside
def test_journal_replay_keeps_a_good_record_beside_a_bad_one(tmp_path):
    from cachefs.writeback.journal import Journal, Record
    journal = Journal(str(tmp_path))
    good = Record(0x10, 0x10, "file", "ok.log", 1.0)
    (tmp_path / "records" / "0000000000000010.json").write_bytes(good.to_json())
    (tmp_path / "data" / "0000000000000010").write_bytes(b"keep me")
    (tmp_path / "records" / "0000000000000011.json").write_bytes(b"{not json")
    (tmp_path / "records" / "0000000000000012.json").write_bytes(b"")
    assert [r.path for r in journal.replay()] == ["ok.log"]
    assert (tmp_path / "data" / "0000000000000010").read_bytes() == b"keep me"
    assert sorted(p.name for p in (tmp_path / "records").glob("*.bad")) == [
        "0000000000000011.json.bad", "0000000000000012.json.bad"]


# ---- corrupted cache dirs under a real mount ------------------------------------------------------
def staged_cache(tmp_path: Path) -> Path:
    """A cache dir holding one good staged file (a crash left it) and the snapshot dir."""
    from cachefs.writeback.journal import Record
    cache = tmp_path / "cache"
    for sub in ("staging/records", "staging/data", "meta"):
        (cache / sub).mkdir(parents=True)
    good = Record(0x20, 0x20, "file", "kept.log", 1.0)
    (cache / "staging/records/0000000000000020.json").write_bytes(good.to_json())
    (cache / "staging/data/0000000000000020").write_bytes(b"staged before the crash\n")
    return cache


CORRUPTIONS = {
    "garbage record": lambda c: (c / "staging/records/0000000000000021.json").write_bytes(b"\x00\xffgarbage"),
    "truncated record": lambda c: (c / "staging/records/0000000000000022.json").write_bytes(b'{"v": 1, "id": "00'),
    "record without data": lambda c: (c / "staging/records/0000000000000023.json").write_bytes(
        b'{"v": 1, "id": "0000000000000023", "seq": "0000000000000023", "kind": "file", "path": "x", "created": 1}'),
    "unknown record kind": lambda c: (c / "staging/records/0000000000000024.json").write_bytes(
        b'{"v": 1, "id": "0000000000000024", "seq": "0000000000000024", "kind": "link", "path": "x", "created": 1}'),
    "stray temp record": lambda c: (c / "staging/records/0000000000000025.json.1.tmp").write_bytes(b"{"),
    "orphan data": lambda c: (c / "staging/data/0000000000000026").write_bytes(b"never acknowledged"),
    "garbage snapshot": lambda c: [(c / "meta" / f"listing-{i}.sqlite").write_bytes(os.urandom(5000))
                                   for i in range(2)],
}


@pytest.mark.fuse
@pytest.mark.allow_warnings
@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_mount_on_a_corrupted_cache_dir_starts_and_keeps_staged_data(s3_server, bucket, mount_factory, tmp_path,
                                                                      corruption):
    from mounts import cachefs

    from testing.s3 import s3_client
    cache = staged_cache(tmp_path)
    CORRUPTIONS[corruption](cache)
    mnt = mount_factory(f"s3://{bucket}/out", "--endpoint-url", s3_server.endpoint_url, cache_dir=cache)
    result = mnt.try_start()
    assert "Traceback" not in result.stderr
    assert result.returncode == 0, result.stderr
    assert (mnt / "kept.log").read_bytes() == b"staged before the crash\n"
    assert cachefs("sync", str(mnt.path), "--wait", "--timeout", "60").returncode == 0
    body = s3_client(s3_server.endpoint_url).get_object(Bucket=bucket, Key="out/kept.log")["Body"].read()
    assert body == b"staged before the crash\n"
    assert "Traceback" not in (cache / "cachefs.log").read_text()


def test_options_are_all_fuzzed():
    """The fuzzers draw option names from the dataclass: a new option is fuzzed without edits here."""
    assert set(OPTIONS) == {f.name for f in dataclasses.fields(MountConfig)} - {"url", "mountpoint"}
