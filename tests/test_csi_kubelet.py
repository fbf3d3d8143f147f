"""A kubelet stand-in (DESIGN §3): kubelet's real paths and calls, a scratch kubelet root made
rshared, the plugin in its own PID and mount namespace (as in its container), and an app "pod" in a
slave mount namespace reading the volume in a loop.

- kill -9 the plugin and start it again: the pod's reads go on with zero errors (the daemons live
  under the node agent, not in the plugin), and the new plugin adopts the volume;
- kill -9 the volume's daemon: within 10 s new opens in the pod work again (the agent mounts the
  volume again and re-binds the target), and a file written before the kill, still only in the
  write-back journal, reaches the bucket (the new daemon replays the journal);
- unpublish and unstage leave nothing mounted and no daemon behind.
"""

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from mounts import put_tree, require_fuse
from test_csi_fixtures import SECRETS, Driver, capability, cleanup_mounts, mounted_under, static_context, wait_for

from cachefs.demo.local_s3 import s3_client
from csi.proto import pb

pytestmark = pytest.mark.fuse

DRIVER = "csi.cachefs.io"
FILES = {f"f{i:02d}.txt": f"file {i} ".encode() * (50 + i) for i in range(20)}

# The pod: opens a new file each turn, checks its bytes, and rewrites a status file (ok, errors,
# time of the last good read).
READER = r"""
import json, os, sys, time
target, status, expected = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
ok = err = 0; last_ok = 0.0; names = sorted(expected); i = 0; errors = []
while True:
    name = names[i % len(names)]; i += 1
    try:
        with open(os.path.join(target, name), "rb") as fh:
            good = fh.read() == expected[name].encode()
    except OSError as exc:
        good = False; errors.append(f"{time.time():.2f} {name} {exc.strerror}")
    if good:
        ok += 1; last_ok = time.time()
    else:
        err += 1
    with open(status + ".tmp", "w") as fh:
        json.dump({"ok": ok, "err": err, "last_ok": last_ok, "errors": errors[-5:]}, fh)
    os.replace(status + ".tmp", status)
    time.sleep(0.02)
"""


class Pod:
    def __init__(self, target: str, status: Path) -> None:
        self.status_path = status
        expected = json.dumps({k: v.decode() for k, v in FILES.items()})
        self.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "slave", sys.executable, "-c", READER,
                                      target, str(status), expected], start_new_session=True)

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


def test_mounts_survive_plugin_and_daemon_kills(kubelet_root, tmp_path, s3_server, bucket):
    client = s3_client(s3_server.endpoint_url)
    put_tree(client, bucket, "data", FILES)
    handle, pv, pod_uid = "vol-kubelet", "pv-data", str(uuid.uuid4())
    staging = kubelet_root / f"plugins/kubernetes.io/csi/{DRIVER}/{hashlib.sha256(handle.encode()).hexdigest()}/globalmount"
    target = kubelet_root / f"pods/{pod_uid}/volumes/kubernetes.io~csi/{pv}/mount"
    staging.parent.mkdir(parents=True)
    target.parent.mkdir(parents=True)
    (tmp_path / "plugin").mkdir()
    drv = Driver(tmp_path / "plugin", plugin_prefix=["unshare", "--mount", "--pid", "--fork", "--kill-child"])
    pod = None
    try:
        drv.start_agent()
        drv.start_plugin()
        ctx = static_context(s3_server.endpoint_url, bucket, logSyncPeriod="60")
        drv.node.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id=handle, staging_target_path=str(staging), volume_capability=capability(), volume_context=ctx,
            secrets=SECRETS), timeout=120)
        publish = pb.NodePublishVolumeRequest(
            volume_id=handle, staging_target_path=str(staging), target_path=str(target),
            volume_capability=capability(), volume_context={
                **ctx, "csi.storage.k8s.io/pod.name": "trainer-0", "csi.storage.k8s.io/pod.namespace": "default",
                "csi.storage.k8s.io/pod.uid": pod_uid, "csi.storage.k8s.io/serviceAccount.name": "default",
                "csi.storage.k8s.io/ephemeral": "false"})
        drv.node.NodePublishVolume(publish, timeout=60)
        pod = Pod(str(target), tmp_path / "pod.json")
        wait_for(lambda: pod.status()["ok"] >= 20, 30, "the pod's first reads")
        assert pod.status()["err"] == 0, pod.status()

        # 1. the plugin dies and comes back: no read fails, the new plugin adopts the volume
        before = pod.status()
        drv.kill_plugin()
        time.sleep(2)
        during = pod.status()
        assert during["err"] == 0 and during["ok"] > before["ok"] + 20, during
        drv.start_plugin()
        drv.node.NodePublishVolume(publish, timeout=60)                # kubelet retries: idempotent
        stats = drv.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_id=handle, volume_path=str(target)))
        assert not stats.volume_condition.abnormal
        assert pod.status()["err"] == 0, pod.status()

        # 2. the daemon dies with a file only in its journal: mounted again, journal replayed
        (target / "written.txt").write_bytes(b"staged before the crash")
        assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix="data/written.txt")
        [pid] = drv.daemon_pids()
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        wait_for(lambda: pod.status()["last_ok"] > killed_at + 0.5, 10, "new opens in the pod after the daemon died")
        after = pod.status()
        recovered = time.time() - killed_at
        wait_for(lambda: "Contents" in client.list_objects_v2(Bucket=bucket, Prefix="data/written.txt"), 30,
                 "the journalled file in the bucket")
        assert client.get_object(Bucket=bucket, Key="data/written.txt")["Body"].read() == b"staged before the crash"
        assert (target / "written.txt").read_bytes() == b"staged before the crash"
        assert drv.daemon_pids() != [pid] and len(drv.daemon_pids()) == 1
        stats = drv.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_id=handle, volume_path=str(target)))
        assert not stats.volume_condition.abnormal
        print(f"reads recovered {recovered:.1f} s after the daemon was killed; {after['err']} failed meanwhile")

        # 3. unpublish + unstage: nothing mounted, no daemon
        pod.stop()
        pod = None
        drv.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=handle, target_path=str(target)))
        drv.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id=handle, staging_target_path=str(staging)),
                                   timeout=120)
        assert mounted_under(kubelet_root) == []
        wait_for(lambda: drv.daemon_pids() == [], 10, "the daemon to exit")
    finally:
        if pod is not None:
            pod.stop()
        pids = drv.daemon_pids()
        drv.stop()
        cleanup_mounts(tmp_path)
        for leftover in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(leftover, signal.SIGKILL)
