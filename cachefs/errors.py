"""The exception vocabulary of cachefs and the exit codes of the CLI.

Each layer raises these; one choke point (``fuse_ops``) maps them to errno and
one (``cli``) maps them to a one-line message and an exit code. Exit codes are
documented in the README; never renumber them.
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
