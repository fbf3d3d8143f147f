"""The generated CSI stubs and the pure parts of the driver (no mounts): stub generation into a
fresh directory, wire field numbers, volume attributes, dynamic volume ids, secrets mapping."""

import importlib.util
import os
import subprocess
import sys
import time

import pytest

from csi import _build, dynamic
from csi.attributes import daemon_env, mount_values, warmup_paths
from csi.errors import CsiError


def test_stubs_generate_and_import(tmp_path):
    out = tmp_path / "csi" / "_proto"
    out.parent.mkdir()
    assert _build.stale(out)
    _build.generate(out)
    assert not _build.stale(out)
    sys.path.insert(0, str(tmp_path))
    try:
        spec = importlib.util.spec_from_file_location("fresh_csi_pb2", out / "csi_pb2.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(tmp_path))
    assert module.DESCRIPTOR.package == "csi.v1"
    assert {"Identity", "Node", "Controller"} <= set(module.DESCRIPTOR.services_by_name)
    original = _build.PROTO.stat()
    later = time.time() + 10
    os.utime(_build.PROTO, (later, later))
    try:
        assert _build.stale(out)           # a newer .proto makes the stubs stale
    finally:
        os.utime(_build.PROTO, ns=(original.st_atime_ns, original.st_mtime_ns))


def test_installed_stubs_without_the_proto_are_not_stale(tmp_path, monkeypatch):
    out = tmp_path / "_proto"
    out.mkdir()
    _build.generate(out)
    monkeypatch.setattr(_build, "PROTO", tmp_path / "absent.proto")     # a wheel ships no .proto
    assert not _build.stale(out)


def test_wire_field_numbers_are_the_specs():
    from csi.proto import pb

    def number(message, field):
        return message.DESCRIPTOR.fields_by_name[field].number

    assert number(pb.NodeStageVolumeRequest, "staging_target_path") == 3
    assert number(pb.NodeStageVolumeRequest, "secrets") == 5
    assert number(pb.NodeStageVolumeRequest, "volume_context") == 6
    assert number(pb.NodePublishVolumeRequest, "target_path") == 4
    assert number(pb.NodePublishVolumeRequest, "readonly") == 6
    assert number(pb.NodePublishVolumeRequest, "volume_context") == 8
    assert number(pb.NodeGetVolumeStatsResponse, "volume_condition") == 2
    assert number(pb.GetPluginCapabilitiesResponse, "capabilities") == 1
    assert number(pb.VolumeCapability.MountVolume, "volume_mount_group") == 3
    assert pb.NodeServiceCapability.RPC.VOLUME_CONDITION == 4
    assert pb.VolumeCapability.AccessMode.SINGLE_NODE_MULTI_WRITER == 7


def test_attributes_map_to_mount_options():
    values = mount_values({"url": "s3://b/p", "endpoint": "http://rgw:7480", "cacheSize": "10G",
                           "immutable": "true", "logSyncPeriod": "2.5", "fileMode": "0640",
                           "csi.storage.k8s.io/pod.name": "x", "warmup": "train",
                           "storage.kubernetes.io/csiProvisionerIdentity": "1700000000000-8081-csi.cachefs.io"})
    assert values == {"url": "s3://b/p", "endpoint_url": "http://rgw:7480", "cache_size": 10 << 30,
                      "immutable": True, "log_sync_period": 2.5, "file_mode": 0o640}


@pytest.mark.parametrize("attributes, key", [
    ({"url": "s3://b", "cachesize": "1G"}, "'cachesize'"),
    ({"url": "s3://b", "immutable": "maybe"}, "'immutable'"),
    ({"url": "s3://b", "memCacheSize": "-1"}, "'memCacheSize'"),
    ({"url": "http://b"}, "'url'"),
    ({"url": "s3://AKIA:secret@b/p"}, "'url'"),
    ({"endpoint": "http://x"}, "'url'"),
    ({"url": "s3://b", "endpoint": "rgw.storage.svc:7480"}, "'endpoint'"),
])
def test_bad_attributes_name_the_key(attributes, key):
    with pytest.raises(CsiError) as info:
        mount_values(attributes)
    assert info.value.code == "INVALID_ARGUMENT" and key in info.value.message
    assert "secret" not in info.value.message.replace("secrets", "")


def test_warmup_attributes():
    assert warmup_paths({"warmup": "train/, /val ,", "warmupWait": "true"}) == (["train", "val"], True)
    with pytest.raises(CsiError):
        warmup_paths({"warmup": "../etc"})


def test_secrets_become_daemon_environment_and_unknown_keys_are_named_not_shown():
    assert daemon_env({"accessKeyID": "a", "secretAccessKey": "s", "sessionToken": ""}) == {
        "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s"}
    with pytest.raises(CsiError) as info:
        daemon_env({"secretKey": "hunter2"})
    assert "secretKey" in info.value.message and "hunter2" not in info.value.message


def test_dynamic_volume_ids_round_trip():
    volume = dynamic.from_parameters("pvc-1", {"bucket": "outs", "prefix": "/vols/", "endpoint": "http://rgw:7480",
                                               "onDelete": "retain"})
    assert volume.url == "s3://outs/vols/pvc-1" and volume.record_key == "vols/.cachefs-volumes/pvc-1.json"
    assert dynamic.from_id(volume.volume_id) == volume
    plain = dynamic.from_parameters("pvc-2", {"bucket": "outs"})
    assert plain.volume_id == "s3://outs/pvc-2" and dynamic.from_id(plain.volume_id) == plain
    for foreign in ("some-handle", "s3://", "s3://b/x?token=1", "nfs://x/y"):
        assert dynamic.from_id(foreign) is None
    for params in ({}, {"bucket": "Bad_Bucket"}, {"bucket": "ok", "prefix": "a/../b"}):
        with pytest.raises(CsiError):
            dynamic.from_parameters("pvc-3", params)


@pytest.mark.parametrize("args, message", [
    (["csi", "--endpoint", "tcp://10.0.0.1:9000", "--node-id", "n"], "endpoint must be unix://"),
    (["csi", "--mode", "node", "--node-id", ""], "--node-id"),
    (["csi-agent", "--cache-size", "lots"], "--cache-size"),
    (["csi-agent", "--volume-slots", "0"], "must be positive"),
])
def test_bad_command_lines_are_one_line_usage_errors(tmp_path, args, message):
    result = subprocess.run([sys.executable, "-m", "cachefs", *args, *(
        ["--socket", str(tmp_path / "a.sock"), "--state-dir", str(tmp_path)] if args[0] == "csi-agent" else [])],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env={**os.environ, "NODE_NAME": ""})
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and os.listdir(tmp_path) in ([], ["a.sock"])
