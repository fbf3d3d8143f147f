"""The agent's record of this node's volumes, kept on the host so a restarted agent (or plugin)
adopts the live mounts.

``state.json`` (no secrets): per volume its staging path, mount options, cache dir, cache
allocation, daemon pid and its mount's home, published targets, and the repairs made (the dead
connections whose views containers may still hold). ``secrets/<key>.json``: the volume's credentials,
mode 0600 in a 0700 directory (root only), kept so the agent can mount a volume again after its
daemon died; replaced at every NodeStage, so rotated secrets apply at the next stage. Every write
is temp file + fsync + rename + directory fsync.
"""

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field


@dataclass
class Volume:
    volume_id: str
    staging: str
    values: dict                    # mount options (csi.attributes.mount_values), no secrets
    cache_dir: str
    allocation: int                 # bytes of the node cache root given to this volume
    pid: int | None = None
    targets: dict[str, bool] = field(default_factory=dict)   # target path -> read-only
    warmup: list[str] = field(default_factory=list)
    home: str | None = None         # the daemon's own mount (None: at the staging path, older agents)
    repairs: int = 0
    dead_devices: list[str] = field(default_factory=list)    # FUSE connections that died under views

    @property
    def key(self) -> str:
        return volume_key(self.volume_id)


def volume_key(volume_id: str) -> str:
    """A file-name-safe key for a volume id (ids are opaque and may hold '/')."""
    return hashlib.sha256(volume_id.encode()).hexdigest()[:24]


class StateStore:
    def __init__(self, state_dir: str) -> None:
        self.dir = state_dir
        self.secrets_dir = os.path.join(state_dir, "secrets")
        os.makedirs(self.secrets_dir, mode=0o700, exist_ok=True)
        os.chmod(state_dir, 0o700)
        os.chmod(self.secrets_dir, 0o700)
        self.path = os.path.join(state_dir, "state.json")

    def load(self) -> dict[str, Volume]:
        try:
            with open(self.path) as fh:
                raw = json.load(fh)
        except FileNotFoundError:
            return {}
        return {vid: Volume(**record) for vid, record in raw.get("volumes", {}).items()}

    def save(self, volumes: dict[str, Volume]) -> None:
        data = {"version": 1, "volumes": {vid: asdict(vol) for vid, vol in volumes.items()}}
        _write_atomic(self.path, json.dumps(data, indent=1, sort_keys=True).encode(), 0o600)

    def save_secrets(self, key: str, env: dict[str, str]) -> None:
        _write_atomic(os.path.join(self.secrets_dir, f"{key}.json"), json.dumps(env).encode(), 0o600)

    def load_secrets(self, key: str) -> dict[str, str]:
        try:
            with open(os.path.join(self.secrets_dir, f"{key}.json")) as fh:
                return json.load(fh)
        except FileNotFoundError:
            return {}

    def drop_secrets(self, key: str) -> None:
        try:
            os.unlink(os.path.join(self.secrets_dir, f"{key}.json"))
        except FileNotFoundError:
            pass


def _write_atomic(path: str, data: bytes, mode: int) -> None:
    temp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, path)
    dirfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)
