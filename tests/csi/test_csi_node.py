"""The CSI driver over gRPC with real mounts and a real S3 server: error codes per RPC, a volume
shared by two pods, read-only publishing, idempotent repeats, secrets that leak nowhere, and a
packed dataset as a volume."""

import errno
import os
import random
import stat
import subprocess
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from csi_fixtures import (  # noqa: F401  (fixtures)
    MODE,
    SECRETS,
    Driver,
    capability,
    cleanup_mounts,
    driver,
    mounted_under,
    static_context,
    wait_for,
)
from mounts import put_tree

from csi.proto import pb
from testing.s3 import free_port, s3_client

pytestmark = pytest.mark.fuse
CODE = grpc.StatusCode


def call_code(method, request) -> tuple[grpc.StatusCode, str]:
    try:
        method(request, timeout=120)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return CODE.OK, ""


def test_identity(driver):
    info = driver.identity.GetPluginInfo(pb.GetPluginInfoRequest())
    assert info.name == "csi.cachefs.io" and info.vendor_version
    caps = driver.identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest()).capabilities
    assert [c.service.type for c in caps] == [pb.PluginCapability.Service.CONTROLLER_SERVICE]
    assert driver.identity.Probe(pb.ProbeRequest()).ready.value is True


def test_node_error_codes(driver, tmp_path, s3_server, bucket):
    ctx = static_context(s3_server.endpoint_url, bucket)
    stage = tmp_path / "stage"
    node = driver.node
    cases = [
        (node.NodeStageVolume, pb.NodeStageVolumeRequest(staging_target_path=str(stage), volume_capability=capability(),
                                                         volume_context=ctx), CODE.INVALID_ARGUMENT, "volume_id"),
        (node.NodeStageVolume, pb.NodeStageVolumeRequest(volume_id="v", volume_capability=capability(),
                                                         volume_context=ctx), CODE.INVALID_ARGUMENT, "staging"),
        (node.NodeStageVolume, pb.NodeStageVolumeRequest(volume_id="v", staging_target_path=str(stage),
                                                         volume_context=ctx), CODE.INVALID_ARGUMENT, "capability"),
        (node.NodeStageVolume, pb.NodeStageVolumeRequest(
            volume_id="v", staging_target_path=str(stage), volume_context=ctx, volume_capability=pb.VolumeCapability(
                block=pb.VolumeCapability.BlockVolume(), access_mode=capability().access_mode)),
         CODE.INVALID_ARGUMENT, "block"),
        (node.NodeStageVolume, pb.NodeStageVolumeRequest(volume_id="v", staging_target_path=str(stage),
                                                         volume_capability=capability(),
                                                         volume_context={**ctx, "cacheSzie": "1G"}),
         CODE.INVALID_ARGUMENT, "'cacheSzie'"),
        (node.NodeStageVolume, pb.NodeStageVolumeRequest(volume_id="v", staging_target_path=str(stage),
                                                         volume_capability=capability(),
                                                         volume_context={**ctx, "cacheSize": "lots"}),
         CODE.INVALID_ARGUMENT, "'cacheSize'"),
        (node.NodeStageVolume, pb.NodeStageVolumeRequest(volume_id="v", staging_target_path=str(stage),
                                                         volume_capability=capability(), volume_context={}),
         CODE.INVALID_ARGUMENT, "'url'"),
        (node.NodeStageVolume, pb.NodeStageVolumeRequest(volume_id="v", staging_target_path=str(stage),
                                                         volume_capability=capability(), volume_context=ctx,
                                                         secrets={"password": "x"}),
         CODE.INVALID_ARGUMENT, "password"),
        (node.NodePublishVolume, pb.NodePublishVolumeRequest(target_path="/t", staging_target_path=str(stage),
                                                             volume_capability=capability()),
         CODE.INVALID_ARGUMENT, "volume_id"),
        (node.NodePublishVolume, pb.NodePublishVolumeRequest(volume_id="v", staging_target_path=str(stage),
                                                             volume_capability=capability()),
         CODE.INVALID_ARGUMENT, "target_path"),
        (node.NodePublishVolume, pb.NodePublishVolumeRequest(volume_id="v", target_path="/t",
                                                             staging_target_path=str(stage)),
         CODE.INVALID_ARGUMENT, "capability"),
        (node.NodePublishVolume, pb.NodePublishVolumeRequest(volume_id="v", target_path=str(tmp_path / "t"),
                                                             staging_target_path=str(stage),
                                                             volume_capability=capability()),
         CODE.FAILED_PRECONDITION, "not staged"),
        (node.NodeUnpublishVolume, pb.NodeUnpublishVolumeRequest(target_path="/t"), CODE.INVALID_ARGUMENT, "volume_id"),
        (node.NodeUnpublishVolume, pb.NodeUnpublishVolumeRequest(volume_id="v"), CODE.INVALID_ARGUMENT, "target"),
        (node.NodeUnstageVolume, pb.NodeUnstageVolumeRequest(staging_target_path="/s"), CODE.INVALID_ARGUMENT,
         "volume_id"),
        (node.NodeUnstageVolume, pb.NodeUnstageVolumeRequest(volume_id="v"), CODE.INVALID_ARGUMENT, "staging"),
        (node.NodeGetVolumeStats, pb.NodeGetVolumeStatsRequest(volume_path="/p"), CODE.INVALID_ARGUMENT, "volume_id"),
        (node.NodeGetVolumeStats, pb.NodeGetVolumeStatsRequest(volume_id="v"), CODE.INVALID_ARGUMENT, "volume_path"),
        (node.NodeGetVolumeStats, pb.NodeGetVolumeStatsRequest(volume_id="nope", volume_path=str(tmp_path)),
         CODE.NOT_FOUND, "not staged"),
    ]
    for method, request, code, words in cases:
        got, details = call_code(method, request)
        assert (got, words in details) == (code, True), (method, request, details)
    assert mounted_under(tmp_path) == []


def test_stage_missing_bucket_is_not_found(driver, tmp_path, s3_server):
    ctx = static_context(s3_server.endpoint_url, f"no-such-{uuid.uuid4().hex[:8]}")
    got, details = call_code(driver.node.NodeStageVolume, pb.NodeStageVolumeRequest(
        volume_id="v", staging_target_path=str(tmp_path / "stage"), volume_capability=capability(),
        volume_context=ctx, secrets=SECRETS))
    assert got == CODE.NOT_FOUND, details
    assert mounted_under(tmp_path) == []
    wait_for(lambda: driver.daemon_pids() == [], 10, "the failed daemon to exit")


def test_controller_error_codes(driver, s3_server, bucket):
    ctl = driver.controller
    caps = [capability()]
    params = {"bucket": bucket, "endpoint": s3_server.endpoint_url}
    cases = [
        (ctl.CreateVolume, pb.CreateVolumeRequest(volume_capabilities=caps, parameters=params), CODE.INVALID_ARGUMENT,
         "name"),
        (ctl.CreateVolume, pb.CreateVolumeRequest(name="v1", parameters=params), CODE.INVALID_ARGUMENT, "capabilities"),
        (ctl.CreateVolume, pb.CreateVolumeRequest(name="v1", volume_capabilities=caps,
                                                  parameters={"endpoint": s3_server.endpoint_url}),
         CODE.INVALID_ARGUMENT, "'bucket'"),
        (ctl.CreateVolume, pb.CreateVolumeRequest(name="v1", volume_capabilities=caps,
                                                  parameters={**params, "immutible": "true"}),
         CODE.INVALID_ARGUMENT, "'immutible'"),
        (ctl.CreateVolume, pb.CreateVolumeRequest(name="v1", volume_capabilities=caps,
                                                  parameters={**params, "onDelete": "shred"}),
         CODE.INVALID_ARGUMENT, "'onDelete'"),
        (ctl.DeleteVolume, pb.DeleteVolumeRequest(), CODE.INVALID_ARGUMENT, "volume_id"),
        (ctl.DeleteVolume, pb.DeleteVolumeRequest(volume_id="not-a-cachefs-volume"), CODE.OK, ""),
        (ctl.ValidateVolumeCapabilities, pb.ValidateVolumeCapabilitiesRequest(volume_capabilities=caps),
         CODE.INVALID_ARGUMENT, "volume_id"),
        (ctl.ValidateVolumeCapabilities, pb.ValidateVolumeCapabilitiesRequest(volume_id="x"), CODE.INVALID_ARGUMENT,
         "capabilities"),
        (ctl.ValidateVolumeCapabilities, pb.ValidateVolumeCapabilitiesRequest(volume_id="x", volume_capabilities=caps),
         CODE.NOT_FOUND, "x"),
    ]
    for method, request, code, words in cases:
        got, details = call_code(method, request)
        assert (got, words in details) == (code, True), (method, request, details)


def test_dynamic_volume_idempotent_and_deleted(driver, s3_server, bucket):
    client = s3_client(s3_server.endpoint_url)
    params = {"bucket": bucket, "endpoint": s3_server.endpoint_url, "prefix": "vols"}
    request = pb.CreateVolumeRequest(name="pvc-1", volume_capabilities=[capability()], parameters=params,
                                     capacity_range=pb.CapacityRange(required_bytes=1 << 30), secrets=SECRETS)
    first = driver.controller.CreateVolume(request).volume
    again = driver.controller.CreateVolume(request).volume
    assert first == again and first.volume_context["url"] == f"s3://{bucket}/vols/pvc-1"
    request.capacity_range.required_bytes = 2 << 30
    assert call_code(driver.controller.CreateVolume, request)[0] == CODE.ALREADY_EXISTS
    with ThreadPoolExecutor(8) as pool:      # more than one DeleteObjects request (1,000 keys each)
        list(pool.map(lambda n: client.put_object(Bucket=bucket, Key=f"vols/pvc-1/d/{n}.txt", Body=b"a"),
                      range(1003)))
    client.put_object(Bucket=bucket, Key="vols/pvc-1/a.txt", Body=b"a")
    client.put_object(Bucket=bucket, Key="vols/pvc-10/kept.txt", Body=b"k")     # another volume's prefix
    confirmed = driver.controller.ValidateVolumeCapabilities(pb.ValidateVolumeCapabilitiesRequest(
        volume_id=first.volume_id, volume_capabilities=[capability(MODE.MULTI_NODE_MULTI_WRITER)], secrets=SECRETS))
    assert confirmed.confirmed.volume_capabilities
    driver.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=first.volume_id, secrets=SECRETS))
    listed = client.list_objects_v2(Bucket=bucket)
    assert [o["Key"] for o in listed.get("Contents", [])] == ["vols/pvc-10/kept.txt"]


def test_read_only_volume_refuses_writer_modes(driver, s3_server, bucket):
    ctx = static_context(s3_server.endpoint_url, bucket, immutable="true")
    reply = driver.controller.ValidateVolumeCapabilities(pb.ValidateVolumeCapabilitiesRequest(
        volume_id="static-1", volume_context=ctx, volume_capabilities=[capability(MODE.MULTI_NODE_MULTI_WRITER)]))
    assert not reply.HasField("confirmed") and "read-only" in reply.message
    reply = driver.controller.ValidateVolumeCapabilities(pb.ValidateVolumeCapabilitiesRequest(
        volume_id="static-1", volume_context=ctx, volume_capabilities=[capability(MODE.MULTI_NODE_READER_ONLY)]))
    assert reply.HasField("confirmed")


def test_two_pods_share_one_daemon_and_nothing_leaks(tmp_path, s3_server, bucket):
    """Two targets (one read-only) on one staged volume: one daemon; data readable in both; a write
    through the read-write one reaches the bucket; repeats are idempotent, conflicting ones refused;
    the credentials appear in no argv, environment, log, metrics or non-root-readable file;
    unpublish + unstage leave nothing mounted and no daemon."""
    from csi_fixtures import require_fuse
    require_fuse()
    metrics_port = free_port()
    drv = Driver(tmp_path, metrics_port=metrics_port)
    try:
        drv.start_agent()
        drv.start_plugin()
        _two_pods(drv, tmp_path, s3_server, bucket, metrics_port)
    finally:
        pids = drv.process_pids()
        drv.stop()
        cleanup_mounts(tmp_path)
        for pid in pids:
            os.kill(pid, 9)


def _two_pods(drv, tmp_path, s3_server, bucket, metrics_port):
    client = s3_client(s3_server.endpoint_url)
    put_tree(client, bucket, "data", {"a.txt": b"alpha", "sub/b.bin": os.urandom(3000)})
    secret = f"sEcReT{uuid.uuid4().hex}"
    key_id = f"AKIA{uuid.uuid4().hex[:16].upper()}"
    secrets = {"accessKeyID": key_id, "secretAccessKey": secret}
    ctx = static_context(s3_server.endpoint_url, bucket, logSyncPeriod="0.5")
    stage, pod1, pod2 = (str(tmp_path / n) for n in ("globalmount", "pod1/mount", "pod2/mount"))
    stage_req = pb.NodeStageVolumeRequest(volume_id="vol-1", staging_target_path=stage, volume_capability=capability(),
                                          volume_context=ctx, secrets=secrets)
    drv.node.NodeStageVolume(stage_req, timeout=120)
    drv.node.NodeStageVolume(stage_req, timeout=120)                    # idempotent
    changed = pb.NodeStageVolumeRequest()
    changed.CopyFrom(stage_req)
    changed.volume_context["immutable"] = "true"
    assert call_code(drv.node.NodeStageVolume, changed)[0] == CODE.ALREADY_EXISTS
    for target, readonly in ((pod1, False), (pod2, True)):
        request = pb.NodePublishVolumeRequest(volume_id="vol-1", staging_target_path=stage, target_path=target,
                                              volume_capability=capability(), readonly=readonly)
        drv.node.NodePublishVolume(request, timeout=60)
        drv.node.NodePublishVolume(request, timeout=60)                 # idempotent
    conflicting = pb.NodePublishVolumeRequest(volume_id="vol-1", staging_target_path=stage, target_path=pod2,
                                              volume_capability=capability(), readonly=False)
    assert call_code(drv.node.NodePublishVolume, conflicting)[0] == CODE.ALREADY_EXISTS
    assert len(drv.daemon_pids()) == 1
    assert Path(pod1, "a.txt").read_bytes() == Path(pod2, "a.txt").read_bytes() == b"alpha"
    assert Path(pod2, "sub/b.bin").stat().st_size == 3000
    Path(pod1, "out.txt").write_bytes(b"written by pod 1")
    with pytest.raises(OSError) as info:
        Path(pod2, "nope.txt").write_bytes(b"x")
    assert info.value.errno == errno.EROFS
    wait_for(lambda: "Contents" in client.list_objects_v2(Bucket=bucket, Prefix="data/out.txt"), 30,
             "out.txt in the bucket")
    stats = drv.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_id="vol-1", volume_path=pod1))
    assert not stats.volume_condition.abnormal and stats.usage[0].unit == pb.VolumeUsage.BYTES
    _assert_no_leak(drv, tmp_path, metrics_port, (secret, key_id))
    for target in (pod1, pod2):
        request = pb.NodeUnpublishVolumeRequest(volume_id="vol-1", target_path=target)
        drv.node.NodeUnpublishVolume(request)
        drv.node.NodeUnpublishVolume(request)                           # idempotent
        assert not os.path.exists(target)
    unstage = pb.NodeUnstageVolumeRequest(volume_id="vol-1", staging_target_path=stage)
    drv.node.NodeUnstageVolume(unstage, timeout=120)
    drv.node.NodeUnstageVolume(unstage, timeout=120)
    assert mounted_under(tmp_path) == []
    wait_for(lambda: drv.daemon_pids() == [], 10, "the daemon to exit")


def _assert_no_leak(drv, tmp_path, metrics_port, needles):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for name in ("cmdline", "environ"):
            try:
                data = Path(f"/proc/{pid}/{name}").read_bytes()
            except OSError:
                continue
            found += [f"/proc/{pid}/{name}" for n in needles if n.encode() in data]
    for path in tmp_path.rglob("*"):
        if not path.is_file() or path.is_socket():
            continue
        data = path.read_bytes()
        if any(n.encode() in data for n in needles):
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode & 0o077 or path.parent.name != "secrets" or stat.S_IMODE(path.parent.stat().st_mode) != 0o700:
                found.append(f"{path} (mode {mode:o})")
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    assert b"cachefs" in metrics
    found += ["metrics" for n in needles if n.encode() in metrics]
    assert found == []


def test_non_root_pod_gets_its_fs_group(public_dir, tmp_path, s3_server, bucket):
    """VOLUME_MOUNT_GROUP: the pod's fsGroup owns the files, group-writable on a writable volume;
    a user outside the group reads but cannot write."""
    from csi_fixtures import require_fuse
    require_fuse()
    put_tree(s3_client(s3_server.endpoint_url), bucket, "data", {"a.txt": b"alpha"})
    drv = Driver(tmp_path)
    stage, target = str(public_dir / "globalmount"), str(public_dir / "pod/mount")
    try:
        drv.start_agent()
        drv.start_plugin()
        caps = {cap.rpc.type for cap in drv.node.NodeGetCapabilities(pb.NodeGetCapabilitiesRequest()).capabilities}
        assert pb.NodeServiceCapability.RPC.VOLUME_MOUNT_GROUP in caps
        cap = capability(MODE.SINGLE_NODE_MULTI_WRITER)
        cap.mount.volume_mount_group = "2000"
        drv.node.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id="vol-g", staging_target_path=stage, volume_capability=cap, secrets=SECRETS,
            volume_context=static_context(s3_server.endpoint_url, bucket)), timeout=120)
        drv.node.NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id="vol-g", staging_target_path=stage, target_path=target, volume_capability=cap), timeout=60)
        st = os.stat(os.path.join(target, "a.txt"))
        assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (2000, 0o664)

        def as_user(uid: int, gid: int, script: str) -> subprocess.CompletedProcess:
            return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", f"--groups={gid}", "sh", "-c", script],
                                  capture_output=True, text=True, timeout=60, cwd="/")

        member = as_user(1000, 2000, f"cat {target}/a.txt && echo n > {target}/new.txt")
        assert member.returncode == 0 and member.stdout == "alpha", member.stderr
        assert Path(target, "new.txt").read_text() == "n\n"
        outsider = as_user(1001, 1001, f"cat {target}/a.txt && echo x > {target}/x.txt")
        assert outsider.stdout == "alpha" and "Permission denied" in outsider.stderr, outsider
    finally:
        pids = drv.process_pids()
        drv.stop()
        cleanup_mounts(public_dir)
        cleanup_mounts(tmp_path)            # the daemon's own mount, in the agent's state dir
        for pid in pids:
            os.kill(pid, 9)


def test_a_packed_dataset_is_a_volume_of_its_original_tree(driver, tmp_path, s3_server, bucket, pack_cli):
    """`cachefs pack` output as a pod's volume: the daemon the plugin starts finds the manifest,
    the pod reads the original paths byte-identical (the source objects deleted first, so from the
    shards), and a write is refused with EROFS; unpublish and unstage leave nothing behind."""
    client = s3_client(s3_server.endpoint_url)
    rng = random.Random(3)
    files = {f"train/c{i % 3}/img_{i:03d}.jpg": rng.randbytes(rng.randint(1, 20_000)) for i in range(90)}
    files["labels.csv"] = b"path,label\n"
    put_tree(client, bucket, "src", files)
    assert pack_cli("pack", f"s3://{bucket}/src", f"s3://{bucket}/packed", "--endpoint-url", s3_server.endpoint_url) == 0
    client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": f"src/{k}"} for k in files]})
    cap = capability(MODE.MULTI_NODE_READER_ONLY)
    stage, pod = str(tmp_path / "globalmount"), str(tmp_path / "pod/mount")
    driver.node.NodeStageVolume(pb.NodeStageVolumeRequest(
        volume_id="packed-1", staging_target_path=stage, volume_capability=cap, secrets=SECRETS,
        volume_context=static_context(s3_server.endpoint_url, bucket, prefix="packed")), timeout=120)
    driver.node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id="packed-1", staging_target_path=stage, target_path=pod, volume_capability=cap, readonly=True),
        timeout=60)
    got = {str(p.relative_to(pod)): p.read_bytes() for p in Path(pod).rglob("*") if p.is_file()}
    assert got == files                             # the sources are gone: every byte came from the shards
    with pytest.raises(OSError) as info:
        Path(pod, "train/new.txt").write_bytes(b"x")
    assert info.value.errno == errno.EROFS
    driver.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id="packed-1", target_path=pod))
    driver.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id="packed-1", staging_target_path=stage),
                                  timeout=120)
    assert mounted_under(tmp_path) == []
    wait_for(lambda: driver.daemon_pids() == [], 10, "the daemon to exit")
