"""The agent process: a unix-socket server in front of the VolumeManager, and its watchdog."""

import json
import logging
import os
import socketserver
import threading

from cachefs.errors import UsageError
from cachefs.metrics import Exporter
from csi.agent.protocol import OPS, encode
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
            return {"ok": getattr(self.manager, op)(**args)}
        except CsiError as exc:
            return {"error": {"code": exc.code, "message": exc.message}}
        except Exception:
            log.exception("agent operation failed")
            return {"error": {"code": "INTERNAL", "message": "internal error in the cachefs node agent; see its log"}}


def run_agent(socket_path: str, node: NodeConfig, check_interval: float = 1.0) -> int:
    manager = VolumeManager(node)
    try:
        exporter = Exporter(manager.metrics, node.metrics_host, node.agent_metrics_port, tries=1) \
            if node.agent_metrics_port else None
    except OSError as exc:
        raise UsageError(f"--agent-metrics-port: {exc}") from None
    server = AgentServer(socket_path, manager)
    stop = threading.Event()

    def watchdog() -> None:
        while not stop.wait(check_interval):
            try:
                manager.check_all()
            except Exception:
                log.exception("watchdog tick failed")

    manager.check_all()                     # adopt: repair what died while no agent ran
    threading.Thread(target=watchdog, name="watchdog", daemon=True).start()
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
