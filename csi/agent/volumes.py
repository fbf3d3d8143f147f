"""The agent's engine: stage, publish, unpublish, unstage, stats, and repair of dead daemons.

Each call: validate, lock the volume, look it up, check preconditions, act idempotently, persist.
A volume's daemon is started with ``cachefs.launcher.start`` in its own session (never a child of
the plugin), its credentials on its stdin, and mounts at the volume's *home*, a directory of the
agent's state dir that no container sees. The staging path and every published target are views of
that mount (``mounts.place_view``), each its own peer group.

The watchdog (``check_all``) finds a volume whose daemon died (ENOTCONN, or nothing mounted),
starts a new daemon on the same cache dir (which replays the write-back journal) and places a view
of its mount *on top of* the dead view at the staging path and at every target, never detaching
the dead one first: the path is never an empty directory, and every container holding a slave copy
of the target (``mountPropagation: HostToContainer``) receives the new mount. A container with a
private copy cannot be reached from outside; ``stats`` reports the volume abnormal while any such
stale view exists on the node. Dead layers under a live view are removed with the view.
"""

import logging
import os
import shutil
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass

from cachefs import launcher
from cachefs.config import build_config
from cachefs.errors import CachefsError, ConfigError, ExitCode
from csi.agent import mounts
from csi.agent.metrics import AgentMetrics
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
    agent_metrics_port: int = 0     # the agent's own metrics (repairs, abnormal volumes); 0: none


class VolumeManager:
    def __init__(self, node: NodeConfig, metrics: AgentMetrics | None = None) -> None:
        self.node = node
        self.metrics = metrics or AgentMetrics()
        self.store = StateStore(node.state_dir)
        self.volumes = self.store.load()
        self._meta = threading.Lock()           # guards self.volumes, allocations and saving
        self.yielded = False                    # a new agent has taken over: no repairs
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
            key = volume_key(volume_id)
            vol = Volume(volume_id, staging, values, os.path.join(self.node.cache_root, key), allocation,
                         warmup=warm, home=os.path.join(self.node.state_dir, "mounts", key))
            self.volumes[volume_id] = vol
        return vol

    def _forget(self, vol: Volume) -> None:
        self.metrics.forget(vol.volume_id)
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
                mounts.place_view(staging, target, readonly)
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
        message = self._stale_message(vol)
        st = os.statvfs(path)
        return {"abnormal": bool(message), "message": message, "bytes": [st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize],
                "inodes": [st.f_files, st.f_favail]}

    def _stale_message(self, vol: Volume) -> str:
        """Why the volume is abnormal although mounted: containers still read a dead connection."""
        with self._volume_lock(vol.volume_id):
            stale = mounts.stale_views(set(vol.dead_devices), _own_paths(vol))
            if not stale and vol.dead_devices:
                vol.dead_devices.clear()          # every container that held a dead view is gone
                self._save()
        self.metrics.abnormal(vol.volume_id, bool(stale))
        if not stale:
            return ""
        return (f"the volume's daemon died and was mounted again ({vol.repairs} repair(s)); {stale} container "
                f"view(s) on this node still show the dead mount and fail with 'Transport endpoint is not "
                f"connected': they were mounted without mountPropagation: HostToContainer; restart those pods")

    def list(self) -> dict:
        return {"volumes": {vid: {"staging": v.staging, "pid": v.pid, "targets": v.targets,
                                  "state": mounts.state(v.staging)} for vid, v in self.volumes.items()}}

    # ---- daemons -----------------------------------------------------------------------------
    def yield_volumes(self) -> None:
        """A new agent takes over: stop repairing (its keepers will hold the volumes), keep the state."""
        self.yielded = True
        self._save()

    def take_over_all(self) -> None:
        """Take every live volume from the keepers of the agent this one replaces: a keeper of this
        agent adopts each mount (``launcher.start(adopt=True)``): readers pause, never fail. A volume
        that is not live, or whose keeper does not answer, is left to the watchdog's repair."""
        for vid in list(self.volumes):
            with self._volume_lock(vid):
                vol = self.volumes.get(vid)
                if vol is None or not _healthy(vol):
                    continue
                old = vol.pid
                try:
                    started = launcher.start(self._config(vol), secrets=self.store.load_secrets(vol.key),
                                             adopt=True)
                except CachefsError as exc:
                    log.warning("volume %s: not taken over (%s); left to the watchdog", vid, exc)
                    continue
                vol.pid = started.keeper_pid or started.pid
                log.info("volume %s: taken over from keeper pid %s by keeper pid %s (daemon pid %d)", vid, old,
                         vol.pid, started.pid)
        self._save()

    def check_all(self) -> None:
        """The watchdog's tick: repair every staged volume whose mount is not live."""
        if self.yielded:
            return
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
        """Mount a dead volume again: a new daemon at its home, and new views on top of the dead ones
        (containers' slave copies receive them; the dead layers go with the view at unpublish)."""
        log.warning("volume %s: the mount at %s is not live (daemon pid %s); mounting it again",
                    vol.volume_id, vol.staging, vol.pid)
        self.metrics.abnormal(vol.volume_id, True)
        dead = mounts.entry(vol.staging)
        if dead is not None and dead.fstype == mounts.FSTYPE and dead.devno not in vol.dead_devices:
            vol.dead_devices.append(dead.devno)
        _kill_stale(vol.pid)
        if vol.home is None:                      # staged by an older agent: its daemon mounted at staging
            vol.home = os.path.join(self.node.state_dir, "mounts", vol.key)
        mounts.unmount(vol.home, lazy=True)       # the dead daemon's own mount: no container holds it
        self._start(vol, self.store.load_secrets(vol.key))
        for target, readonly in vol.targets.items():
            if not (mounts.same_mount(target, vol.staging) and mounts.state(target) == "live"):
                mounts.place_view(vol.staging, target, readonly)
        vol.repairs += 1
        self.metrics.repaired(vol.volume_id)
        self._save()
        log.info("volume %s: mounted again (pid %s) and %d target(s) given a view of the new mount (repair %d)",
                 vol.volume_id, vol.pid, len(vol.targets), vol.repairs)

    def _config(self, vol: Volume):
        """The mount config of the volume's daemon."""
        return build_config({**vol.values, "mountpoint": vol.home, "cache_dir": vol.cache_dir,
                             "cache_size": vol.allocation, "allow_other": True,
                             "staging_size": vol.values.get("staging_size") or max(MIN_ALLOCATION,
                                                                                   vol.allocation // 4),
                             "metrics_port": self.node.metrics_port, "metrics_host": self.node.metrics_host,
                             "drain_timeout": self.node.drain_timeout, "volume_id": vol.volume_id})

    def _start(self, vol: Volume, env: dict[str, str]) -> None:
        """Start the volume's daemon at its home and put a view of it on the staging path."""
        _ensure_dir(vol.staging)
        _ensure_dir(vol.home)
        try:
            cfg = self._config(vol)
            started = launcher.start(cfg, secrets=env)
        except launcher.StartFailed as exc:
            raise CsiError(_EXIT_TO_CODE.get(exc.exit_code, "INTERNAL"), f"volume {vol.volume_id}: {exc}") from None
        except ConfigError as exc:
            raise invalid(f"volume {vol.volume_id}: {exc}") from None
        except CachefsError as exc:
            raise internal(f"volume {vol.volume_id}: {exc}") from None
        vol.pid = started.keeper_pid or started.pid     # the keeper outlives the daemons it restarts
        if mounts.state(vol.staging) != "live" or not mounts.same_mount(vol.staging, vol.home):
            mounts.place_view(vol.home, vol.staging, False)
        log.info("volume %s: daemon pid %d mounted at %s, seen at %s (cache %s, %d bytes)", vol.volume_id,
                 vol.pid, vol.home, vol.staging, vol.cache_dir, vol.allocation)

    def _stop(self, vol: Volume) -> None:
        """Drain the daemon's staged writes, remove every view and its mount, wait for it to exit."""
        own = vol.home if vol.home and mounts.entry(vol.home) is not None else vol.staging
        if mounts.state(own) == "live":
            try:
                launcher.drain_writes(own, self.node.drain_timeout)
            except CachefsError as exc:
                raise CsiError("UNAVAILABLE", f"volume {vol.volume_id}: cannot unmount: {exc}") from None
        mounts.unmount(vol.staging, lazy=True)
        if vol.home:
            mounts.unmount(vol.home, lazy=True)
            _rmdir(vol.home)
        if vol.pid and not launcher.wait_exit(vol.pid, 10):
            _kill_stale(vol.pid)

    def _warm(self, vol: Volume, wait: bool) -> None:
        if not vol.warmup:
            return
        try:
            final = launcher.warm(vol.staging, vol.warmup, detach=not wait)
        except CachefsError as exc:
            log.warning("volume %s: warmup of %s: %s", vol.volume_id, ", ".join(vol.warmup), exc)
            return
        if final is not None and final.get("listed"):
            log.info("volume %s: warmed %s; listed %d entries through the mount in %.1f s", vol.volume_id,
                     ", ".join(vol.warmup), final["listed"]["entries"], final["listed"]["seconds"])
        if final is not None and (final["state"] != "done" or final.get("failed_files")):
            log.warning("volume %s: warmup of %s ended %s (%s failed file(s)): %s", vol.volume_id,
                        ", ".join(vol.warmup), final["state"], final.get("failed_files"), final.get("error_detail"))

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
            self.metrics.volumes.set(len(self.volumes))


def _own_paths(vol: Volume) -> set[str]:
    """Where the agent itself keeps views of the volume (other namespaces' copies of these paths
    belong to CSI components, not to pods reading the data)."""
    return {vol.staging, *vol.targets, *([vol.home] if vol.home else [])}


def _healthy(vol: Volume) -> bool:
    return daemon_alive(vol.pid) and mounts.state(vol.staging) == "live"


def daemon_alive(pid: int | None) -> bool:
    """``pid`` is a running cachefs daemon or the keeper of one (pids get reused: check its
    command line)."""
    if not pid or not launcher.process_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read()
    except OSError:
        return False
    return b"_daemon" in cmdline or b"_keeper" in cmdline


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(child) for child in fh.read().split()]
    except OSError:
        return []


def _kill_stale(pid: int | None) -> None:
    """SIGKILL a wedged old daemon, or a keeper and the daemons it runs (checked to be cachefs
    processes: pids get reused). The keeper first, so that it starts no new daemon."""
    if not daemon_alive(pid):
        return
    victims = [pid] + [child for child in _children(pid) if daemon_alive(child)]
    for victim in victims:
        try:
            os.kill(victim, signal.SIGKILL)
        except OSError:
            pass
    for victim in victims:
        launcher.wait_exit(victim, 10)


def _ensure_dir(path: str) -> None:
    """``path`` exists (a dead mount there fails every stat, which makedirs takes for missing)."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        pass


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass
