"""The node agent across its own restarts, warmup at stage, rotated secrets, the node cache budget."""

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from csi_fixtures import SECRETS, capability, driver, mounted_under, static_context, wait_for  # noqa: F401
from mounts import put_tree

from csi.agent.state import volume_key
from csi.proto import pb
from testing.s3 import s3_client

pytestmark = pytest.mark.fuse
FILES = {"sub/a.bin": os.urandom(5000), "sub/b.bin": os.urandom(7000), "c.txt": b"c"}


def cached_files(path: str) -> int:
    result = subprocess.run([sys.executable, "-m", "cachefs", "warmup", "--check", "--json", path],
                            capture_output=True, text=True, timeout=60, cwd="/")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])["cached_files"]


def reads(target: Path) -> bool:
    try:
        return (target / "c.txt").read_bytes() == b"c"
    except OSError:
        return False


def test_agent_restarts_adopt_and_repair(driver, tmp_path, s3_server, bucket):
    put_tree(s3_client(s3_server.endpoint_url), bucket, "data", FILES)
    stage, target = tmp_path / "globalmount", tmp_path / "pod/mount"
    stage_req = pb.NodeStageVolumeRequest(
        volume_id="vol-a", staging_target_path=str(stage), volume_capability=capability(), secrets=SECRETS,
        volume_context=static_context(s3_server.endpoint_url, bucket, warmup="sub", warmupWait="true"))
    driver.node.NodeStageVolume(stage_req, timeout=120)
    assert cached_files(str(stage / "sub")) == 2                          # warmed before NodeStage returned
    driver.node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id="vol-a", staging_target_path=str(stage), target_path=str(target), volume_capability=capability()),
        timeout=60)
    [pid] = driver.daemon_pids()

    # the agent dies: mounts and reads go on; the plugin reports it unready; a new agent adopts
    os.killpg(driver.agent.pid, signal.SIGKILL)
    driver.agent.wait()
    assert reads(target)
    with pytest.raises(grpc.RpcError) as info:
        driver.identity.Probe(pb.ProbeRequest())
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    driver.start_agent()
    assert driver.daemon_pids() == [pid] and reads(target)
    stats = driver.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_id="vol-a", volume_path=str(target)))
    assert not stats.volume_condition.abnormal

    # the agent and the volume's processes die (an agent container restart): the new agent mounts it again
    os.killpg(driver.agent.pid, signal.SIGKILL)
    driver.agent.wait()
    driver.kill_volume_processes()
    wait_for(lambda: not reads(target), 5, "the dead mount")
    stats = None
    driver.start_agent()
    try:
        wait_for(lambda: reads(target), 10, "reads after the new agent repaired the volume")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{driver.log('agent.log')}") from None
    assert driver.daemon_pids() not in ([], [pid])

    # rotated secrets replace the kept ones (root-only) at the next stage
    rotated = {**SECRETS, "secretAccessKey": "rotated-secret"}
    stage_req.secrets.clear()
    stage_req.secrets.update(rotated)
    driver.node.NodeStageVolume(stage_req, timeout=120)
    kept = driver.state_dir / "secrets" / f"{volume_key('vol-a')}.json"
    assert json.loads(kept.read_text())["AWS_SECRET_ACCESS_KEY"] == "rotated-secret"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600 and stat.S_IMODE(kept.parent.stat().st_mode) == 0o700

    driver.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id="vol-a", target_path=str(target)))
    driver.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id="vol-a", staging_target_path=str(stage)),
                                  timeout=120)
    assert mounted_under(tmp_path) == [] and not kept.exists()
    assert not (driver.cache_root / volume_key("vol-a")).exists()
    wait_for(lambda: driver.daemon_pids() == [], 10, "the daemon to exit")


def test_node_cache_budget_is_enforced(driver, tmp_path, s3_server, bucket):
    """The agent's budget is 2G: a volume asking for more is RESOURCE_EXHAUSTED, and nothing is mounted."""
    request = pb.NodeStageVolumeRequest(
        volume_id="vol-big", staging_target_path=str(tmp_path / "stage"), volume_capability=capability(),
        secrets=SECRETS, volume_context=static_context(s3_server.endpoint_url, bucket, cacheSize="3G"))
    with pytest.raises(grpc.RpcError) as info:
        driver.node.NodeStageVolume(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "cacheSize" in info.value.details()
    assert mounted_under(tmp_path) == [] and driver.daemon_pids() == []


def test_warmup_without_waiting_runs_in_the_daemon(driver, tmp_path, s3_server, bucket):
    put_tree(s3_client(s3_server.endpoint_url), bucket, "data", FILES)
    stage = tmp_path / "globalmount"
    driver.node.NodeStageVolume(pb.NodeStageVolumeRequest(
        volume_id="vol-w", staging_target_path=str(stage), volume_capability=capability(), secrets=SECRETS,
        volume_context=static_context(s3_server.endpoint_url, bucket, warmup="sub,c.txt")), timeout=120)
    wait_for(lambda: cached_files(str(stage)) == 3, 30, "the detached warmup to cache sub/ and c.txt", interval=0.5)
    driver.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id="vol-w", staging_target_path=str(stage)),
                                  timeout=120)
    assert mounted_under(tmp_path) == []
