"""Mount configuration: one frozen dataclass, loaded from defaults < TOML file < flags.

Every option has a TOML key of the same name and a flag ``--name-with-dashes``;
``cachefs mount --help`` and docs/usage.md list them all. Sizes accept suffixes
(``512M``, ``50G``, ``1.5T``; powers of 1024). Secrets are not options: S3
credentials come from the standard AWS chain (environment, profile, files).
"""

import dataclasses
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from cachefs.errors import ConfigError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def parse_size(value: str | int, name: str = "size") -> int:
    """'50G' -> 53687091200. Integers are bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size such as 512M or 50G, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}: expected a size such as 512M or 50G, got {value!r}")
        return value
    match = _SIZE_RE.match(str(value))
    if not match:
        raise ConfigError(f"{name}: expected a size such as 512M or 50G, got {value!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_mode(value: str | int, name: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return int(str(value), 8)
    except ValueError:
        raise ConfigError(f"{name}: expected an octal mode such as 0644, got {value!r}") from None


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cachefs")


DEFAULT_BLOCK_SIZE = 4 << 20
# A packed dataset's shards are multipart objects of exact 8 MiB parts (packer/options.PART_SIZE):
# with blocks of the same size each block GET reads one part, which S3 servers store as a unit
# (docs/packer.md, "Blocks of a packed mount").
PACKED_BLOCK_SIZE = 8 << 20
DEFAULT_LOG_PATTERNS = ("*.log", "*.txt", "*.json", "*.csv", "events.out.tfevents.*")
DEFAULT_CHECKPOINT_PATTERNS = ("*.pt", "*.pth", "*.ckpt", "*.safetensors", "*.bin")


def parse_patterns(value, name: str) -> tuple[str, ...]:
    """A TOML list of globs, or one comma-separated string (a flag)."""
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{name}: expected a list of glob patterns, got {value!r}")
    return tuple(v.strip() for v in value if v.strip())


@dataclass(frozen=True)
class MountConfig:
    """Everything a daemon needs. ``help`` metadata feeds the CLI and the docs/usage.md table."""

    url: str = field(metadata={"help": "dataset URL: s3://BUCKET[/PREFIX], file:///DIR, memory://..."})
    mountpoint: str = field(metadata={"help": "an existing empty directory"})
    endpoint_url: str | None = field(default=None, metadata={
        "help": "S3 endpoint (Ceph RGW, MinIO, a local server): http(s)://HOST[:PORT]; default AWS",
        "endpoint": True})
    region: str | None = field(default=None, metadata={"help": "S3 region (default from the AWS chain)"})
    profile: str | None = field(default=None, metadata={"help": "AWS profile name in the credentials file"})
    cache_dir: str = field(default_factory=default_cache_dir, metadata={
        "help": "disk-tier directory (local NVMe); also holds the listing snapshot and the log"})
    cache_size: int = field(default=50 << 30, metadata={"help": "disk-tier capacity", "size": True})
    free_space_ratio: float = field(default=0.1, metadata={
        "help": "keep at least this fraction of the cache filesystem free"})
    mem_cache_size: int = field(default=1 << 30, metadata={
        "help": "memory-tier budget (blocks and readahead)", "size": True})
    block_size: int | None = field(default=None, metadata={
        "help": "cache block size (a packed dataset's default is the packer's part size)",
        "size": True, "shown": "4M, packed 8M"})
    metadata_ttl: float = field(default=60.0, metadata={
        "help": "seconds before listings and attributes are revalidated with the store"})
    immutable: bool = field(default=False, metadata={
        "help": "the dataset never changes: long kernel timeouts, no revalidation"})
    # ---- warmup (docs/warmup.md) ----
    prefetch_dataset: bool = field(default=False, metadata={
        "help": "with --immutable: once a job reads many files of one directory, warm the rest of it"})
    prefetch_budget: int = field(default=0, metadata={
        "help": "most bytes --prefetch-dataset or --shard-warm warms (0: half the disk tier)", "size": True})
    shard_warm: bool = field(default=True, metadata={
        "help": "packed datasets: the first read of a shard warms all of it in the background"})
    list_ahead: int = field(default=100_000, metadata={
        "help": "at mount, list up to this many objects in one recursive listing in the background, "
                "so folders are listed before their first lookup (0: off)"})
    readahead_at_lookup: bool = field(default=True, metadata={
        "help": "a lookup of a small file no tier holds starts its GET (the open that follows joins it)"})
    readahead_size: int = field(default=32 << 20, metadata={
        "help": "largest readahead window of a sequential reader", "size": True})
    max_fetches: int = field(default=32, metadata={"help": "concurrent object-store GETs for reads"})
    max_prefetches: int = field(default=8, metadata={"help": "concurrent readahead GETs"})
    hedge_percentile: float = field(default=95.0, metadata={
        "help": "a GET slower than this latency percentile of its size class gets a second GET (first wins)"})
    hedge_budget: float = field(default=0.05, metadata={
        "help": "most hedged (second) GETs as a fraction of GETs; 0 disables hedging"})
    hedge_min_delay: float = field(default=0.05, metadata={"help": "seconds before any GET is hedged"})
    max_connections: int = field(default=64, metadata={"help": "HTTP connection pool size"})
    connect_timeout: float = field(default=5.0, metadata={"help": "seconds to connect to the store"})
    read_timeout: float = field(default=30.0, metadata={"help": "seconds to wait for store data"})
    max_attempts: int = field(default=5, metadata={"help": "tries per store request (5xx, throttling)"})
    lean_requests: bool = field(default=True, metadata={
        "help": "S3 GETs run as trio tasks on a small keep-alive HTTP/1.1 client (no worker thread per "
                "GET); --no-lean-requests sends them from worker threads with urllib3, as every other "
                "request is sent. Every request is signed by cachefs's own SigV4; botocore only finds "
                "the credentials"})
    fsync_cache_files: bool = field(default=True, metadata={
        "help": "fsync disk-tier files before renaming them into place"})
    cache_direct_io: bool = field(default=True, metadata={
        "help": "write disk-tier files with O_DIRECT, not through the page cache (buffered where the "
                "file system refuses it)"})
    fill_workers: int = field(default=4, metadata={"help": "most threads writing the disk tier for readers (one while few fills wait, one more per 8 MiB queued)"})
    allow_other: bool = field(default=False, metadata={"help": "let other users (pods) access the mount"})
    uid: int | None = field(default=None, metadata={"help": "owner of all files (default: the mounter)"})
    gid: int | None = field(default=None, metadata={"help": "group of all files (default: the mounter)"})
    file_mode: int = field(default=0o644, metadata={"help": "permission bits of files", "mode": True})
    dir_mode: int = field(default=0o755, metadata={"help": "permission bits of directories", "mode": True})
    fuse_read_ahead_kb: int = field(default=1024, metadata={
        "help": "kernel readahead of the mount (sysfs bdi read_ahead_kb)"})
    fuse_loops: int = field(default_factory=lambda: default_fuse_loops(), metadata={
        "help": "extra FUSE request loops, each on a cloned /dev/fuse descriptor (processes or threads: "
                "--fuse-loop-kind; 0 on up to 4 CPUs, where they cost more than they give; then one per 4 CPUs, "
                "up to 4)", "shown": "by CPU count"})
    fuse_loop_kind: str = field(default="auto", metadata={
        "help": "what the extra request loops are: process (each answers by itself the opens of files handed "
                "to the kernel, and their releases, with no GIL shared with the daemon; the rest goes to the "
                "daemon: --immutable mounts with passthrough on Linux 6.9+), thread (they read requests for the "
                "one thread that answers them), or auto: processes where they can run, else threads. Where "
                "processes could run, the daemon's own loop answers those opens from their table too, even "
                "with no extra loop (thread: never)"})
    fuse_open_ahead: bool = field(default=True, metadata={
        "help": "on --immutable mounts with passthrough: a file looked up while its verified cache file is "
                "at hand gets its backing at the LOOKUP, and a file listed with its attributes (a loader that "
                "lists its dataset first) once no request waits, so even its first open is answered from the "
                "loops' table (by a loop process, or the daemon's own loop) rather than by the open's full "
                "path; a listing registers only while --fuse-idle-backings has room (off: first opens take "
                "that path; for scans that look up or list many files they never open)"})
    fuse_idle_backings: int = field(default=262144, metadata={
        "help": "passthrough: backing files kept registered after a file's last close while the kernel still "
                "knows its inode, so a later epoch reopens it with no work (each holds its cache file from "
                "eviction, a quarter of the disk tier at most in all, ~1 KiB of kernel memory and ~0.5 KiB of the "
                "daemon's); past this many the oldest are closed"})
    fuse_max_background: int = field(default=64, metadata={
        "help": "kernel FUSE max_background (concurrent async requests)"})
    fuse_poll_us: int = field(default=200, metadata={
        "help": "the longest the daemon's request loop polls /dev/fuse after its last request before it sleeps "
                "(own FUSE layer; 0..1000, 0: never): a request that comes meanwhile costs no wake-up. The poll "
                "learns its length (longer while requests come within this, off while they do not) and never "
                "takes a CPU another thread wants; on 2 CPUs one reader's hot epoch ran 1.7-1.8x with it, 8 "
                "readers' hot epoch 1.16x, their disk-tier epoch 0.93-0.96x"})
    passthrough: str = field(default="auto", metadata={
        "help": "auto: the kernel reads cached files from their verified disk-tier files itself (FUSE "
                "passthrough: no READ reaches the daemon; a large file once all its blocks are cached, "
                "written whole) where the kernel offers it, the mount is --immutable or --read-only (each "
                "version of a changing object then has its own inode) and not packed, and the daemon may "
                "(CAP_SYS_ADMIN); off: every read goes through the daemon"})
    fuse_no_open: bool = field(default=False, metadata={
        "help": "the kernel opens files without asking the daemon (FUSE zero-message opens; --immutable "
                "mounts of the own FUSE layer): a file in the page cache is read with no request at all "
                "(hot epochs at the page cache's speed, no daemon CPU), but a read the page cache misses "
                "goes through the daemon (no passthrough). For datasets that fit in RAM"})
    passthrough_seals: bool = field(default=True, metadata={
        "help": "a cache file for passthrough is read back and checked as it is written, and sealed (its "
                "inode, ctime and size, in this boot): this daemon and later ones (a restart, an upgrade, a "
                "remount) hand it over unread while the seal matches (a later one re-verifies it in the "
                "background scrub); off: every daemon reads and checks each file before its first hand-over"})
    fuse_backend: str = field(default_factory=lambda: os.environ.get("CACHEFS_FUSE_BACKEND", "cachefs"), metadata={
        "help": "who speaks the FUSE protocol: cachefs (its own layer over /dev/fuse) or pyfuse3 "
                "(libfuse 3; kept for one release). The default comes from $CACHEFS_FUSE_BACKEND if set",
        "shown": "cachefs"})
    keeper: bool = field(default=True, metadata={
        "help": "the mount outlives its daemon: a small keeper process holds the FUSE connection and starts a "
                "new daemon when one dies (readers pause, never fail), and `cachefs restart` "
                "upgrades a live mount; off with --foreground and --fuse-backend pyfuse3"})
    keeper_standby: bool = field(default=True, metadata={
        "help": "with --keeper, a second daemon waits with its code loaded to take over at once after a "
                "crash (a pause of tens of ms instead of a Python start; costs that process's memory)"})
    metrics_port: int = field(default=9567, metadata={
        "help": "Prometheus port on metrics_host (next free one if taken); 0 disables"})
    metrics_host: str = field(default="127.0.0.1", metadata={"help": "Prometheus listen address"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})
    log_file: str | None = field(default=None, metadata={
        "help": "log file (default CACHE_DIR/cachefs.log; stderr with --foreground)"})
    foreground: bool = field(default=False, metadata={"help": "stay in the foreground, log to stderr"})
    ready_timeout: float = field(default=60.0, metadata={
        "help": "seconds `mount` waits for the daemon to be ready"})
    # ---- write-back (docs/writeback.md) ----
    read_only: bool = field(default=False, metadata={
        "help": "refuse every write with EROFS (an --immutable mount is always read-only)"})
    allow_empty_prefix: bool = field(default=False, metadata={
        "help": "mount a read-only prefix that holds no objects (refused by default as a likely typo; a "
                "writable mount of an empty prefix, such as a new output prefix, always works)"})
    staging_dir: str | None = field(default=None, metadata={
        "help": "write-back journal directory (default CACHE_DIR/staging); dirty data lives here"})
    staging_size: int = field(default=20 << 30, metadata={
        "help": "most bytes of staged (not yet uploaded) files", "size": True})
    staging_wait: float = field(default=30.0, metadata={
        "help": "seconds a writer waits for staging space before ENOSPC"})
    fsync: str = field(default="local", metadata={
        "help": "fsync returns when the data is on local disk (local) or in the store (remote)"})
    log_patterns: tuple[str, ...] = field(default=DEFAULT_LOG_PATTERNS, metadata={
        "help": "file names of the log sync class (comma-separated globs)", "patterns": True})
    checkpoint_patterns: tuple[str, ...] = field(default=DEFAULT_CHECKPOINT_PATTERNS, metadata={
        "help": "file names of the checkpoint sync class (comma-separated globs; tried first)",
        "patterns": True})
    small_file_size: int = field(default=16 << 20, metadata={
        "help": "files matching no pattern are log class below this size, checkpoint class above",
        "size": True})
    log_sync_period: float = field(default=5.0, metadata={
        "help": "seconds between uploads of a changing log-class file"})
    checkpoint_quiet_period: float = field(default=60.0, metadata={
        "help": "a closed checkpoint-class file is uploaded once unchanged this long (seconds)"})
    checkpoint_sync_period: float = field(default=600.0, metadata={
        "help": "a changed checkpoint-class file is uploaded at the latest after this long (seconds)"})
    upload_part_size: int = field(default=16 << 20, metadata={
        "help": "multipart upload part size (files above it use multipart)", "size": True})
    upload_concurrency: int = field(default=8, metadata={
        "help": "parallel part uploads of checkpoint-class files"})
    log_upload_concurrency: int = field(default=4, metadata={
        "help": "parallel uploads of log-class files (kept apart from checkpoint uploads)"})
    drain_timeout: float = field(default=60.0, metadata={
        "help": "seconds the daemon keeps uploading staged files when it stops"})
    volume_id: str | None = field(default=None, metadata={
        "help": "a name for this mount in the cachefs_mount_info metric (the CSI driver sets the volume id)"})

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def log_path(self) -> str:
        return self.log_file or os.path.join(self.cache_dir, "cachefs.log")

    @property
    def disk_path(self) -> str:
        """The disk tier's directory (its block files, and their temporary files)."""
        return os.path.join(self.cache_dir, "blocks")

    @property
    def staging_path(self) -> str:
        return self.staging_dir or os.path.join(self.cache_dir, "staging")

    @property
    def owner(self) -> tuple[int, int]:
        """The uid and gid the mount's files belong to (and who may change its state): --uid and
        --gid, else the user who mounts."""
        return (os.getuid() if self.uid is None else self.uid, os.getgid() if self.gid is None else self.gid)

    def block_size_for(self, packed: bool) -> int:
        """The cache block size of the mount: the one set, else the default for what it mounts (the
        packed one where the memory tier holds two such blocks)."""
        if self.block_size:
            return self.block_size
        return PACKED_BLOCK_SIZE if packed and self.mem_cache_size >= 2 * PACKED_BLOCK_SIZE else DEFAULT_BLOCK_SIZE

    @property
    def kept(self) -> bool:
        """Whether a keeper holds this mount's connection (``cachefs/keeper.py``)."""
        return self.keeper and not self.foreground and self.fuse_backend == "cachefs"

    @property
    def writable(self) -> bool:
        return not (self.read_only or self.immutable)

    def passthrough_wanted(self, packed: bool) -> str | None:
        """None when this mount asks the kernel for passthrough, else why not (a fallback reason):
        the mount must not be written through (--immutable or --read-only: a read-only mount of a
        bucket whose objects change gives each version its own inode), and a packed dataset's
        files are ranges of shards, not files of their own; with --fuse-no-open no OPEN comes to
        hand a file over at."""
        if self.passthrough == "off" or self.fuse_backend != "cachefs":
            return "off"
        if self.fuse_no_open:
            return "no_open"
        if not (self.immutable or self.read_only) or packed:
            return "mutable"
        return None


#: options a hand-over to a new daemon keeps (``cachefs restart``, mounting again): they are the FUSE
#: connection, the home of the kernel's ids (the cache dir), or what the kernel has cached
FIXED_OPTIONS = ("url", "mountpoint", "cache_dir", "allow_other", "read_only", "immutable", "fuse_backend", "fuse_no_open",
                 "uid", "gid", "file_mode", "dir_mode", "endpoint_url")


def default_fuse_loops() -> int:
    cpus = os.cpu_count() or 1
    return 0 if cpus <= 4 else min(4, cpus // 4)


def option_fields() -> list[dataclasses.Field]:
    """The user-settable options, in declaration order."""
    return [f for f in dataclasses.fields(MountConfig) if f.name not in ("url", "mountpoint")]


_SIGNED_QUERY = re.compile(r"(?i)[?&](x-amz-(credential|signature|security-token)|awsaccesskeyid|signature)=")
_HOST_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)(:[0-9]{1,5})?$")


def parse_endpoint(endpoint: str) -> str:
    """Check an S3 endpoint URL (``--endpoint-url``, a CSI volume's ``endpoint``): ``http://`` or
    ``https://`` then a host and an optional port and path; raise ConfigError (one line) if not.
    Returns it without a trailing '/'."""
    scheme, sep, rest = endpoint.partition("://")
    host = rest.partition("/")[0]
    if "@" in host or _SIGNED_QUERY.search(rest):
        raise ConfigError("the endpoint URL must not carry credentials; use the environment or a credentials file")
    if not sep or scheme.lower() not in ("http", "https"):
        raise ConfigError(f"endpoint URL {_short(endpoint)} needs a scheme: http://HOST[:PORT] or https://HOST[:PORT]")
    port = host.rpartition(":")[2] if ":" in host and not host.endswith("]") else None
    if not _HOST_RE.match(host) or "?" in rest or "#" in rest or (port is not None and not 0 < int(port) < 65536):
        raise ConfigError(f"endpoint URL {_short(endpoint)} is malformed: expected http(s)://HOST[:PORT][/PATH]")
    return endpoint.rstrip("/")


def _short(text: str) -> str:
    shown = repr(text)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _validate(cfg: MountConfig) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    need(cfg.cache_size > 0, "cache_size must be positive")
    need(0.0 <= cfg.free_space_ratio < 1.0, "free_space_ratio must be in [0, 1)")
    need(cfg.block_size is None or (64 << 10 <= cfg.block_size <= 64 << 20 and cfg.block_size % 4096 == 0),
         "block_size must be a multiple of 4K between 64K and 64M")
    need(cfg.mem_cache_size >= 2 * (cfg.block_size or DEFAULT_BLOCK_SIZE),
         "mem_cache_size must hold at least two blocks (2 x block_size)")
    need(cfg.metadata_ttl >= 0, "metadata_ttl must be >= 0")
    need(cfg.list_ahead >= 0, "list_ahead must be >= 0")
    for name in ("max_fetches", "max_prefetches", "max_connections", "max_attempts", "fill_workers",
                 "fuse_read_ahead_kb", "fuse_max_background"):
        need(getattr(cfg, name) >= 1, f"{name} must be >= 1")
    need(cfg.connect_timeout > 0 and cfg.read_timeout > 0, "timeouts must be positive")
    need(50 <= cfg.hedge_percentile < 100, "hedge_percentile must be in [50, 100)")
    need(0 <= cfg.hedge_budget <= 1 and cfg.hedge_min_delay >= 0, "hedge_budget must be in [0, 1], "
         "hedge_min_delay >= 0")
    need(0 <= cfg.metrics_port < 65536, "metrics_port must be in 0..65535")
    need(cfg.log_level.lower() in ("debug", "info", "warning", "error"),
         "log_level must be debug, info, warning or error")
    need(0 <= cfg.file_mode <= 0o7777 and 0 <= cfg.dir_mode <= 0o7777, "modes must be in 0000..7777")
    need(bool(cfg.mountpoint), "a mountpoint is required")
    need(cfg.fsync in ("local", "remote"), "fsync must be local or remote")
    need(cfg.fuse_backend in ("cachefs", "pyfuse3"), "fuse_backend must be cachefs or pyfuse3")
    need(cfg.passthrough in ("auto", "off"), "passthrough must be auto or off")
    need(cfg.fuse_loop_kind in ("auto", "thread", "process"), "fuse_loop_kind must be auto, thread or process")
    need(not cfg.fuse_no_open or (cfg.immutable and cfg.fuse_backend == "cachefs"),
         "--fuse-no-open needs --immutable (no open revalidates a file) and --fuse-backend cachefs")
    need(0 <= cfg.fuse_loops <= 64, "fuse_loops must be in 0..64")
    need(0 <= cfg.fuse_poll_us <= 1000, "fuse_poll_us must be in 0..1000")
    need(0 <= cfg.fuse_idle_backings <= 1 << 22, "fuse_idle_backings must be in 0..4194304")
    need(5 << 20 <= cfg.upload_part_size <= 5 << 30, "upload_part_size must be between 5M and 5G")
    need(cfg.staging_size > 0 and cfg.staging_wait >= 0, "staging_size must be positive, staging_wait >= 0")
    for name in ("upload_concurrency", "log_upload_concurrency"):
        need(getattr(cfg, name) >= 1, f"{name} must be >= 1")
    for name in ("log_sync_period", "checkpoint_quiet_period", "checkpoint_sync_period", "drain_timeout"):
        need(getattr(cfg, name) >= 0, f"{name} must be >= 0")


def _coerce(f: dataclasses.Field, value):
    """Turn a TOML or CLI value into the field's type, with a one-line error."""
    name = f.name
    if value is None:
        return None
    if f.metadata.get("size"):
        return parse_size(value, name)
    if f.metadata.get("mode"):
        return parse_mode(value, name)
    if f.metadata.get("endpoint"):
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected str, got {value!r}")
        return parse_endpoint(value)
    if f.metadata.get("patterns"):
        return parse_patterns(value, name)
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind.startswith("bool"):
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind.startswith("int"):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if kind.startswith("float"):
            if isinstance(value, bool) or not math.isfinite(float(value)):
                raise ValueError(value)    # nan passes every `>=` check by failing both ways; inf waits forever
            return float(value)
        if not isinstance(value, str):
            raise ValueError(value)
        return value
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected {kind.split(' ')[0]}, got {value!r}") from None


def load_toml(path: str) -> dict:
    """Read a config file into a dict of raw option values (keys may use - or _)."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {exc.start})") from None
    values = {key.replace("-", "_"): value for key, value in data.items()}
    for f in dataclasses.fields(MountConfig):
        # `file_mode = 644` in TOML is a decimal integer; it means what `--file-mode 644` means
        if f.metadata.get("mode") and isinstance(values.get(f.name), int) and not isinstance(
                values[f.name], bool):
            values[f.name] = parse_mode(str(values[f.name]), f.name)
    return values


def _shown(name: str) -> str:
    """A name from a config file as one short printable line (repr when it holds control characters)."""
    shown = name if name.isprintable() else repr(name)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def build_config(values: dict) -> MountConfig:
    """Build a MountConfig from raw values (TOML merged with flags), validating each."""
    known = {f.name: f for f in dataclasses.fields(MountConfig)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"unknown option(s): {', '.join(map(_shown, unknown))}")
    for name in ("url", "mountpoint"):
        if not values.get(name):
            raise ConfigError(f"missing {name}")
    kwargs = {name: _coerce(known[name], value) for name, value in values.items()}
    if kwargs.get("cache_dir"):
        kwargs["cache_dir"] = str(Path(kwargs["cache_dir"]).expanduser().absolute())
    kwargs["mountpoint"] = str(Path(kwargs["mountpoint"]).expanduser().absolute())
    return MountConfig(**kwargs)


def to_dict(cfg: MountConfig) -> dict:
    return dataclasses.asdict(cfg)


def options_table() -> str:
    """docs/usage.md's option table, rendered from the fields (``python -m cachefs.config``)."""
    rows = ["| option (flag / TOML key) | default | meaning |", "|---|---|---|"]
    for f in option_fields():
        default = "~/.cache/cachefs" if f.name == "cache_dir" else render_default(f)
        rows.append(f"| `--{f.name.replace('_', '-')}` / `{f.name}` | `{default}` | {f.metadata['help']} |")
    return "\n".join(rows)


def render_default(f: dataclasses.Field) -> str:
    """A field's default as a user writes it (``50G``, ``0644``, ``-`` for none): for --help and
    the docs/usage.md table alike."""
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if "shown" in f.metadata:
        return f.metadata["shown"]
    if value is None:
        return "-"
    if f.metadata.get("mode"):
        return f"{value:04o}"
    if f.metadata.get("size") and isinstance(value, int) and value >= 1 << 20:
        for unit, shift in (("T", 40), ("G", 30), ("M", 20)):
            if value % (1 << shift) == 0:
                return f"{value >> shift}{unit}"
    if isinstance(value, (tuple, list)):
        return ", ".join(map(str, value))
    return str(value)


if __name__ == "__main__":
    print(options_table())
