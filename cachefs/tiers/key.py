"""The identity of a cached block, and the one place its on-disk name is derived.

A block is keyed by (store identity, object path, ETag, block size, block index)
(docs/design.md, invariant 1): a new object version or another block size never
shares a cache entry with an old one.
"""

import hashlib
from dataclasses import dataclass, field

#: the index of a whole-object file's key: all of a large object in one exact cache file
#: (FUSE passthrough hands it to the kernel), beside or instead of its blocks
WHOLE = -1


@dataclass(frozen=True, slots=True)
class BlockKey:
    store: str        # ObjectStore.identity: scheme, endpoint, bucket, root prefix
    path: str         # object path relative to the mount root, "/"-separated, no leading "/"
    etag: str         # the version the reader pinned
    block_size: int
    index: int
    _digest: str | None = field(default=None, init=False, repr=False, compare=False)

    def at(self, index: int) -> "BlockKey":
        """The key of block ``index`` (or ``WHOLE``) of the same object version and block size."""
        return BlockKey(self.store, self.path, self.etag, self.block_size, index)

    @property
    def offset(self) -> int:
        return self.index * self.block_size

    def digest(self) -> str:
        """Hex name of this block in the disk tier (stable across releases); computed once per key."""
        digest = self._digest
        if digest is None:
            raw = "\0".join((self.store, self.path, self.etag, str(self.block_size), str(self.index)))
            digest = hashlib.blake2b(raw.encode("utf-8", "surrogateescape"), digest_size=20).hexdigest()
            object.__setattr__(self, "_digest", digest)
        return digest


class Keys:
    """The block keys of one store and block size, each made once while recently used: a lookup
    and the open after it ask for the same key, and a new key means a dataclass built and a
    blake2b digest computed again. Bounded: cleared whole past ``limit`` keys (the trio thread's)."""

    __slots__ = ("store", "block_size", "_keys", "_limit")

    def __init__(self, store: str, block_size: int, limit: int = 8192) -> None:
        self.store, self.block_size, self._limit = store, block_size, limit
        self._keys: dict[tuple[str, str, int], BlockKey] = {}

    def get(self, path: str, etag: str, index: int) -> BlockKey:
        known = self._keys.get((path, etag, index))
        if known is None:
            if len(self._keys) >= self._limit:
                self._keys.clear()
            known = self._keys[path, etag, index] = BlockKey(self.store, path, etag, self.block_size, index)
        return known
