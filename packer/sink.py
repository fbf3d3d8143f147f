"""Streaming one shard to the destination with bounded memory: multipart parts as they fill,
one PUT when the whole shard is smaller than a part. Nothing appears until ``finish``.

Every part but the last is exactly ``part_size`` bytes (records are cut across parts), so the
parts line up with the blocks a mount reads (a packed mount's blocks are 8 MiB by default, one
part each; any ``--block-size`` that divides 8 MiB works too): a block's ranged GET never spans
two parts. Servers store a part as an object of its own (Ceph RGW,
SeaweedFS), and a GET across a part boundary costs them more: a 4 MiB ranged GET of SeaweedFS
took 7.5-8.1 ms of its CPU with parts of 8 MiB + 57,000 bytes, 5.8-5.9 ms with 8 MiB parts, and
a packed cold epoch through a mount (SeaweedFS, 10,000 x 110 KiB) 0.28-0.30 ms of store CPU per
file against 0.35-0.36 with parts cut at the first record past 8 MiB."""

from cachefs.store import ObjectInfo, ObjectStore


class ShardSink:
    def __init__(self, store: ObjectStore, path: str, part_size: int) -> None:
        self._store, self._path, self._part_size = store, path, part_size
        self._buffer = bytearray()
        self._upload: str | None = None
        self._parts: list[tuple[int, str]] = []
        self.size = 0

    def write(self, data: bytes) -> None:
        self._buffer += data
        self.size += len(data)
        if len(self._buffer) >= self._part_size:
            whole = len(self._buffer) - len(self._buffer) % self._part_size
            with memoryview(self._buffer) as view:
                for start in range(0, whole, self._part_size):
                    self._upload_part(bytes(view[start:start + self._part_size]))
            del self._buffer[:whole]         # what is left: less than a part

    def _upload_part(self, part: bytes) -> None:
        if self._upload is None:
            self._upload = self._store.start_upload(self._path)
        number = len(self._parts) + 1
        self._parts.append((number, self._store.upload_part(self._path, self._upload, number, part)))

    def finish(self) -> ObjectInfo:
        if self._upload is None:
            return self._store.put(self._path, bytes(self._buffer))
        if self._buffer:
            self._upload_part(bytes(self._buffer))
            self._buffer.clear()
        info = self._store.finish_upload(self._path, self._upload, self._parts, self.size)
        self._upload = None
        return info

    def abort(self) -> None:
        if self._upload is not None:
            self._store.abort_upload(self._path, self._upload)
            self._upload = None
