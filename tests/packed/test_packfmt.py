"""The packed format on its own: TFRecord framing and crcs, the Example payload, the Parquet index
and its validation, the manifest; interop with the `tfrecord` package's reader."""

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cachefs.metrics import Metrics
from cachefs.packfmt import (
    FILES_SCHEMA,
    MANIFEST,
    SHARDS_SCHEMA,
    CorruptIndex,
    CorruptRecord,
    Manifest,
    PackedIndex,
    UnknownVersion,
    is_packed,
    open_index,
    write_manifest,
)
from cachefs.packfmt.index import table_bytes
from cachefs.packfmt.shard import ShardBuilder
from cachefs.packfmt.sidecar import parse_idx
from cachefs.packfmt.tfrecord import (
    crc32c,
    decode_example,
    encode_example,
    example_fields,
    frame,
    iter_records,
    masked_crc,
    record_layout,
    unframe,
)
from cachefs.store import open_store

FILES = {"a/x.bin": b"x" * 1000, "a/y.bin": bytes(range(256)) * 3, "b.txt": b"", "c/d/e": b"hello\n" * 50,
         "big": bytes(300_000)}


def build(files: dict[str, bytes], number: int = 0) -> tuple[bytes, ShardBuilder]:
    builder = ShardBuilder(number)
    shard = b"".join(builder.add(p, files[p], mtime=1.5, mode=0o100644, etag=f"e-{p}") for p in sorted(files))
    return shard, builder


def test_crc32c_and_masking_match_the_reference_values():
    assert crc32c(b"123456789") == 0xE3069283
    crc = 0xE3069283
    assert masked_crc(b"123456789") == (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def test_frame_roundtrip_and_each_damage_is_detected():
    record = frame(b"payload bytes")
    assert bytes(unframe(record)) == b"payload bytes"
    for position in (0, 9, 14, len(record) - 1):   # length, length crc, data, data crc
        damaged = bytearray(record)
        damaged[position] ^= 0x01
        with pytest.raises(CorruptRecord):
            unframe(bytes(damaged))
    with pytest.raises(CorruptRecord):
        list(iter_records(io.BytesIO(record[:-3])))


def test_example_payload_keeps_the_data_as_its_tail_and_decodes():
    payload, at = encode_example(b"dir/file.jpg", b"\x00\x01data")
    assert payload[at:] == b"\x00\x01data"
    assert example_fields(payload) == (b"dir/file.jpg", b"\x00\x01data")
    length, data_at = record_layout(b"dir/file.jpg", 6)
    assert length == len(frame(payload)) and data_at == 12 + at
    spans = decode_example(payload)
    assert set(spans) == {"path", "data"}


def test_example_payload_parses_with_protobuf():
    from tfrecord import example_pb2

    data = bytes(range(256)) * 1000    # multi-byte varint lengths
    payload, _ = encode_example(b"p/q", data)
    example = example_pb2.Example()
    example.ParseFromString(payload)
    assert example.features.feature["path"].bytes_list.value == [b"p/q"]
    assert example.features.feature["data"].bytes_list.value == [data]
    assert example_fields(example.SerializeToString()) == (b"p/q", data)


def test_shard_rows_point_at_the_data(tmp_path):
    shard, builder = build(FILES)
    assert builder.size == len(shard)
    assert [p for p, _ in ((r["path"], 0) for r in builder.rows)] == sorted(FILES)
    for row in builder.rows:
        assert shard[row["data_offset"]:row["data_offset"] + row["data_length"]] == FILES[row["path"]]
        assert row["crc32c"] == crc32c(FILES[row["path"]])
        record = shard[row["record_offset"]:row["record_offset"] + row["record_length"]]
        assert example_fields(bytes(unframe(record)))[1] == FILES[row["path"]]
    read = [(offset, example_fields(bytes(payload))) for offset, payload in iter_records(io.BytesIO(shard))]
    assert [(o, p.decode(), d) for o, (p, d) in read] == \
        [(r["record_offset"], r["path"], FILES[r["path"]]) for r in builder.rows]
    assert parse_idx(builder.idx_bytes()) == [(r["record_offset"], r["record_length"]) for r in builder.rows]


def test_a_corrupted_byte_in_a_shard_is_detected():
    shard, builder = build(FILES)
    damaged = bytearray(shard)
    damaged[builder.rows[3]["data_offset"] + 5] ^= 0xFF
    with pytest.raises(CorruptRecord, match="data crc32c mismatch"):
        list(iter_records(io.BytesIO(bytes(damaged))))


def test_tfrecord_package_reads_the_shard_with_and_without_the_idx(tmp_path):
    from tfrecord.reader import tfrecord_loader

    shard, builder = build(FILES)
    (tmp_path / "00000.tfrecord").write_bytes(shard)
    (tmp_path / "00000.tfrecord.idx").write_bytes(builder.idx_bytes())
    desc = {"path": "byte", "data": "byte"}
    whole = [(bytes(r["path"]).decode(), bytes(r["data"]))
             for r in tfrecord_loader(str(tmp_path / "00000.tfrecord"), None, desc)]
    assert whole == sorted(FILES.items())
    halves = []
    for part in range(2):
        halves += [(bytes(r["path"]).decode(), bytes(r["data"])) for r in tfrecord_loader(
            str(tmp_path / "00000.tfrecord"), str(tmp_path / "00000.tfrecord.idx"), desc, shard=(part, 2))]
    assert halves == sorted(FILES.items())


# ---- the index -----------------------------------------------------------------------------------
def index_bytes(files: dict[str, bytes]) -> tuple[bytes, bytes, ShardBuilder]:
    _, builder = build(files)
    return table_bytes(builder.rows, FILES_SCHEMA), table_bytes([builder.shard_row("etag")], SHARDS_SCHEMA), builder


def test_index_lookup_and_listing():
    files = {**FILES, "a/sub/z": b"z", "a/sub/zz": b"zz", "a/sub-x": b"dash", "a0": b"zero"}
    files_pq, shards_pq, _ = index_bytes(files)
    index = PackedIndex.from_parquet(files_pq, shards_pq)
    assert len(index) == len(files)
    assert index.find("a/y.bin") is not None and index.entry(index.find("a/y.bin")).size == 768
    assert index.find("a") is None and index.find("zzz") is None
    assert index.is_dir("a") and index.is_dir("c/d") and not index.is_dir("b.txt")
    rows, dirs = index.list_dir("")
    assert sorted(index.path(r) for r in rows) == ["a0", "b.txt", "big"] and dirs == ["a", "c"]
    rows, dirs = index.list_dir("a")
    assert sorted(index.path(r) for r in rows) == ["a/sub-x", "a/x.bin", "a/y.bin"] and dirs == ["sub"]
    assert index.list_dir("nothing") == ([], [])


def rewrite(files_pq: bytes, change) -> bytes:
    rows = pq.read_table(pa.BufferReader(files_pq)).to_pylist()
    change(rows)
    return table_bytes(rows, FILES_SCHEMA)


@pytest.mark.parametrize("change, message", [
    (lambda rows: rows.reverse(), "not sorted"),
    (lambda rows: rows.insert(1, dict(rows[0])), "not sorted and unique"),
    (lambda rows: rows[1].update(data_offset=rows[1]["data_offset"] + 10**7), "outside"),
    (lambda rows: rows[0].update(record_length=10**9), "outside"),
    (lambda rows: rows[0].update(shard=3), "shard"),
])
def test_index_validation_rejects_bad_tables(change, message):
    files_pq, shards_pq, _ = index_bytes(FILES)
    with pytest.raises(CorruptIndex, match=message):
        PackedIndex.from_parquet(rewrite(files_pq, change), shards_pq)


def test_truncated_foreign_and_mistyped_parquet_are_rejected():
    files_pq, shards_pq, _ = index_bytes(FILES)
    with pytest.raises(CorruptIndex, match="not a readable Parquet"):
        PackedIndex.from_parquet(files_pq[: len(files_pq) // 2], shards_pq)
    foreign = io.BytesIO()
    pq.write_table(pa.table({"name": ["x"], "value": [1]}), foreign)
    with pytest.raises(CorruptIndex, match="missing columns"):
        PackedIndex.from_parquet(foreign.getvalue(), shards_pq)
    table = pq.read_table(pa.BufferReader(files_pq))
    mistyped = io.BytesIO()
    pq.write_table(table.set_column(1, "shard", table.column("shard").cast(pa.string())), mistyped)
    with pytest.raises(CorruptIndex, match="types"):
        PackedIndex.from_parquet(mistyped.getvalue(), shards_pq)


# ---- the manifest --------------------------------------------------------------------------------
def manifest() -> Manifest:
    return Manifest(source="file:///src", tool_version="0.1.0", created=1.0, generation=0, files=5, bytes=10,
                    shards=1, shard_bytes=20, index_files="index/files-g00000.parquet",
                    index_shards="index/shards-g00000.parquet")


def test_manifest_roundtrip_version_and_detection(tmp_path):
    store = open_store(f"file://{tmp_path}", metrics=Metrics())
    assert not is_packed(store)
    files_pq, shards_pq, _ = index_bytes(FILES)
    store.put("index/files-g00000.parquet", files_pq)
    store.put("index/shards-g00000.parquet", shards_pq)
    write_manifest(store, manifest())
    assert is_packed(store)
    loaded, index = open_index(store)
    assert loaded == manifest() and len(index) == len(FILES)
    raw = json.loads((tmp_path / MANIFEST).read_text())
    (tmp_path / MANIFEST).write_text(json.dumps({**raw, "version": 99}))
    with pytest.raises(UnknownVersion, match="version 99"):
        open_index(store)
    (tmp_path / MANIFEST).write_text('{"format": "something-else"}')
    with pytest.raises(CorruptIndex, match="not a cachefs pack manifest"):
        Manifest.from_json((tmp_path / MANIFEST).read_bytes())
    assert not is_packed(store)


def test_rows_by_shard_groups_rows_in_record_order():
    _, first = build({"b": b"1", "d": b"22"}, number=0)
    _, second = build({"a": b"333", "c": b"4444"}, number=1)
    rows = sorted(first.rows + second.rows, key=lambda r: r["path"])
    index = PackedIndex.from_parquet(table_bytes(rows, FILES_SCHEMA), table_bytes(
        [first.shard_row("e0"), second.shard_row("e1")], SHARDS_SCHEMA))
    assert [[index.path(int(i)) for i in group] for group in index.rows_by_shard()] == [["b", "d"], ["a", "c"]]


@pytest.mark.parametrize("path_length", [0, 1, 100, 127, 128, 300, 16383, 16384])
def test_head_length_arithmetic_matches_the_encoding(path_length):
    from cachefs.packfmt.tfrecord import example_head, example_head_length

    for size in (0, 1, 100, 108, 109, 110, 127, 128, 16370, 16383, 16384, 2**21 - 20, 2**21, 2**28, 2**35):
        assert example_head_length(path_length, size) == len(example_head(b"p" * path_length, size)), size
