"""A kubelet stand-in: kubelet's real paths and calls, a scratch kubelet root made rshared, the
plugin in its own PID and mount namespace (as in its container, kubelet's tree shared with it as
with Bidirectional propagation), and app "containers" that each bind the published target into
their own mount namespace at their own path, as a container runtime does, and read only through
that path: one a slave copy (``mountPropagation: HostToContainer``), one private (no propagation).

- kill -9 the plugin and start it again: the containers' reads go on with zero errors (the daemons
  live under the node agent, not in the plugin), and the new plugin adopts the volume;
- kill -9 the volume's daemon, five times in a row: its keeper holds the FUSE connection and starts
  the next daemon on it, so every container (slave, private, read-only) reads on with zero errors
  and right bytes, a file written before the first kill (only in the write-back journal) reaches
  the bucket, and the agent repairs nothing;
- kill -9 the keeper and the daemon together, three times: the agent mounts the volume again; each
  time the slave container reads the right bytes again within 10 s and never sees an empty
  directory, a read-only target stays read-only in its container; the private container cannot be
  repaired and NodeGetVolumeStats says so until it exits; the agent counts the repairs;
- unpublish and unstage leave nothing mounted and no daemon behind;
- a rolling update of the node agent (the agent in a mount namespace of its own, the host's PIDs as
  with hostPID): a new agent starts beside it, takes each volume's mount from the old agent's keeper
  into a keeper of its own, and tells the old agent to exit; nothing of the old "container" is left
  running, and the slave and the private containers read on with zero errors, a file held open too;
- kill -9 the node agent three times under ``--supervise``: the supervisor starts it again, the
  keepers serve on, nothing is repaired, and the containers read on with zero errors.
"""

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from csi_fixtures import SECRETS, Driver, capability, cleanup_mounts, mounted_under, static_context, wait_for
from mounts import put_tree, require_fuse

from cachefs.launcher import process_alive
from csi.proto import pb
from testing.s3 import free_port, s3_client

pytestmark = pytest.mark.fuse

DRIVER = "csi.cachefs.io"
FILES = {f"f{i:02d}.txt": f"file {i} ".encode() * (50 + i) for i in range(20)}

# The container's process: opens a new file each turn, checks its bytes, and rewrites a status file
# (good reads, failed reads, wrong bytes, files missing from the listing, writes that a read-only
# view let through, time of the last good read).
READER = r"""
import json, os, sys, time
view, status, expected, readonly = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4] == "ro"
ok = err = wrong = missing = written = 0; last_ok = 0.0; max_gap = 0.0; names = sorted(expected); i = 0; errors = []
events = open(status.rsplit(".", 1)[0] + ".log", "a", buffering=1)   # "TIME ok|err" at each change
state = None
def mark(now):
    global state
    if now != state:
        events.write(f"{time.time():.6f} {now}\n"); state = now
while True:
    name = names[i % len(names)]; i += 1
    try:
        with open(os.path.join(view, name), "rb") as fh:
            data = fh.read()
        if data == expected[name].encode():
            now = time.time(); max_gap = max(max_gap, now - last_ok) if last_ok else 0.0
            ok += 1; last_ok = now; mark("ok")
        else:
            wrong += 1
        if i % 10 == 0 and set(names) - set(os.listdir(view)):
            missing += 1                       # a live view that lists without the dataset's files
        if readonly and i % 10 == 0:
            try:
                with open(os.path.join(view, "ro-probe.txt"), "wb") as fh:
                    fh.write(b"x")
                written += 1
            except OSError:
                pass
    except FileNotFoundError as exc:
        missing += 1; errors.append(f"{time.time():.2f} {name} {exc.strerror}")
    except OSError as exc:
        err += 1; errors.append(f"{time.time():.2f} {name} {exc.strerror}"); mark("err")
    with open(status + ".tmp", "w") as fh:
        json.dump({"ok": ok, "err": err, "wrong": wrong, "missing": missing, "written": written,
                   "last_ok": last_ok, "max_gap": max_gap, "errors": errors[-5:]}, fh)
    os.replace(status + ".tmp", status)
    time.sleep(0.02)
"""

# The container runtime's part: a mount namespace of the container's own (a slave copy of the host's
# mounts with HostToContainer, a private one without), the target bound at the container's own path.
CONTAINER = r"""
set -e
mount --bind "$1" "$2"
[ "$3" = private ] && mount --make-private "$2"
shift 3
exec "$@"
"""


class Pod:
    """A container reading the volume through its own bind of ``target`` at ``view``."""

    def __init__(self, target: str, status: Path, *, propagation: str = "slave", view: Path | None = None,
                 readonly: bool = False) -> None:
        self.status_path = status
        expected = json.dumps({k: v.decode() for k, v in FILES.items()})
        view = view or status.with_suffix(".view")
        view.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "slave", "sh", "-c", CONTAINER,
                                      "container", target, str(view), propagation, sys.executable, "-c", READER,
                                      str(view), str(status), expected, "ro" if readonly else "rw"],
                                     start_new_session=True)

    def status(self) -> dict:
        for _ in range(50):
            with contextlib.suppress(FileNotFoundError, ValueError):
                return json.loads(self.status_path.read_text())
            time.sleep(0.02)
        raise AssertionError("the pod wrote no status")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def kubelet_root(tmp_path: Path):
    require_fuse()
    root = tmp_path / "kubelet"
    root.mkdir()
    subprocess.run(["mount", "--bind", str(root), str(root)], check=True)
    subprocess.run(["mount", "--make-rshared", str(root)], check=True)
    yield root
    cleanup_mounts(tmp_path)
    subprocess.run(["umount", "-l", str(root)], capture_output=True)


KILLS = 5          # daemon kills the keeper rides out
CRASHES = 3        # keeper-and-daemon kills the agent repairs


def publish_request(handle: str, staging: Path, target: Path, ctx: dict, pod_uid: str, readonly: bool = False):
    return pb.NodePublishVolumeRequest(
        volume_id=handle, staging_target_path=str(staging), target_path=str(target), readonly=readonly,
        volume_capability=capability(), volume_context={
            **ctx, "csi.storage.k8s.io/pod.name": "trainer-0", "csi.storage.k8s.io/pod.namespace": "default",
            "csi.storage.k8s.io/pod.uid": pod_uid, "csi.storage.k8s.io/serviceAccount.name": "default",
            "csi.storage.k8s.io/ephemeral": "false"})


def agent_metric(port: int, name: str, volume_id: str, default: float | None = None) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(f'{name}{{volume_id="{volume_id}"}}'):
            return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default
    raise AssertionError(f"{name} for {volume_id} not exported:\n{text}")


def test_mounts_survive_plugin_and_daemon_kills(kubelet_root, tmp_path, s3_server, bucket):
    client = s3_client(s3_server.endpoint_url)
    put_tree(client, bucket, "data", FILES)
    handle, pv = "vol-kubelet", "pv-data"
    uids = [str(uuid.uuid4()) for _ in range(2)]
    staging = kubelet_root / f"plugins/kubernetes.io/csi/{DRIVER}/{hashlib.sha256(handle.encode()).hexdigest()}/globalmount"
    target, target_ro = (kubelet_root / f"pods/{uid}/volumes/kubernetes.io~csi/{pv}/mount" for uid in uids)
    for path in (staging, target, target_ro):
        path.parent.mkdir(parents=True)
    (tmp_path / "plugin").mkdir()
    agent_port = free_port()
    # the plugin's container shares kubelet's tree (Bidirectional propagation)
    drv = Driver(tmp_path / "plugin", agent_metrics_port=agent_port,
                 plugin_prefix=["unshare", "--mount", "--propagation", "unchanged", "--pid", "--fork", "--kill-child"])
    pods: list[Pod] = []
    try:
        drv.start_agent()
        drv.start_plugin()
        ctx = static_context(s3_server.endpoint_url, bucket, logSyncPeriod="60")
        drv.node.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id=handle, staging_target_path=str(staging), volume_capability=capability(), volume_context=ctx,
            secrets=SECRETS), timeout=120)
        drv.node.NodePublishVolume(publish_request(handle, staging, target, ctx, uids[0]), timeout=60)
        drv.node.NodePublishVolume(publish_request(handle, staging, target_ro, ctx, uids[1], readonly=True),
                                   timeout=60)
        slave = Pod(str(target), tmp_path / "slave.json")
        private = Pod(str(target), tmp_path / "private.json", propagation="private")
        slave_ro = Pod(str(target_ro), tmp_path / "slave-ro.json", readonly=True)
        pods = [slave, private, slave_ro]
        for pod in pods:
            wait_for(lambda pod=pod: pod.status()["ok"] >= 20, 30, "the containers' first reads")
            assert pod.status()["err"] == 0, pod.status()

        # 1. the plugin dies and comes back: no read fails, the new plugin adopts the volume
        before = slave.status()
        drv.kill_plugin()
        time.sleep(2)
        during = slave.status()
        assert during["err"] == 0 and during["ok"] > before["ok"] + 20, during
        drv.start_plugin()
        drv.node.NodePublishVolume(publish_request(handle, staging, target, ctx, uids[0]), timeout=60)  # idempotent
        stats = drv.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_id=handle, volume_path=str(target)))
        assert not stats.volume_condition.abnormal
        assert all(pod.status()["err"] == 0 for pod in pods), [pod.status() for pod in pods]

        # 2. the daemon dies, KILLS times in a row: its keeper holds the FUSE connection and starts the
        #    next daemon on it: every container, the private one included, reads on with zero errors
        (target / "written.txt").write_bytes(b"staged before the crash")
        assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix="data/written.txt")
        for _ in range(KILLS):
            [pid] = drv.daemon_pids()
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda pid=pid: len(drv.daemon_pids()) == 1 and drv.daemon_pids() != [pid], 10,
                     "the keeper's new daemon")
            time.sleep(2.3)                 # the keeper gives up on daemons that die within 2 s of serving
        wait_for(lambda: "Contents" in client.list_objects_v2(Bucket=bucket, Prefix="data/written.txt"), 30,
                 "the journalled file in the bucket")
        assert client.get_object(Bucket=bucket, Key="data/written.txt")["Body"].read() == b"staged before the crash"
        for pod in pods:
            status = pod.status()
            assert status["err"] == 0 and status["wrong"] == 0 and status["missing"] == 0, status
        assert agent_metric(agent_port, "cachefs_csi_volume_repairs_total", handle, default=0) == 0
        assert not drv.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
            volume_id=handle, volume_path=str(target))).volume_condition.abnormal

        # 3. the keeper and the daemon both die (the volume's processes are gone), CRASHES times: the agent
        #    mounts the volume again; the slave containers read the right bytes again within 10 s
        gaps = []
        first_kill = None
        for _ in range(CRASHES):
            [pid] = drv.daemon_pids()
            # stamped before the kill: a container's failure can be logged before the killer reads
            # the clock again (two CPUs, the killer descheduled), and must count as after the kill
            before_kill = time.time()
            drv.kill_volume_processes()
            killed_at = time.time()
            first_kill = first_kill or before_kill
            for pod in (slave, slave_ro):
                wait_for(lambda pod=pod, t=killed_at: pod.status()["last_ok"] > t + 0.3, 10,
                         "the slave container's reads after the volume's processes died")
            gaps.append(recovery_gap(slave.status_path.with_suffix(".log"), before_kill))
            wait_for(lambda pid=pid: len(drv.daemon_pids()) == 1 and drv.daemon_pids() != [pid], 10, "the new daemon")
        assert (target / "written.txt").read_bytes() == b"staged before the crash"
        for pod in (slave, slave_ro):
            status = pod.status()
            assert status["wrong"] == 0 and status["missing"] == 0, status    # never wrong bytes, never empty
        assert slave_ro.status()["written"] == 0, "a read-only target became writable in its container"
        # the private container never recovers: its view is a copy of the first dead mount (a read
        # already under way at the kill may still finish; none succeeds after its first failure)
        private_log = private.status_path.with_suffix(".log")
        assert private.status()["ok"] > 0 and never_recovered(private_log, first_kill), \
            (private.status(), first_kill, private_log.read_text()[-2000:])
        stats = drv.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_id=handle, volume_path=str(target)))
        assert stats.volume_condition.abnormal and "HostToContainer" in stats.volume_condition.message, stats
        assert agent_metric(agent_port, "cachefs_csi_volume_repairs_total", handle) == CRASHES
        assert agent_metric(agent_port, "cachefs_csi_volume_abnormal", handle) == 1
        private.stop()                                  # the pod is restarted: nothing holds a dead view
        pods.remove(private)
        wait_for(lambda: not drv.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
            volume_id=handle, volume_path=str(target))).volume_condition.abnormal, 10, "a normal volume condition")
        assert agent_metric(agent_port, "cachefs_csi_volume_abnormal", handle) == 0
        gaps.sort()
        print(f"slave container: right bytes again {gaps[len(gaps) // 2]:.2f} s (p50), {gaps[-1]:.2f} s (max) "
              f"after each of {CRASHES} crashes of the volume's processes")
        assert gaps[-1] < 10

        # 4. unpublish + unstage: nothing mounted (dead layers included), no daemon
        for pod in pods:
            pod.stop()
        pods = []
        for path in (target, target_ro):
            drv.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=handle, target_path=str(path)))
        drv.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id=handle, staging_target_path=str(staging)),
                                   timeout=120)
        assert mounted_under(kubelet_root) == []
        assert mounted_under(tmp_path / "plugin") == []
        wait_for(lambda: drv.daemon_pids() == [], 10, "the daemon to exit")
    finally:
        for pod in pods:
            pod.stop()
        pids = drv.process_pids()
        drv.stop()
        cleanup_mounts(tmp_path)
        for leftover in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(leftover, signal.SIGKILL)


def never_recovered(log: Path, killed_at: float) -> bool:
    """Whether the container failed after ``killed_at`` and never read right again since."""
    events = [line.split() for line in log.read_text().splitlines()]
    failed = [float(t) for t, kind in events if kind == "err" and float(t) >= killed_at]
    return bool(failed) and not any(kind == "ok" and float(t) > failed[0] for t, kind in events)


def recovery_gap(log: Path, killed_at: float) -> float:
    """Seconds from ``killed_at`` to the container's first good read after the failures it caused."""
    events = [line.split() for line in log.read_text().splitlines()]
    failed = [float(t) for t, kind in events if kind == "err" and float(t) >= killed_at]
    assert failed, "the container saw no failure after the kill"
    return min(float(t) for t, kind in events if kind == "ok" and float(t) > failed[0]) - killed_at


class Staged:
    """A volume staged and published by an agent and a plugin, each in a "container" of its own (the
    agent's shares the host's PID namespace, as with hostPID, and has its own mount table), read by a
    slave and a private container; a file written and one held open."""

    def __init__(self, tmp_path: Path, agent_args: list[str]) -> None:
        (tmp_path / "plugin").mkdir()
        container = ["unshare", "--mount", "--propagation", "unchanged"]
        self.drv = Driver(tmp_path / "plugin", agent_prefix=container, plugin_prefix=container,
                          agent_args=agent_args)
        self.pods: list[Pod] = []
        self.held = None

    def start(self, kubelet_root: Path, tmp_path: Path, endpoint: str, bucket: str) -> None:
        handle, pv, uid = "vol-update", "pv-update", str(uuid.uuid4())
        digest = hashlib.sha256(handle.encode()).hexdigest()
        self.handle = handle
        self.staging = kubelet_root / f"plugins/kubernetes.io/csi/{DRIVER}/{digest}/globalmount"
        self.target = kubelet_root / f"pods/{uid}/volumes/kubernetes.io~csi/{pv}/mount"
        for path in (self.staging, self.target):
            path.parent.mkdir(parents=True)
        self.drv.start_agent()
        self.drv.start_plugin()
        ctx = static_context(endpoint, bucket, logSyncPeriod="60")
        self.drv.node.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id=handle, staging_target_path=str(self.staging), volume_capability=capability(),
            volume_context=ctx, secrets=SECRETS), timeout=120)
        self.drv.node.NodePublishVolume(publish_request(handle, self.staging, self.target, ctx, uid), timeout=60)
        self.pods = [Pod(str(self.target), tmp_path / "slave.json"),
                     Pod(str(self.target), tmp_path / "private.json", propagation="private")]
        for pod in self.pods:
            wait_for(lambda pod=pod: pod.status()["ok"] >= 20, 30, "the containers' first reads")
        (self.target / "written.txt").write_bytes(b"staged before the update")
        self.name = sorted(FILES)[0]
        self.held = open(self.target / self.name, "rb")     # a file a pod holds open across it all

    def assert_read_on(self, what: str) -> None:
        """The containers read on, with no failure, after ``what``; the open file too."""
        before = {pod: pod.status()["ok"] for pod in self.pods}
        time.sleep(1.0)
        for pod in self.pods:
            status = pod.status()
            assert status["err"] == 0 and status["wrong"] == 0 and status["missing"] == 0, status
            assert status["ok"] > before[pod] + 10, status
            print(f"{what}: longest wait between two good reads {status['max_gap'] * 1000:.0f} ms")
        self.held.seek(0)
        assert self.held.read() == FILES[self.name]
        assert (self.target / "written.txt").read_bytes() == b"staged before the update"
        stats = self.drv.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_id=self.handle,
                                                                              volume_path=str(self.target)))
        assert not stats.volume_condition.abnormal

    def tear_down(self, client, bucket: str, kubelet_root: Path) -> None:
        """Unpublish and unstage: the write reaches the bucket, nothing is left mounted or running."""
        self.close()
        self.drv.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=self.handle,
                                                                        target_path=str(self.target)))
        self.drv.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
            volume_id=self.handle, staging_target_path=str(self.staging)), timeout=120)
        assert client.get_object(Bucket=bucket, Key="data/written.txt")["Body"].read() == b"staged before the update"
        assert mounted_under(kubelet_root) == []
        wait_for(lambda: self.drv.process_pids() == [], 10, "the volume's processes to exit")

    def close(self) -> None:
        for pod in self.pods:
            pod.stop()
        self.pods = []
        if self.held is not None:
            self.held.close()
            self.held = None


@contextlib.contextmanager
def staged(kubelet_root: Path, tmp_path: Path, endpoint: str, bucket: str, agent_args: list[str] | None = None):
    vol = Staged(tmp_path, agent_args or [])
    try:
        vol.start(kubelet_root, tmp_path, endpoint, bucket)
        yield vol
    finally:
        vol.close()
        pids = vol.drv.process_pids()
        vol.drv.stop()
        cleanup_mounts(tmp_path)
        for leftover in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(leftover, signal.SIGKILL)


def test_a_new_agent_takes_the_volumes_over_without_a_failed_read(kubelet_root, tmp_path, s3_server, bucket):
    client = s3_client(s3_server.endpoint_url)
    put_tree(client, bucket, "data", FILES)
    with staged(kubelet_root, tmp_path, s3_server.endpoint_url, bucket) as vol:
        drv = vol.drv
        old = drv.process_pids()                        # keeper, daemon, standby of the old agent's container
        assert len(old) == 3, old
        old_agent = drv.agent

        drv.start_agent(replace=True)                   # the new pod of the DaemonSet (maxSurge)
        old_agent.wait(timeout=60)                      # the old agent exits: its "container" dies
        # Nothing of the old container is left running: when its pod goes, nothing is lost.
        wait_for(lambda: not any(process_alive(pid) for pid in old), 10, "the old container's processes to exit")
        vol.assert_read_on("agent update")
        keepers = drv.process_pids()
        assert len(keepers) == 3 and not set(keepers) & set(old), (keepers, old)
        assert "taken over from keeper" in drv.log("agent.log")
        vol.tear_down(client, bucket, kubelet_root)


def agent_process(drv: Driver) -> int | None:
    """The agent a supervising ``csi-agent --supervise`` runs (its child), once it serves."""
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == drv.agent.pid:
                return int(entry)
    return None


def test_the_agent_killed_under_supervise_costs_no_read(kubelet_root, tmp_path, s3_server, bucket):
    """SIGKILL of the node agent: its supervisor (the container's main process) starts it again, the
    keepers serve on meanwhile, and the new agent finds every volume live: nothing to repair."""
    client = s3_client(s3_server.endpoint_url)
    put_tree(client, bucket, "data", FILES)
    with staged(kubelet_root, tmp_path, s3_server.endpoint_url, bucket, ["--supervise"]) as vol:
        drv = vol.drv
        keepers = drv.process_pids()
        assert len(keepers) == 3, keepers
        for kill in range(1, 4):
            agent = agent_process(drv)
            assert agent is not None
            os.kill(agent, signal.SIGKILL)
            wait_for(lambda agent=agent: agent_process(drv) not in (None, agent), 30, "the agent to start again")
            wait_for(lambda kill=kill: (drv.root / "agent.log").read_text().count("csi-agent serving on") == kill + 1, 30,
                     "the new agent to serve")
            assert drv.agent.poll() is None                 # the container lives on
            vol.assert_read_on("agent SIGKILL")
        assert drv.process_pids() == keepers                # the same keepers, daemon and standby
        log = (drv.root / "agent.log").read_text()
        assert log.count("died (signal 9)") == 3 and "mounting it again" not in log, log
        vol.tear_down(client, bucket, kubelet_root)
        drv.agent.terminate()                               # the pod goes: SIGTERM reaches the agent
        assert drv.agent.wait(timeout=30) == 0
        assert agent_process(drv) is None
