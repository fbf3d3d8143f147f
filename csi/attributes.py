"""Volume attributes (static PV ``volumeAttributes``, StorageClass parameters) -> mount options.

One table maps each camelCase attribute to a ``MountConfig`` option; values are checked by the
core's own config builder, and a bad or unknown key is INVALID_ARGUMENT naming the key. Keys under
``csi.storage.k8s.io/`` and ``storage.kubernetes.io/`` (pod info, provisioner metadata) are the CO's
and are ignored. Secrets are
never attributes: they come from the request's ``secrets`` (``SECRET_ENV``).
"""

from cachefs.config import build_config
from cachefs.errors import ConfigError
from cachefs.store.url import parse_url
from csi.errors import invalid

# attribute -> MountConfig option
OPTIONS = {
    "url": "url",
    "endpoint": "endpoint_url",
    "region": "region",
    "cacheSize": "cache_size",
    "memCacheSize": "mem_cache_size",
    "stagingSize": "staging_size",
    "blockSize": "block_size",
    "immutable": "immutable",
    "readOnly": "read_only",
    "allowEmptyPrefix": "allow_empty_prefix",
    "prefetchDataset": "prefetch_dataset",
    "metadataTTL": "metadata_ttl",
    "fsync": "fsync",
    "logSyncPeriod": "log_sync_period",
    "checkpointQuietPeriod": "checkpoint_quiet_period",
    "checkpointSyncPeriod": "checkpoint_sync_period",
    "uid": "uid",
    "gid": "gid",
    "fileMode": "file_mode",
    "dirMode": "dir_mode",
}
# attributes of the driver itself, not of the daemon
WARMUP = "warmup"               # comma-separated paths in the volume to warm when it is staged
WARMUP_WAIT = "warmupWait"      # "true": NodeStage returns once the warmup is done
DRIVER_KEYS = (WARMUP, WARMUP_WAIT)
# Keys the CO adds: pod info and provisioner metadata (csi.storage.k8s.io/...), and the
# provisioner identity csi-provisioner puts in every dynamic PV (storage.kubernetes.io/...).
CO_PREFIX = ("csi.storage.k8s.io/", "storage.kubernetes.io/")

# CSI secret key -> the daemon's environment variable (set inside the daemon, never in argv)
SECRET_ENV = {
    "accessKeyID": "AWS_ACCESS_KEY_ID",
    "secretAccessKey": "AWS_SECRET_ACCESS_KEY",
    "sessionToken": "AWS_SESSION_TOKEN",
}


def mount_values(attributes: dict[str, str]) -> dict:
    """The mount options of a volume's attributes (url required, s3:// only), each one validated."""
    values = {}
    for key, raw in sorted(attributes.items()):
        if key.startswith(CO_PREFIX) or key in DRIVER_KEYS:
            continue
        if key not in OPTIONS:
            raise invalid(f"unknown volume attribute {key!r} (known: {', '.join(sorted((*OPTIONS, *DRIVER_KEYS)))})")
        values[OPTIONS[key]] = _checked(key, OPTIONS[key], raw)
    if "url" not in values:
        raise invalid("volume attribute 'url' is required (s3://bucket/prefix)")
    return values


def warmup_paths(attributes: dict[str, str]) -> tuple[list[str], bool]:
    """(paths relative to the volume root, wait for them) of the ``warmup`` attributes."""
    paths = [p.strip().strip("/") for p in attributes.get(WARMUP, "").split(",") if p.strip()]
    if any(".." in p.split("/") for p in paths):
        raise invalid(f"volume attribute {WARMUP!r}: paths must stay inside the volume")
    wait = attributes.get(WARMUP_WAIT, "false").lower()
    if wait not in ("true", "false"):
        raise invalid(f"volume attribute {WARMUP_WAIT!r}: expected true or false, got {wait!r}")
    return paths, wait == "true"


def _checked(key: str, option: str, raw: str):
    if option == "url":
        try:
            parsed = parse_url(raw)
        except ConfigError as exc:
            raise invalid(f"volume attribute 'url': {exc}") from None
        if parsed.scheme != "s3" or not parsed.bucket:
            raise invalid("volume attribute 'url': expected s3://bucket[/prefix]")
        return raw
    try:
        cfg = build_config({"url": "s3://check", "mountpoint": "/", option: raw})
    except ConfigError as exc:
        raise invalid(f"volume attribute {key!r}: {exc}") from None
    return getattr(cfg, option)


def daemon_env(secrets: dict[str, str]) -> dict[str, str]:
    """The request's secrets as the daemon's environment variables; unknown keys are refused by name
    (the values are never shown)."""
    unknown = sorted(set(secrets) - set(SECRET_ENV))
    if unknown:
        raise invalid(f"unknown secret key(s) {', '.join(unknown)} (known: {', '.join(SECRET_ENV)})")
    return {SECRET_ENV[key]: value for key, value in secrets.items() if value}
