"""The typed control protocol: schema, errors carrying exit codes, the handshake, the command
table, and who may drive the daemon. In-process tests drive ``Control`` as fuse_ops does."""

import json
from collections.abc import AsyncIterator

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefs.control import protocol
from cachefs.control.commands import WARM_COMMANDS, Command, command_table
from cachefs.control.protocol import Arg, decode_request, encode_request, error_of, validate_args
from cachefs.control.server import Control
from cachefs.errors import CachefsError, ExitCode, NoDaemon, PermissionDenied, Unsupported, UsageError

OWNER = 1000


class Ctx:
    def __init__(self, uid: int, gid: int = 100, pid: int = 4242) -> None:
        self.uid, self.gid, self.pid = uid, gid, pid


# ---- the wire format -----------------------------------------------------------------------------
def test_request_round_trip():
    raw = encode_request("sync", {"wait": True, "timeout": 2.5, "class": "log"})
    request = decode_request(raw)
    assert (request.op, request.args, request.protocol) == ("sync", {"wait": True, "timeout": 2.5, "class": "log"},
                                                            protocol.PROTOCOL_VERSION)


@pytest.mark.parametrize("raw, words", [
    (b"", "not JSON"), (b"{not json", "not JSON"), (b"\xff\xfe", "not JSON"), (b"[1, 2]", "not a JSON object"),
    (b'{"op": "status"}', "'protocol'"), (b'{"protocol": "1", "op": "status"}', "'protocol'"),
    (b'{"protocol": true, "op": "status"}', "'protocol'"), (b'{"protocol": 1}', "'op'"),
    (b'{"protocol": 1, "op": 7}', "'op'"), (b'{"protocol": 1, "op": "status", "args": [1]}', "'args'"),
    (b"[" * 100_000, "not JSON"),
])
def test_malformed_requests_are_usage_errors(raw, words):
    with pytest.raises(UsageError, match=words) as caught:
        decode_request(raw)
    assert caught.value.exit_code == ExitCode.USAGE


def test_a_newer_or_older_protocol_is_unsupported_not_misread():
    with pytest.raises(Unsupported, match="protocol 99") as caught:
        decode_request(json.dumps({"protocol": 99, "op": "status"}).encode())
    assert caught.value.exit_code == ExitCode.UNSUPPORTED == 14
    # a protocol-0 client ({"command": ...}): told to use the matching cachefs, not run flat args
    with pytest.raises(Unsupported, match="client is older"):
        decode_request(b'{"command": "sync", "wait": true}')


def test_oversize_request_is_refused():
    with pytest.raises(UsageError, match="too large"):
        decode_request(b" " * (protocol.MAX_REQUEST + 1))


@pytest.mark.parametrize("args, words", [
    ({"bogus": 1}, "unknown argument"), ({"wait": "yes"}, "'wait' must be true or false"),
    ({"timeout": True}, "'timeout' must be a number"), ({"class": "all"}, "one of 'log', 'checkpoint'"),
    ({"n": 1.5}, "'n' must be an integer"), ({"paths": ["a", 3]}, "'paths' must be a list of strings"),
])
def test_arguments_are_checked_against_the_schema(args, words):
    schema = {"wait": Arg(bool), "timeout": Arg(float), "class": Arg(str, choices=("log", "checkpoint")),
              "n": Arg(int), "paths": Arg(list)}
    with pytest.raises(UsageError, match=words):
        validate_args("sync", schema, args)
    assert validate_args("sync", schema, {"wait": None, "timeout": 3, "paths": []}) == {"timeout": 3, "paths": []}


@pytest.mark.parametrize("code, cls", [(2, UsageError), (9, NoDaemon), (13, PermissionDenied), (14, Unsupported),
                                       (5, CachefsError), (10, CachefsError)])
def test_an_error_reply_carries_its_exit_code(code, cls):
    exc = error_of({"kind": "error", "code": code, "error": "boom"})
    assert type(exc) is cls and exc.exit_code == code and str(exc) == "boom"


@pytest.mark.parametrize("code", [0, -1, 300, "2", None, 2.0])
def test_a_nonsense_error_code_becomes_internal(code):
    assert error_of({"kind": "error", "code": code}).exit_code == ExitCode.INTERNAL


# ---- the server, driven as fuse_ops drives it -------------------------------------------------------
def make_control(calls: list, with_bug: bool = True) -> Control:
    async def ping(args) -> AsyncIterator[dict]:
        calls.append(("ping", args))
        yield {"pong": args.get("n")}
        yield {"pong": "again"}

    async def poke(args) -> AsyncIterator[dict]:
        calls.append(("poke", args))
        yield {"poked": True}

    async def broken(args) -> AsyncIterator[dict]:
        raise RuntimeError("a bug")
        yield {}

    async def refuses(args) -> AsyncIterator[dict]:
        raise UsageError("warmup: nothing to warm")
        yield {}

    commands = [Command("ping", ping, False, {"n": Arg(int)}), Command("poke", poke, True, {}),
                Command("refuses", refuses, False, {})] + ([Command("broken", broken, False, {})] if with_bug else [])
    table = {c.name: c for c in commands}
    counter = iter(range(100, 10_000))
    return Control(lambda: next(counter), table, owner_uid=OWNER)


def exchange(control: Control, raw: bytes, uid: int = OWNER, chunk: int = 1 << 17) -> list[dict]:
    """open (as ``uid``), write in FUSE-sized chunks, read to EOF, release: the replies."""
    async def main() -> bytes:
        fh = control.open(Ctx(uid))
        for i in range(0, len(raw), chunk):
            assert control.write(fh, raw[i:i + chunk]) == len(raw[i:i + chunk])
        out = b""
        while data := await control.read(fh, 4096):
            out += data
        control.release(fh)
        assert not control.owns(fh)
        return out

    return [json.loads(line) for line in trio.run(main).splitlines()]


def test_events_then_end():
    calls = []
    replies = exchange(make_control(calls), encode_request("ping", {"n": 3}))
    assert replies == [{"kind": "event", "data": {"pong": 3}}, {"kind": "event", "data": {"pong": "again"}},
                       {"kind": "end"}]
    assert calls == [("ping", {"n": 3})]


def test_unknown_command_has_its_own_code():
    replies = exchange(make_control([]), encode_request("sync"))
    assert replies[-1]["kind"] == "error" and replies[-1]["code"] == ExitCode.UNSUPPORTED
    assert len(replies) == 1


def test_bad_arguments_are_usage_errors_and_run_nothing():
    calls = []
    replies = exchange(make_control(calls), encode_request("ping", {"n": "three"}))
    assert replies == [{"kind": "error", "code": 2, "error": "ping: argument 'n' must be an integer, got \"three\""}]
    assert calls == []


def test_a_usage_error_raised_by_a_command_keeps_exit_code_2():
    assert exchange(make_control([]), encode_request("refuses")) == \
        [{"kind": "error", "code": 2, "error": "warmup: nothing to warm"}]


@pytest.mark.allow_warnings
def test_a_bug_in_a_command_is_an_internal_error_reply():
    (reply,) = exchange(make_control([]), encode_request("broken"))
    assert reply["code"] == ExitCode.INTERNAL and "a bug" in reply["error"]


def test_oversize_request_gets_a_typed_reply_not_an_io_error():
    raw = encode_request("ping", {"pad": "x" * protocol.MAX_REQUEST})
    (reply,) = exchange(make_control([]), raw)
    assert reply["code"] == ExitCode.USAGE and "larger than" in reply["error"]


def test_malformed_json_gets_a_typed_reply():
    (reply,) = exchange(make_control([]), b'{"protocol": 1, "op": ')
    assert reply["code"] == ExitCode.USAGE and "not JSON" in reply["error"]


@pytest.mark.parametrize("uid, allowed", [(0, True), (OWNER, True), (OWNER + 1, False), (65534, False)])
def test_state_changing_commands_only_for_root_and_the_owner(uid, allowed):
    calls = []
    control = make_control(calls)
    replies = exchange(control, encode_request("poke"), uid=uid)
    if allowed:
        assert replies == [{"kind": "event", "data": {"poked": True}}, {"kind": "end"}]
        assert calls == [("poke", {})]
    else:
        assert replies[0]["kind"] == "error" and replies[0]["code"] == ExitCode.PERMISSION == 13
        assert f"uid {uid}" in replies[0]["error"] and calls == []
    # read-only commands answer everyone
    assert exchange(control, encode_request("ping"), uid=uid)[-1] == {"kind": "end"}
    # a refused caller learns nothing about the arguments and runs nothing
    (refused,) = exchange(control, encode_request("poke", {"bogus": 1}), uid=uid)
    assert refused["code"] == (ExitCode.USAGE if allowed else ExitCode.PERMISSION)


@pytest.mark.parametrize("uid, may_change", [(0, True), (OWNER, True), (7, False)])
def test_hello_answers_version_commands_and_the_callers_rights(uid, may_change):
    replies = exchange(make_control([]), encode_request(protocol.HELLO), uid=uid)
    assert replies[-1] == {"kind": "end"}
    hello = replies[0]["data"]
    assert hello["protocol"] == protocol.PROTOCOL_VERSION
    assert hello["commands"] == ["broken", "hello", "ping", "poke", "refuses"]
    assert hello["restricted"] == ["poke"] and hello["may_change"] is may_change


def test_a_second_request_on_one_open_is_refused():
    control = make_control([])

    async def main():
        fh = control.open(Ctx(OWNER))
        control.write(fh, encode_request("ping"))
        await control.read(fh, 10)
        with pytest.raises(OSError):
            control.write(fh, b"more")
        control.release(fh)

    trio.run(main)


# ---- the one command table ---------------------------------------------------------------------------
async def _nothing(args):
    yield {}


def test_the_table_of_a_read_only_and_a_writable_mount():
    warm = {name: _nothing for name in WARM_COMMANDS}
    read_only = command_table(dict, warm, None)
    assert "sync" not in read_only
    writable = command_table(dict, warm, _nothing)
    assert set(writable) == {"status", "sync", *WARM_COMMANDS}
    assert {n for n, c in writable.items() if c.changes_state} == \
        {"sync", "warmup", "warmup_paths", "warmup_evict", "warmup_unpin"}
    assert {n for n, c in writable.items() if not c.changes_state} == {"status", "warmup_check"}


def test_the_table_refuses_a_warm_engine_that_names_other_commands():
    """A renamed engine command fails the daemon's start (every mount test), not a user's request."""
    warm = {name: _nothing for name in WARM_COMMANDS if name != "warmup_unpin"} | {"warmup_release": _nothing}
    with pytest.raises(RuntimeError, match="warmup_release"):
        command_table(dict, warm, None)


# ---- fuzz: arbitrary bytes never raise, always one typed error or events + end --------------------
@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=300),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                              lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
                                  st.sampled_from(["protocol", "op", "args", "command", "n", "x"]), kids,
                                  max_size=4), max_leaves=12).map(lambda v: json.dumps(v).encode())))
def test_fuzz_the_request_decoder(raw):
    try:
        request = decode_request(raw)
    except CachefsError as exc:
        assert exc.exit_code in (ExitCode.USAGE, ExitCode.UNSUPPORTED)
    else:
        assert isinstance(request.op, str) and isinstance(request.args, dict)
    replies = exchange(make_control([], with_bug=False), raw, uid=65534)
    assert replies[-1]["kind"] in ("end", "error")
    assert all(r["kind"] == "event" for r in replies[:-1])
    if replies[-1]["kind"] == "error":
        assert replies[-1]["code"] in (ExitCode.USAGE, ExitCode.PERMISSION, ExitCode.UNSUPPORTED)


# ---- the client stays light ---------------------------------------------------------------------------
def test_clients_import_only_the_protocol_not_the_daemon_stack():
    import subprocess
    import sys
    heavy = ["trio", "pyfuse3", "boto3", "botocore", "prometheus_client", "cachefs.daemon", "cachefs.control.server",
             "cachefs.namespace.vfs", "cachefs.tiers.cache"]
    code = f"import sys, warmup.cli, cachefs.control.client; print([m for m in {heavy!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# ---- the client's reading of replies (a fake control file: its replies are scripted) ----------------
@pytest.fixture
def scripted(monkeypatch, tmp_path):
    """request() against scripted reply lines; returns the list to fill and the requests written."""
    from cachefs.control import client

    lines: list[bytes] = []
    sent: list[bytes] = []
    (tmp_path / protocol.CONTROL_NAME).write_bytes(b"")

    def replies(fd, mountpoint, channel):
        for line in lines:
            yield json.loads(line)

    monkeypatch.setattr(client, "_replies", replies)
    monkeypatch.setattr(client._Files, "send", staticmethod(lambda fd, data, mnt: sent.append(data)))
    return lines, sent, str(tmp_path)


def test_client_yields_events_until_end_and_sends_the_schema(scripted):
    from cachefs.control.client import request
    lines, sent, mnt = scripted
    lines += [b'{"kind":"event","data":{"progress":1}}', b'{"kind":"event","data":{"done":true}}', b'{"kind":"end"}',
              b'{"kind":"event","data":{"after":"end"}}']
    assert list(request(mnt, "sync", wait=True)) == [{"progress": 1}, {"done": True}]
    assert json.loads(sent[0]) == {"protocol": protocol.PROTOCOL_VERSION, "op": "sync", "args": {"wait": True}}


def test_client_raises_the_daemons_error_with_its_code(scripted):
    from cachefs.control.client import request
    lines, _, mnt = scripted
    lines += [b'{"kind":"event","data":{"progress":1}}', b'{"kind":"error","code":13,"error":"only root"}']
    replies = request(mnt, "sync")
    assert next(replies) == {"progress": 1}
    with pytest.raises(PermissionDenied, match="only root") as caught:
        next(replies)
    assert caught.value.exit_code == 13


def test_client_reports_an_older_daemon_by_shape_not_text(scripted):
    from cachefs.control.client import request
    lines, _, mnt = scripted
    lines += [b'{"error": "bad request ...; commands: [\'status\']"}']      # what a protocol-0 daemon answers
    with pytest.raises(Unsupported, match="older control protocol") as caught:
        list(request(mnt, "status"))
    assert caught.value.exit_code == ExitCode.UNSUPPORTED


def test_client_reports_a_stream_cut_before_its_end(scripted):
    from cachefs.control.client import request
    lines, _, mnt = scripted
    lines += [b'{"kind":"event","data":{"progress":1}}']
    with pytest.raises(NoDaemon, match="stopped answering"):
        list(request(mnt, "warmup"))


def test_client_of_a_plain_directory_is_no_daemon(tmp_path):
    from cachefs.control.client import request
    with pytest.raises(NoDaemon, match="not a cachefs mount"):
        list(request(str(tmp_path), "status"))
