"""Building one shard: frames records, tracks offsets and the shard's checksum, and yields the
index rows and the ``.idx`` sidecar. Bytes go wherever the caller streams them."""

from cachefs.packfmt.index import shard_name
from cachefs.packfmt.sidecar import render_idx
from cachefs.packfmt.tfrecord import HEADER, crc32c, encode_example, frame


class ShardBuilder:
    def __init__(self, number: int, generation: int = 0) -> None:
        self.number = number
        self.generation = generation
        self.size = 0
        self.checksum = 0          # crc32c of the shard's bytes so far
        self.rows: list[dict] = []

    def add(self, path: str, data: bytes, *, mtime: float, mode: int, etag: str) -> bytes:
        """The framed record of one file (to be written next); its index row is kept."""
        payload, data_in_payload = encode_example(path.encode(), data)
        record = frame(payload)
        self.rows.append({
            "path": path, "shard": self.number, "record_offset": self.size, "record_length": len(record),
            "data_offset": self.size + HEADER + data_in_payload, "data_length": len(data),
            "crc32c": crc32c(data), "size": len(data), "mtime": float(mtime), "mode": int(mode),
            "etag": etag, "generation": self.generation,
        })
        self.size += len(record)
        self.checksum = crc32c(record, self.checksum)
        return record

    def shard_row(self, etag: str) -> dict:
        return {"shard": self.number, "name": shard_name(self.number), "bytes": self.size,
                "records": len(self.rows), "checksum": f"{self.checksum:08x}", "etag": etag,
                "generation": self.generation}

    def idx_bytes(self) -> bytes:
        return render_idx((row["record_offset"], row["record_length"]) for row in self.rows)
