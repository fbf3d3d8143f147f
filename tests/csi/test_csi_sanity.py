"""csi-sanity (kubernetes-csi/csi-test v5.2.0, CSI spec 1.9) against the driver: the agent and the
plugin as real processes, a moto S3 server, so NodeStage really mounts and NodePublish really binds.

Every spec csi-sanity skips must match one of SKIP_REASONS (the capability we do not offer and why);
a skip without a reason, or any failure, fails this test. Missing csi-sanity under CI=true fails it.
"""

import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from csi_fixtures import SECRETS, driver, mounted_under  # noqa: F401  (fixtures)

pytestmark = pytest.mark.fuse

# The upstream conformance binary, built outside this repository: CI sets CSI_SANITY (.ci/run)
CSI_SANITY = Path(os.environ.get("CSI_SANITY", "csi-sanity"))

# skipped spec (regex on its name) -> why the driver does not offer what it tests
SKIP_REASONS = {
    r"ExpandVolume": "EXPAND_VOLUME is not offered: an S3 prefix has no size to grow",
    r"GroupController": "no GroupController service: a bucket prefix has no group snapshots",
    r"Snapshot": "CREATE_DELETE_SNAPSHOT / LIST_SNAPSHOTS are not offered: object stores have no snapshots "
                 "of a prefix (use bucket versioning)",
    r"source volume": "CLONE_VOLUME is not offered: a clone would be a server-side copy of a whole prefix",
    r"GetCapacity": "GET_CAPACITY is not offered: an object store has no capacity to report",
    r"ListVolumes": "LIST_VOLUMES is not offered (optional): the CO keeps the list of its volumes",
    r"ControllerPublishVolume|ControllerUnpublishVolume|Controller Server\] volume lifecycle":
        "PUBLISH_UNPUBLISH_VOLUME is not offered: nothing to attach (CSIDriver attachRequired: false)",
}


def sanity_binary() -> Path:
    found = CSI_SANITY if CSI_SANITY.is_file() else Path(shutil.which(str(CSI_SANITY)) or "/nonexistent")
    if found.is_file() and os.access(found, os.X_OK):
        return found
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"csi-sanity is missing at {CSI_SANITY} (set CSI_SANITY) under CI", pytrace=False)
    pytest.skip(f"csi-sanity is missing at {CSI_SANITY}")


def test_csi_sanity(driver, tmp_path, s3_server, bucket):
    binary = sanity_binary()
    work = tmp_path / "sanity"
    work.mkdir()          # csi-sanity creates (and removes) the mount and staging dirs inside it
    params = tmp_path / "params.yaml"
    params.write_text(f"bucket: {bucket}\nendpoint: {s3_server.endpoint_url}\nmemCacheSize: 64M\n")
    secrets = tmp_path / "secrets.yaml"
    creds = "".join(f"  {k}: {v}\n" for k, v in SECRETS.items())
    secrets.write_text("".join(f"{name}:\n{creds}" for name in (
        "CreateVolumeSecret", "DeleteVolumeSecret", "NodeStageVolumeSecret",
        "ControllerValidateVolumeCapabilitiesSecret")))
    junit = tmp_path / "junit.xml"
    result = subprocess.run([str(binary), f"--csi.endpoint=unix://{driver.csi_socket}",
                             f"--csi.mountdir={work}/mount", f"--csi.stagingdir={work}/stage",
                             f"--csi.testvolumeparameters={params}", f"--csi.secrets={secrets}",
                             f"--csi.junitfile={junit}", "--ginkgo.no-color", "--ginkgo.timeout=400s"],
                            capture_output=True, text=True, timeout=450)
    summary = result.stdout.strip().splitlines()[-3:]
    assert result.returncode == 0, "\n".join(result.stdout.splitlines()[-80:]) + driver.log("agent.log")
    passed, skipped = [], []
    for case in ET.parse(junit).iter("testcase"):
        name = case.get("name", "")
        if case.find("failure") is not None or case.find("error") is not None:
            pytest.fail(f"csi-sanity spec failed: {name}")
        (skipped if case.find("skipped") is not None else passed).append(name)
    unexplained = [n for n in skipped if not any(re.search(p, n, re.IGNORECASE) for p in SKIP_REASONS)
                   and "pending" not in n.lower()]
    assert unexplained == [], f"skipped without a reason in SKIP_REASONS: {unexplained}"
    # the node lifecycle really ran: stage, publish, stats, unpublish, unstage on real mounts
    assert any(n.endswith("Node Service should work") for n in passed), summary
    assert len(passed) >= 37, summary
    assert mounted_under(tmp_path) == []
