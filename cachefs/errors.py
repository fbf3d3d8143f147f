"""The exception vocabulary of cachefs and the exit codes of the CLI.

Each layer raises these; one choke point (``fuse_ops``) maps them to errno and
one (``cli``) maps them to a one-line message and an exit code. Exit codes are
listed in ``EXIT_CODES`` (and rendered from it into --help and docs/usage.md);
never renumber them.
"""

import errno


class ExitCode:
    OK = 0
    INTERNAL = 1        # a bug: unexpected exception (traceback in the log)
    USAGE = 2           # bad arguments, bad config file, bad URL
    NOT_FOUND = 3       # bucket or prefix does not exist
    ACCESS = 4          # credentials missing or refused
    UNREACHABLE = 5     # endpoint unreachable, timed out, or S3 kept failing
    MOUNTPOINT = 6      # mountpoint missing, not a directory, busy, not mounted
    NO_FUSE = 7         # /dev/fuse or fusermount3 missing
    CACHE_DIR = 8       # cache dir unwritable, or its disk is full
    NO_DAEMON = 9       # no cachefs daemon answers at that mountpoint
    TIMEOUT = 10        # the daemon did not become ready in time
    # 11 and 12 are `cachefs warmup`'s (some files failed; refused: does not fit)
    PERMISSION = 13     # the daemon refused the caller: only root and the mount's owner change it
    UNSUPPORTED = 14    # the daemon does not know that command or control protocol version


# Every exit code of every `cachefs` command, in one table: the commands' --help and the docs
# (docs/usage.md, checked by a test) are rendered from it.
EXIT_CODES: dict[int, str] = {
    0: "success",
    1: "internal error (a bug: the log has the traceback)",
    2: "bad arguments, config file, URL or endpoint; an extra the command needs is not installed",
    3: "bucket or prefix not found; pack: SRC holds no files",
    4: "credentials missing or refused",
    5: "object store unreachable, timing out, or failing after retries",
    6: "mountpoint missing, not a directory, busy (already mounted), or not mounted",
    7: "/dev/fuse or fusermount3 missing",
    8: "cache dir unwritable, on a full or too small filesystem, or in use by another daemon",
    9: "no cachefs daemon answers at that mountpoint",
    10: "timed out: mount not ready, or sync --wait / umount could not upload everything in time",
    11: "warmup: some files failed (listed in the summary)",
    12: "warmup refused: the dataset does not fit the cache (--force warms what fits)",
    13: "refused: only root and the mount's owner may sync, warm, evict or pin",
    14: "the daemon does not support that command (remount with this cachefs version)",
    21: "pack: a source name cannot be packed ('..', absolute, duplicate, newline, file and directory)",
    22: "pack: a source object changed while it was packed (run again)",
    23: "a shard or the index of a packed dataset is corrupt (crc, offsets, truncated Parquet)",
    24: "the packed dataset's manifest version is unknown to this cachefs",
    25: "pack --merge: some worker has not committed yet; pack: another pack is writing DST",
    130: "interrupted (Ctrl-C): run the same command again to resume",
}


def exit_codes_table() -> str:
    """The docs' exit-code table (docs/usage.md), rendered from EXIT_CODES (``python -m cachefs.errors``)."""
    return "\n".join(["| code | meaning |", "|---|---|"] + [f"| {code} | {text} |" for code, text in
                                                            sorted(EXIT_CODES.items())])


def exit_codes_help(codes=None) -> str:
    """The ``exit codes:`` block of a command's --help: ``codes`` (default: all) from EXIT_CODES."""
    chosen = sorted(EXIT_CODES) if codes is None else sorted(codes)
    return "exit codes:\n" + "\n".join(f"  {code:>3}  {EXIT_CODES[code]}" for code in chosen)


class NeedsWait(Exception):
    """A synchronous fast path (``*_now``) cannot answer without waiting: ask the async one."""


class CachefsError(Exception):
    """Base class. ``exit_code`` for the CLI, ``errno`` for the FUSE layer."""

    exit_code = ExitCode.INTERNAL
    errno = errno.EIO


class UsageError(CachefsError):
    exit_code = ExitCode.USAGE
    errno = errno.EINVAL


class ConfigError(UsageError):
    """A malformed or invalid config file, flag or URL."""


class StoreError(CachefsError):
    """An object-store operation failed (after retries, if it was transient)."""

    exit_code = ExitCode.UNREACHABLE
    errno = errno.EIO


class NoSuchKey(StoreError):
    exit_code = ExitCode.NOT_FOUND
    errno = errno.ENOENT


class NoSuchBucket(StoreError):
    exit_code = ExitCode.NOT_FOUND
    errno = errno.ENOENT


class AccessDenied(StoreError):
    exit_code = ExitCode.ACCESS
    errno = errno.EACCES


class Unreachable(StoreError):
    """Connection refused, DNS failure, timeouts, or 5xx/throttling that outlived retries."""

    exit_code = ExitCode.UNREACHABLE
    errno = errno.EIO


class VersionChanged(StoreError):
    """The object no longer has the ETag this handle pinned (HTTP 412 or a mismatched ETag)."""

    errno = errno.ESTALE


class BadResponse(StoreError):
    """The server answered something a correct S3 server would not (e.g. ignored a Range)."""

    errno = errno.EIO


class MountpointError(CachefsError):
    exit_code = ExitCode.MOUNTPOINT
    errno = errno.EINVAL


class FuseUnavailable(CachefsError):
    exit_code = ExitCode.NO_FUSE


class CacheDirError(CachefsError):
    exit_code = ExitCode.CACHE_DIR


class NoDaemon(CachefsError):
    exit_code = ExitCode.NO_DAEMON


class StartTimeout(CachefsError):
    exit_code = ExitCode.TIMEOUT


class PermissionDenied(CachefsError):
    """A control command that changes state, asked by a user other than root or the mount's owner."""

    exit_code = ExitCode.PERMISSION
    errno = errno.EACCES


class Unsupported(CachefsError):
    """The daemon does not know a control command (sync on a read-only mount) or protocol version."""

    exit_code = ExitCode.UNSUPPORTED
    errno = errno.EOPNOTSUPP


class CorruptBlock(CachefsError):
    """A disk-tier block failed its checksum or is truncated. Never escapes the tiers."""


if __name__ == "__main__":
    print(exit_codes_table())
