"""A finished shard's index fragment (its rows, its shard row, the plan fingerprint), and a
worker's commit marker."""

import json
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from cachefs.errors import NoSuchKey
from cachefs.packfmt import FILES_SCHEMA, CorruptIndex
from cachefs.packfmt.index import parquet_bytes, read_table
from cachefs.packfmt.store_index import read_object
from cachefs.store import ObjectStore

_SHARD_KEY = b"cachefs.shard"
_PLAN_KEY = b"cachefs.fingerprint"


def fragment_bytes(rows: list[dict], shard_row: dict, fingerprint: str) -> bytes:
    table = pa.Table.from_pylist(rows, schema=FILES_SCHEMA)
    table = table.replace_schema_metadata({_SHARD_KEY: json.dumps(shard_row).encode(),
                                           _PLAN_KEY: fingerprint.encode()})
    return parquet_bytes(table)


def read_fragment(store: ObjectStore, path: str) -> tuple[pa.Table, dict, str] | None:
    """(rows, shard row, fingerprint), or None if the fragment does not exist."""
    try:
        data = read_object(store, path)
    except NoSuchKey:
        return None
    meta = pq.read_schema(pa.BufferReader(data)).metadata or {}
    if _SHARD_KEY not in meta or _PLAN_KEY not in meta:
        raise CorruptIndex(f"{path}: not a cachefs pack fragment")
    rows = read_table(data, FILES_SCHEMA, path).replace_schema_metadata(None)
    return rows, json.loads(meta[_SHARD_KEY]), meta[_PLAN_KEY].decode()


@dataclass
class WorkerMarker:
    fingerprint: str
    source: str
    generation: int
    worker_index: int
    worker_count: int
    first_shard: int
    total_shards: int
    deleted: list[str]
    written: float = 0.0      # time.time() when committed: the latest run decides what --merge merges

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> "WorkerMarker":
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError) as exc:
            raise CorruptIndex(f"{where}: malformed worker commit marker") from exc
