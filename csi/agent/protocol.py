"""The agent's socket protocol: one JSON object per line each way.

Request ``{"op": "stage", "args": {...}}``; reply ``{"ok": {...}}`` or
``{"error": {"code": "NOT_FOUND", "message": "..."}}`` (code: a gRPC status name). The socket is
a root-only (0600) unix socket on the host; requests may carry secrets, replies never do.
"""

import json
import socket

from csi.errors import CsiError

OPS = ("stage", "unstage", "publish", "unpublish", "stats", "list", "ping", "yield", "exit")


def encode(obj: dict) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def call(path: str, op: str, /, timeout: float = 600.0, **args) -> dict:
    """One request to the agent at ``path``; raises CsiError (UNAVAILABLE when it does not answer)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(encode({"op": op, "args": args}))
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError as exc:
        raise CsiError("UNAVAILABLE", f"the cachefs node agent at {path} does not answer: "
                       f"{exc.strerror or exc}") from None
    try:
        reply = json.loads(data)
    except ValueError:
        raise CsiError("UNAVAILABLE", f"the cachefs node agent at {path} closed the connection") from None
    if "error" in reply:
        raise CsiError(reply["error"]["code"], reply["error"]["message"])
    return reply["ok"]
