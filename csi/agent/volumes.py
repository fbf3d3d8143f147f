"""The agent's engine: stage, publish, unpublish, unstage, stats, and repair of dead daemons.

Each call: validate, lock the volume, look it up, check preconditions, act idempotently, persist.
A volume's daemon is started with ``cachefs.launcher.start`` in its own session (never a child of
the plugin), its credentials on its stdin. The watchdog (``check_all``) finds a mount whose daemon
died (ENOTCONN, or nothing mounted), detaches the stale staging mount and every target bound to it,
starts a new daemon on the same cache dir (which replays the write-back journal) and binds every
published target again.
"""

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass

from cachefs import launcher
from cachefs.config import build_config
from cachefs.errors import CachefsError, ConfigError, ExitCode
from csi.agent import mounts
from csi.agent.state import StateStore, Volume, volume_key
from csi.attributes import daemon_env, mount_values, warmup_paths
from csi.errors import CsiError, already_exists, internal, invalid, not_found, precondition

log = logging.getLogger("cachefs.csi.agent")

MIN_ALLOCATION = 64 << 20
_EXIT_TO_CODE = {ExitCode.USAGE: "INVALID_ARGUMENT", ExitCode.NOT_FOUND: "NOT_FOUND",
                 ExitCode.ACCESS: "PERMISSION_DENIED", ExitCode.UNREACHABLE: "UNAVAILABLE",
                 ExitCode.TIMEOUT: "DEADLINE_EXCEEDED"}


@dataclass(frozen=True)
class NodeConfig:
    state_dir: str
    cache_root: str
    cache_size: int             # node-wide disk budget, split across staged volumes
    volume_slots: int = 4       # a volume without cacheSize gets cache_size / volume_slots
    metrics_port: int = 0       # first port tried by each daemon (0: no metrics)
    metrics_host: str = "127.0.0.1"
    drain_timeout: float = 60.0


class VolumeManager:
    def __init__(self, node: NodeConfig) -> None:
        self.node = node
        self.store = StateStore(node.state_dir)
        self.volumes = self.store.load()
        self._meta = threading.Lock()           # guards self.volumes, allocations and saving
        self._locks: dict[str, threading.Lock] = {}
        os.makedirs(node.cache_root, mode=0o700, exist_ok=True)
        if self.volumes:
            log.info("adopting %d staged volume(s) from %s", len(self.volumes), self.store.path)

    # ---- stage / unstage -------------------------------------------------------------------
    def stage(self, volume_id: str, staging: str, attributes: dict, secrets: dict, readonly: bool) -> dict:
        values = mount_values(attributes)
        if readonly:
            values["read_only"] = True
        paths, wait = warmup_paths(attributes)
        env = daemon_env(secrets)
        with self._volume_lock(volume_id):
            vol = self.volumes.get(volume_id)
            if vol is not None:
                self._check_compatible(vol, staging, values)
                if env:
                    self.store.save_secrets(vol.key, env)
                if not _healthy(vol):
                    self._repair(vol)
                return {"pid": vol.pid}
            vol = self._new_volume(volume_id, staging, values, paths)
            if env:
                self.store.save_secrets(vol.key, env)
            try:
                self._start(vol, env)
            except BaseException:
                self._forget(vol)
                raise
            self._save()
        self._warm(vol, wait)
        return {"pid": vol.pid}

    def unstage(self, volume_id: str, staging: str) -> dict:
        with self._volume_lock(volume_id):
            vol = self.volumes.get(volume_id)
            if vol is None:
                if mounts.entry(staging) is not None and mounts.entry(staging).fstype == mounts.FSTYPE:
                    mounts.unmount(staging, lazy=True)     # a leftover of a lost state file
                return {}
            if vol.staging != staging:
                raise not_found(f"volume {volume_id} is staged at {vol.staging}, not {staging}")
            if vol.targets:
                raise precondition(f"volume {volume_id} is still published at {', '.join(sorted(vol.targets))}")
            self._stop(vol)
            self._forget(vol)
            shutil.rmtree(vol.cache_dir, ignore_errors=True)
            _rmdir(staging)
        return {}

    def _check_compatible(self, vol: Volume, staging: str, values: dict) -> None:
        if vol.staging != staging:
            raise already_exists(f"volume {vol.volume_id} is already staged at {vol.staging}")
        if vol.values != values:
            changed = sorted(k for k in set(vol.values) | set(values) if vol.values.get(k) != values.get(k))
            raise already_exists(f"volume {vol.volume_id} is staged with other options ({', '.join(changed)}); "
                                 f"unstage it first")

    def _new_volume(self, volume_id: str, staging: str, values: dict, warm: list[str]) -> Volume:
        if mounts.entry(staging) is not None:
            raise already_exists(f"staging path {staging} already has something mounted")
        with self._meta:
            used = sum(v.allocation for v in self.volumes.values())
            free = self.node.cache_size - used
            wanted = values.get("cache_size") or self.node.cache_size // self.node.volume_slots
            allocation = min(wanted, free) if "cache_size" not in values else wanted
            if allocation > free or allocation < MIN_ALLOCATION:
                raise CsiError("RESOURCE_EXHAUSTED", f"the node cache root has {free} bytes unallocated; volume "
                               f"{volume_id} needs {max(wanted, MIN_ALLOCATION)} (lower cacheSize, or unstage others)")
            vol = Volume(volume_id, staging, values, os.path.join(self.node.cache_root, volume_key(volume_id)),
                         allocation, warmup=warm)
            self.volumes[volume_id] = vol
        return vol

    def _forget(self, vol: Volume) -> None:
        with self._meta:
            self.volumes.pop(vol.volume_id, None)
        self.store.drop_secrets(vol.key)
        self._save()

    # ---- publish / unpublish ---------------------------------------------------------------
    def publish(self, volume_id: str, staging: str, target: str, readonly: bool) -> dict:
        with self._volume_lock(volume_id):
            vol = self.volumes.get(volume_id)
            if vol is None or vol.staging != staging:
                raise precondition(f"volume {volume_id} is not staged at {staging}")
            if target in vol.targets and vol.targets[target] != readonly:
                raise already_exists(f"{target} is already published {'read-only' if vol.targets[target] else 'read-write'}")
            if target not in vol.targets and mounts.entry(target) is not None \
                    and not mounts.same_mount(target, staging):
                raise already_exists(f"target {target} already has another filesystem mounted")
            if not _healthy(vol):
                self._repair(vol)
            if not (mounts.same_mount(target, staging) and mounts.state(target) == "live"):
                mounts.unmount(target, lazy=True)
                mounts.bind(staging, target, readonly)
            if not (mounts.same_mount(target, staging) and mounts.state(target) == "live"):
                mounts.unmount(target, lazy=True)
                raise internal(f"{target} is not the live cachefs mount after binding it; not published")
            vol.targets[target] = readonly
            self._save()
        return {}

    def unpublish(self, volume_id: str, target: str) -> dict:
        with self._volume_lock(volume_id):
            vol = self.volumes.get(volume_id)
            item = mounts.entry(target)
            if item is not None and (vol is not None or item.fstype == mounts.FSTYPE):
                try:
                    mounts.unmount(target)
                except CsiError:
                    mounts.unmount(target, lazy=True)       # busy or dead: detach it
            _rmdir(target)
            if vol is not None and target in vol.targets:
                del vol.targets[target]
                self._save()
        return {}

    # ---- stats -----------------------------------------------------------------------------
    def stats(self, volume_id: str, path: str) -> dict:
        vol = self.volumes.get(volume_id)
        if vol is None:
            raise not_found(f"volume {volume_id} is not staged on this node")
        if path != vol.staging and path not in vol.targets:
            raise not_found(f"{path} is not a path of volume {volume_id}")
        condition = mounts.state(path)
        if condition != "live":
            return {"abnormal": True, "message": f"the cachefs mount at {path} is {condition}; the agent is "
                    f"mounting it again"}
        st = os.statvfs(path)
        return {"abnormal": False, "message": "", "bytes": [st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize],
                "inodes": [st.f_files, st.f_favail]}

    def list(self) -> dict:
        return {"volumes": {vid: {"staging": v.staging, "pid": v.pid, "targets": v.targets,
                                  "state": mounts.state(v.staging)} for vid, v in self.volumes.items()}}

    # ---- daemons -----------------------------------------------------------------------------
    def check_all(self) -> None:
        """The watchdog's tick: repair every staged volume whose mount is not live."""
        for vid in list(self.volumes):
            with self._volume_lock(vid):
                vol = self.volumes.get(vid)
                if vol is None or _healthy(vol):
                    continue
                try:
                    self._repair(vol)
                except CsiError as exc:
                    log.error("volume %s: repair failed (retrying): %s", vid, exc.message)

    def _repair(self, vol: Volume) -> None:
        log.warning("volume %s: the mount at %s is not live (daemon pid %s); mounting it again",
                    vol.volume_id, vol.staging, vol.pid)
        for target in vol.targets:
            mounts.unmount(target, lazy=True)
        mounts.unmount(vol.staging, lazy=True)
        _kill_stale(vol.pid)
        self._start(vol, self.store.load_secrets(vol.key))
        for target, readonly in vol.targets.items():
            mounts.bind(vol.staging, target, readonly)
        self._save()
        log.info("volume %s: mounted again (pid %s) and %d target(s) bound", vol.volume_id, vol.pid,
                 len(vol.targets))

    def _start(self, vol: Volume, env: dict[str, str]) -> None:
        os.makedirs(vol.staging, exist_ok=True)
        values = {**vol.values, "mountpoint": vol.staging, "cache_dir": vol.cache_dir,
                  "cache_size": vol.allocation, "allow_other": True,
                  "staging_size": vol.values.get("staging_size") or max(MIN_ALLOCATION, vol.allocation // 4),
                  "metrics_port": self.node.metrics_port, "metrics_host": self.node.metrics_host,
                  "drain_timeout": self.node.drain_timeout}
        try:
            cfg = build_config(values)
            started = launcher.start(cfg, secrets=env)
        except launcher.StartFailed as exc:
            raise CsiError(_EXIT_TO_CODE.get(exc.exit_code, "INTERNAL"), f"volume {vol.volume_id}: {exc}") from None
        except ConfigError as exc:
            raise invalid(f"volume {vol.volume_id}: {exc}") from None
        except CachefsError as exc:
            raise internal(f"volume {vol.volume_id}: {exc}") from None
        vol.pid = started.pid
        log.info("volume %s: daemon pid %d mounted at %s (cache %s, %d bytes)", vol.volume_id, vol.pid,
                 vol.staging, vol.cache_dir, vol.allocation)

    def _stop(self, vol: Volume) -> None:
        if mounts.state(vol.staging) == "live":
            result = subprocess.run([sys.executable, "-m", "cachefs", "umount", vol.staging,
                                     "--timeout", str(self.node.drain_timeout)], capture_output=True, text=True)
            if result.returncode != 0:
                raise CsiError("UNAVAILABLE", f"volume {vol.volume_id}: cannot unmount: "
                               f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else 'failed'}")
        else:
            mounts.unmount(vol.staging, lazy=True)
        if vol.pid and not launcher.wait_exit(vol.pid, 10):
            _kill_stale(vol.pid)

    def _warm(self, vol: Volume, wait: bool) -> None:
        if not vol.warmup:
            return
        command = [sys.executable, "-m", "cachefs", "warmup", "-q",
                   *[os.path.join(vol.staging, p) for p in vol.warmup], *([] if wait else ["--detach"])]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            log.warning("volume %s: warmup exited %d: %s", vol.volume_id, result.returncode,
                        result.stderr.strip()[-300:])

    # ---- plumbing ----------------------------------------------------------------------------
    @contextmanager
    def _volume_lock(self, volume_id: str):
        with self._meta:
            lock = self._locks.setdefault(volume_id, threading.Lock())
        with lock:
            yield

    def _save(self) -> None:
        with self._meta:
            self.store.save(self.volumes)


def _healthy(vol: Volume) -> bool:
    return daemon_alive(vol.pid) and mounts.state(vol.staging) == "live"


def daemon_alive(pid: int | None) -> bool:
    """``pid`` is a running cachefs daemon (pids get reused: check its command line)."""
    if not pid or not launcher.process_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"_daemon" in fh.read()
    except OSError:
        return False


def _kill_stale(pid: int | None) -> None:
    """SIGKILL a wedged old daemon (checked to be a cachefs daemon: pids get reused)."""
    if not daemon_alive(pid):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return
    launcher.wait_exit(pid, 10)


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass
