"""deploy/: every manifest validates strictly against Kubernetes 1.30 (kubernetes-validate), and the
manifests agree with the driver (its name, the agent socket, attributes and parameters it accepts)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from csi import dynamic
from csi.attributes import mount_values
from csi.identity import DRIVER_NAME

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted(DEPLOY.rglob("*.yaml"))


def validator() -> list[str]:
    exe = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("kubernetes-validate is missing: pip install 'cachefs[test]'", pytrace=False)
    return [exe, "--strict", "--kubernetes-version", "1.30.0"]


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def test_manifests_validate_strictly_against_1_30():
    assert len(MANIFESTS) >= 12
    result = subprocess.run([*validator(), *map(str, MANIFESTS)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "failed" not in result.stdout.lower() + result.stderr.lower()


def test_validator_is_strict(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: storage.k8s.io/v1\nkind: CSIDriver\nmetadata: {name: x}\n"
                   "spec: {attachRequired: false, attachRequird: true}\n")
    assert subprocess.run([*validator(), str(bad)], capture_output=True, timeout=120).returncode != 0


def _containers(name: str) -> dict[str, dict]:
    [workload] = docs(name)
    return {c["name"]: c for c in workload["spec"]["template"]["spec"]["containers"]}


def test_manifests_agree_with_the_driver():
    [driver] = docs("csidriver.yaml")
    assert driver["metadata"]["name"] == DRIVER_NAME
    assert driver["spec"]["attachRequired"] is False and driver["spec"]["podInfoOnMount"] is True
    node = _containers("node.yaml")
    assert {"cachefs-csi", "node-driver-registrar", "liveness-probe"} <= set(node)
    agent = _containers("node-agent.yaml")["agent"]
    plugin_args, agent_args = node["cachefs-csi"]["args"], agent["args"]
    assert "--agent-socket=/run/cachefs/agent.sock" in plugin_args and "--socket=/run/cachefs/agent.sock" in agent_args
    for container in (node["cachefs-csi"], agent):
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/var/lib/kubelet"]["mountPropagation"] == "Bidirectional"
        assert container["securityContext"]["privileged"] is True
    assert "/dev/fuse" in {m["mountPath"] for m in agent["volumeMounts"]}
    provisioner = _containers("controller.yaml")["csi-provisioner"]
    assert "--leader-election" in provisioner["args"]
    [storage_class] = docs("storageclass.yaml")
    assert storage_class["provisioner"] == DRIVER_NAME
    params = {k: v for k, v in storage_class["parameters"].items() if not k.startswith("csi.storage.k8s.io/")}
    volume = dynamic.from_parameters("pvc-1", params)
    mount_values({**volume.context(), **{k: v for k, v in params.items() if k not in dynamic.PARAMETERS}})
    pv = docs("examples/static-pv.yaml")[0]
    assert pv["spec"]["csi"]["driver"] == DRIVER_NAME
    mount_values(pv["spec"]["csi"]["volumeAttributes"])
    assert set(docs("examples/secret.yaml")[0]["stringData"]) == {"accessKeyID", "secretAccessKey"}


def _pod_specs() -> list[tuple[str, dict]]:
    """Every pod template of deploy/ (Pods, and the pod templates of Jobs and other workloads)."""
    found = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") not in ("Pod", "Job", "Deployment", "DaemonSet", "StatefulSet"):
                continue
            spec = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
            found.append((str(path.relative_to(DEPLOY)), spec))
    return found


def test_every_container_of_a_claim_uses_host_to_container_propagation():
    """A repaired volume reaches a container only through a slave copy: every example that mounts
    a claim does it with mountPropagation: HostToContainer."""
    checked = 0
    for name, spec in _pod_specs():
        claims = {v["name"] for v in spec.get("volumes", []) if "persistentVolumeClaim" in v}
        for container in spec["containers"]:
            for mount in container.get("volumeMounts", []):
                if mount["name"] in claims:
                    checked += 1
                    assert mount.get("mountPropagation") == "HostToContainer", (name, container["name"], mount)
    assert checked >= 3


def test_the_agent_sees_containers_and_exports_its_metrics():
    [agent_set] = docs("node-agent.yaml")
    assert agent_set["spec"]["template"]["spec"]["hostPID"] is True
    agent = _containers("node-agent.yaml")["agent"]
    assert "--agent-metrics-port=9566" in agent["args"]
    assert {"containerPort": 9566, "name": "agent-metrics"} in agent["ports"]
    assert "${1}:9566" in (DEPLOY / "examples/prometheus-scrape.yaml").read_text()


def test_dockerfile_is_debian_12_with_fuse3():
    text = (DEPLOY / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM debian:12" in text and "fuse3" in text and "[csi]" in text
