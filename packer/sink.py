"""Streaming one shard to the destination with bounded memory: multipart parts as they fill,
one PUT when the whole shard is smaller than a part. Nothing appears until ``finish``."""

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
            self._flush_part()

    def _flush_part(self) -> None:
        if self._upload is None:
            self._upload = self._store.start_upload(self._path)
        number = len(self._parts) + 1
        self._parts.append((number, self._store.upload_part(self._path, self._upload, number, bytes(self._buffer))))
        self._buffer.clear()

    def finish(self) -> ObjectInfo:
        if self._upload is None:
            return self._store.put(self._path, bytes(self._buffer))
        if self._buffer:
            self._flush_part()
        info = self._store.finish_upload(self._path, self._upload, self._parts, self.size)
        self._upload = None
        return info

    def abort(self) -> None:
        if self._upload is not None:
            self._store.abort_upload(self._path, self._upload)
            self._upload = None
