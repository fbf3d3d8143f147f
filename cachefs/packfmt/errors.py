"""The packed-format error vocabulary and the exit codes of `cachefs pack` / `unpack` beside the common ones.

Every error here is a ``CachefsError``: the CLI prints it as one line and exits with ``exit_code``;
a mount maps it to EIO like any other corrupt data.
"""

import errno

from cachefs.errors import CachefsError, UsageError


class PackExit:
    """Exit codes of `cachefs pack` and `cachefs unpack` (2 usage, 3 not found, 4 access, 5 store are common)."""

    BAD_NAME = 21         # a source path cannot be packed: '..', absolute, duplicate, newline, file and dir
    SOURCE_CHANGED = 22   # a source object changed while it was packed: run again
    CORRUPT = 23          # a shard or the index failed a check: crc, offsets, truncated or foreign Parquet
    UNKNOWN_VERSION = 24  # the manifest's format version is not one this tool reads
    INCOMPLETE = 25       # --merge: a worker has not committed its part yet; another pack holds DST
    INTERRUPTED = 130     # Ctrl-C: run again to resume (finished shards are kept)


class BadName(UsageError):
    exit_code = PackExit.BAD_NAME


class SourceChanged(CachefsError):
    exit_code = PackExit.SOURCE_CHANGED
    errno = errno.ESTALE


class PackFormatError(CachefsError):
    """Packed data that fails a check: never served, never unpacked."""

    exit_code = PackExit.CORRUPT
    errno = errno.EIO


class CorruptRecord(PackFormatError):
    """A TFRecord frame or payload whose length or crc32c does not match."""


class CorruptIndex(PackFormatError):
    """An index that is truncated, foreign, unsorted, or points outside its shards."""


class UnknownVersion(PackFormatError):
    exit_code = PackExit.UNKNOWN_VERSION


class Incomplete(CachefsError):
    exit_code = PackExit.INCOMPLETE


class PackBusy(CachefsError):
    """Another pack is writing the same destination (its lease is fresh)."""

    exit_code = PackExit.INCOMPLETE
