"""Reading a shard from a store front to back in large ranged GETs (forward skips allowed)."""

from cachefs.store import ObjectStore

CHUNK = 8 << 20


class ShardReader:
    """A forward-only file-like view of one shard object: ``read(n)`` and ``read_at(offset, n)``."""

    def __init__(self, store: ObjectStore, path: str, chunk: int = CHUNK) -> None:
        info = store.head(path)
        self.store, self.path, self.size, self.etag, self.chunk = store, path, info.size, info.etag, chunk
        self.position = 0             # offset of the next byte ``read`` returns
        self._buffer = b""
        self._buffer_at = 0           # offset of _buffer[0]

    def read(self, n: int) -> bytes:
        out = bytearray()
        while n > 0 and self.position < self.size:
            start = self.position - self._buffer_at
            if not 0 <= start < len(self._buffer):
                self._fill()
                continue
            piece = self._buffer[start:start + n]
            out += piece
            self.position += len(piece)
            n -= len(piece)
        return bytes(out)

    def read_at(self, offset: int, n: int) -> bytes:
        if offset < self.position:
            raise ValueError("ShardReader reads forward only")
        self.position = offset
        return self.read(n)

    def _fill(self) -> None:
        end = min(self.size, self.position + self.chunk)
        self._buffer = self.store.get(self.path, self.position, end, self.etag, self.size)
        self._buffer_at = self.position
