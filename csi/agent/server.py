"""The agent process: a unix-socket server in front of the VolumeManager, and its watchdog.

A new agent that finds another one answering on its socket replaces it without a failed read (a
rolling update of the node-agent DaemonSet with ``maxSurge``): it asks the old one to ``yield``
(no more repairs, no more requests), takes every live volume's mount from the old agent's keepers
into keepers of its own (``VolumeManager.take_over_all``; each a ``cachefs restart`` across
agents), tells the old one to ``exit``, and then serves on the socket.
"""

import contextlib
import json
import logging
import os
import signal
import socketserver
import threading

from cachefs.errors import UsageError
from cachefs.metrics import Exporter
from csi.agent.protocol import OPS, call, encode
from csi.agent.volumes import NodeConfig, VolumeManager
from csi.errors import CsiError

log = logging.getLogger("cachefs.csi.agent")


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        for line in self.rfile:
            self.wfile.write(encode(self.server.dispatch(line)))


class AgentServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, socket_path: str, manager: VolumeManager) -> None:
        self.manager = manager
        os.makedirs(os.path.dirname(socket_path) or ".", exist_ok=True)
        if os.path.exists(socket_path):
            os.unlink(socket_path)
        old = os.umask(0o177)                 # the socket is root-only: requests carry secrets
        try:
            super().__init__(socket_path, _Handler)
        finally:
            os.umask(old)

    def dispatch(self, line: bytes) -> dict:
        try:
            request = json.loads(line)
            op, args = request["op"], request.get("args", {})
        except (ValueError, KeyError, TypeError):
            return {"error": {"code": "INVALID_ARGUMENT", "message": "bad agent request: not a JSON request"}}
        try:
            if op not in OPS or not isinstance(args, dict):
                raise CsiError("INVALID_ARGUMENT", f"unknown agent operation {op!r}")
            if op == "ping":
                return {"ok": {"volumes": len(self.manager.volumes)}}
            if op == "yield":                 # a new agent takes over: no repairs, no requests from now on
                self.manager.yield_volumes()
                return {"ok": {"volumes": len(self.manager.volumes)}}
            if op == "exit":
                threading.Thread(target=self.shutdown, daemon=True).start()
                return {"ok": {}}
            if self.manager.yielded:
                raise CsiError("UNAVAILABLE", "this node agent is handing its volumes to a new one; retry")
            return {"ok": getattr(self.manager, op)(**args)}
        except CsiError as exc:
            return {"error": {"code": exc.code, "message": exc.message}}
        except Exception:
            log.exception("agent operation failed")
            return {"error": {"code": "INTERNAL", "message": "internal error in the cachefs node agent; see its log"}}


def _predecessor(socket_path: str) -> bool:
    """Whether another agent serves ``socket_path``; if so, it has yielded when this returns."""
    try:
        call(socket_path, "ping", timeout=5)
    except CsiError:
        return False
    log.info("another node agent serves %s: taking its volumes over", socket_path)
    call(socket_path, "yield", timeout=120)
    return True


def run_agent(socket_path: str, node: NodeConfig, check_interval: float = 1.0, ready_file: str | None = None) -> int:
    predecessor = _predecessor(socket_path)
    manager = VolumeManager(node)
    if predecessor:
        manager.take_over_all()
        with contextlib.suppress(CsiError):
            call(socket_path, "exit", timeout=10)
    try:
        exporter = Exporter(manager.metrics, node.metrics_host, node.agent_metrics_port, tries=1) \
            if node.agent_metrics_port else None
    except OSError as exc:
        raise UsageError(f"--agent-metrics-port: {exc}") from None
    server = AgentServer(socket_path, manager)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):         # the pod goes: stop serving, leave the keepers be
        signal.signal(sig, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())

    def watchdog() -> None:
        while not stop.wait(check_interval):
            try:
                manager.check_all()
            except Exception:
                log.exception("watchdog tick failed")

    manager.check_all()                     # repair what died while no agent ran (or was not taken over)
    threading.Thread(target=watchdog, name="watchdog", daemon=True).start()
    if ready_file:
        with open(ready_file, "w") as fh:
            fh.write(f"{os.getpid()}\n")
    log.info("cachefs csi-agent serving on %s (state %s, cache root %s, %d bytes%s)", socket_path,
             node.state_dir, node.cache_root, node.cache_size,
             f", metrics on {exporter.address}" if exporter else "")
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        stop.set()
        server.server_close()
        if exporter is not None:
            exporter.close()
    return 0
