"""Shared fixtures: fake AWS credentials, a moto S3 server on loopback, fresh buckets,
and a guard that fails any test logging an unexpected warning or error."""

import logging
import os
import uuid

import pytest

from testing.s3 import LocalS3Server, local_credentials_env, make_bucket

for _name, _value in {**local_credentials_env(), "AWS_EC2_METADATA_DISABLED": "true"}.items():
    os.environ.setdefault(_name, _value)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "allow_warnings: the test may log records at WARNING or above")


@pytest.fixture(scope="session")
def s3_server():
    with LocalS3Server() as server:
        yield server


@pytest.fixture
def bucket(s3_server: LocalS3Server) -> str:
    name = f"test-{uuid.uuid4().hex[:16]}"
    make_bucket(s3_server.endpoint_url, name)
    return name


@pytest.fixture
def pack_cli(monkeypatch: pytest.MonkeyPatch):
    """`cachefs pack` / `unpack` in-process through ``cachefs.cli.main``, registered directly: their
    registration through the entry point is what test_packer's own test checks, so a stale
    egg-info on sys.path cannot hide them here. Returns ``run(command, *args)`` (quiet) -> exit code."""
    from cachefs.cli import main
    from packer.cli import register_pack, register_unpack
    monkeypatch.setattr("cachefs.cli._add_plugin_commands", lambda sub: (register_pack(sub), register_unpack(sub)))
    return lambda command, *args: main([command, "--quiet", *map(str, args)])


class _WarningCollector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def fail_on_logged_warnings(request: pytest.FixtureRequest):
    collector = _WarningCollector()
    root = logging.getLogger()
    root.addHandler(collector)
    try:
        yield
    finally:
        root.removeHandler(collector)
    if collector.records and request.node.get_closest_marker("allow_warnings") is None:
        lines = "\n".join(f"  {r.levelname} {r.name}: {r.getMessage()}" for r in collector.records)
        pytest.fail(f"unexpected log records at WARNING or above:\n{lines}", pytrace=False)


pytest_plugins = ("mounts",)


@pytest.fixture
def checkout_reachable_by_other_users():
    """These tests run cachefs as other users: they need this checkout (the package is installed
    from it in editable mode) readable by them. A clone under a 0700 directory (mktemp -d, a
    private home) is not: say so, instead of failing later with "No module named cachefs"."""
    import os
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    closed = [d for d in (root, *root.parents) if not os.stat(d).st_mode & 0o001]
    assert not closed, (f"{closed[-1]} is not traversable by other users (mode "
                        f"{oct(os.stat(closed[-1]).st_mode & 0o777)}): these tests run cachefs as uid 65534 "
                        f"and 1234 from this checkout; clone it under a directory others can traverse")


@pytest.fixture
def scripted():
    """Start ``scripted_http.ScriptedServer``s on loopback; all closed at the end of the test."""
    from scripted_http import ScriptedServer
    servers = []

    def start(script, tls=None) -> ScriptedServer:
        servers.append(ScriptedServer(script, tls))
        return servers[-1]
    yield start
    for server in servers:
        server.close()
