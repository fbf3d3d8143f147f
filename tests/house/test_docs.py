"""The docs stay true to the code: the README's set-up commands exist, the generated tables
(options, exit codes, metrics) match what they are generated from, the repository cites nothing
outside itself, and the Grafana dashboard names only metrics that are exported."""

import json
import re
import subprocess
from pathlib import Path

from cachefs.config import option_fields, options_table
from cachefs.daemon import daemon_registry
from cachefs.errors import EXIT_CODES, exit_codes_table
from cachefs.metrics import metrics_table
from csi.agent.metrics import AgentMetrics

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
USAGE = (ROOT / "docs/usage.md").read_text()
METRICS = (ROOT / "docs/metrics.md").read_text()


def block(text: str, name: str) -> str:
    return re.search(rf"<!-- {name}:begin[^>]*-->\n(.*?)\n<!-- {name}:end -->", text, re.S).group(1)


def test_readme_opens_with_the_two_setup_commands():
    first_block = re.search(r"```sh\n(.*?)```", README, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (ROOT / ".ci/run").read_text()


def test_the_readme_is_a_product_page():
    assert len(README.splitlines()) <= 250
    for heading in ("## Install", "## Quick start", "## How it compares", "## Headline numbers"):
        assert heading in README
    for peer in ("mountpoint-s3", "JuiceFS", "rclone mount", "s3fs-fuse", "Alluxio"):
        assert peer in README
    for link in re.findall(r"\]\(([^)#]+)", README):
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link


def test_make_demo_installs_no_ceph_and_no_torch():
    """`make demo` installs what the demo uses; Ceph and the test extra belong to `make test`."""
    dry = subprocess.run(["make", "-n", "-B", "demo"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "ceph" not in dry and "radosgw" not in dry and "[test]" not in dry and "torch" not in dry
    assert "'.[server]'" in dry and "fuse3" in dry
    assert "drop_caches" not in (ROOT / "cachefs/demo/run.py").read_text()


def test_every_mount_option_is_documented():
    missing = [f.name for f in option_fields() if f"`{f.name}`" not in USAGE]
    assert not missing, f"options missing from docs/usage.md: {missing}"
    assert block(USAGE, "options") == options_table(), "stale option table: paste `python -m cachefs.config`"


def test_every_exit_code_is_documented_from_the_one_table():
    assert block(USAGE, "exit-codes") == exit_codes_table(), "stale exit codes: paste `python -m cachefs.errors`"
    assert {int(c) for c in re.findall(r"^\| (\d+) \|", block(USAGE, "exit-codes"), re.M)} == set(EXIT_CODES)


def test_every_metric_is_documented():
    assert block(METRICS, "metrics") == metrics_table(daemon_registry()), \
        "stale metric table in docs/metrics.md: paste `python -m cachefs.metrics`"
    assert block(METRICS, "agent-metrics") == metrics_table(AgentMetrics().registry)


def exported_names() -> set[str]:
    names = set()
    for registry in (daemon_registry(), AgentMetrics().registry):
        for family in registry.collect():
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "info": ["_info"],
                        "gauge": [""]}[family.type]
            names.update(family.name + suffix for suffix in suffixes)
    return names


def test_the_dashboard_names_only_exported_metrics():
    dashboard = json.loads((ROOT / "deploy/grafana/cachefs-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][1]["query"]["query"])
    exported = exported_names()
    used = set()
    for expr in exprs:
        used.update(re.findall(r"\bcachefs_[a-z_]+", expr))
    assert used and used <= exported, sorted(used - exported)
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("hit ratio", "bytes served per tier", "get latency", "errors", "usage against capacity",
                  "write-back lag", "warmup"):
        assert topic in titles, topic
    assert exported_names() >= {"cachefs_mount_info", "cachefs_tier_hits_total"}
    assert not any(name.endswith("_created") for name in exported)


def test_the_repository_cites_nothing_outside_itself():
    """No links to notes outside the repository, no issue numbers: the design is docs/design.md."""
    tracked = subprocess.run(["git", "ls-files", "README.md", "docs", "cachefs", "warmup", "packer", "csi",
                              "benchmarks", "tests", "deploy", "Makefile"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    pattern = re.compile(r"\.\./shared|DESIGN invariant|DESIGN[ .](md )?§|\bissue \d+|\bissues \d+")
    offenders = []
    for name in tracked:
        path = ROOT / name
        if path.suffix in (".png", ".json") or name == "tests/house/test_docs.py" or not path.is_file():
            continue
        offenders += [f"{name}:{n}" for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
                      if pattern.search(line)]
    assert offenders == []
    assert (ROOT / "docs/design.md").read_text().count("\n1. **Version pinning.**") == 1
