"""Building one shard: frames records, tracks offsets and the shard's checksum, and yields the
index rows and the ``.idx`` sidecar. Bytes go wherever the caller streams them; a large file's
record can be produced from its chunks without holding the file in memory."""

from collections.abc import Iterable, Iterator

from cachefs.packfmt.errors import SourceChanged
from cachefs.packfmt.index import shard_name
from cachefs.packfmt.sidecar import render_idx
from cachefs.packfmt.tfrecord import HEADER, crc32c, example_head, frame_footer, frame_header, frame_length


class ShardBuilder:
    def __init__(self, number: int, generation: int = 0) -> None:
        self.number = number
        self.generation = generation
        self.size = 0
        self.checksum = 0          # crc32c of the shard's bytes so far
        self.rows: list[dict] = []

    def add(self, path: str, data: bytes, *, mtime: float, mode: int, etag: str) -> bytes:
        """The framed record of one file (to be written next); its index row is kept."""
        head = example_head(path.encode(), len(data))
        record = b"".join((frame_header(len(head) + len(data)), head, data,
                           frame_footer(crc32c(data, crc32c(head)))))
        self._row(path, self.size, len(head), len(data), crc32c(data), mtime, mode, etag)
        return self._out(record)

    def add_streamed(self, path: str, size: int, chunks: Iterable[bytes], *, mtime: float, mode: int,
                     etag: str) -> Iterator[bytes]:
        """The record of a ``size``-byte file whose bytes arrive as ``chunks``, piece by piece; the
        index row is kept once the last piece is out. SourceChanged if the chunks are not ``size``."""
        head = example_head(path.encode(), size)
        start, payload_crc, data_crc, seen = self.size, crc32c(head), 0, 0
        yield self._out(frame_header(len(head) + size))
        yield self._out(head)
        for chunk in chunks:
            payload_crc, data_crc, seen = crc32c(chunk, payload_crc), crc32c(chunk, data_crc), seen + len(chunk)
            yield self._out(chunk)
        if seen != size:
            raise SourceChanged(f"source object {path!r}: {seen} bytes read, {size} listed")
        self._row(path, start, len(head), size, data_crc, mtime, mode, etag)
        yield self._out(frame_footer(payload_crc))

    def _row(self, path: str, start: int, head_length: int, size: int, data_crc: int, mtime: float, mode: int,
             etag: str) -> None:
        self.rows.append({
            "path": path, "shard": self.number, "record_offset": start,
            "record_length": frame_length(head_length + size), "data_offset": start + HEADER + head_length,
            "data_length": size, "crc32c": data_crc, "size": size, "mtime": float(mtime), "mode": int(mode),
            "etag": etag, "generation": self.generation,
        })

    def _out(self, piece: bytes) -> bytes:
        self.size += len(piece)
        self.checksum = crc32c(piece, self.checksum)
        return piece

    def shard_row(self, etag: str) -> dict:
        return {"shard": self.number, "name": shard_name(self.number), "bytes": self.size,
                "records": len(self.rows), "checksum": f"{self.checksum:08x}", "etag": etag,
                "generation": self.generation}

    def idx_bytes(self) -> bytes:
        return render_idx((row["record_offset"], row["record_length"]) for row in self.rows)
