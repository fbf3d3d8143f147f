"""The plugin process: a grpcio server on a unix socket with the services of its mode."""

import logging
import os
import signal
import threading
from concurrent import futures

import grpc

from csi.errors import CsiError
from csi.proto import rpc

log = logging.getLogger("cachefs.csi")
MODES = ("node", "controller", "both")


def socket_path(endpoint: str) -> str:
    if not endpoint.startswith("unix://"):
        raise CsiError("INVALID_ARGUMENT", f"endpoint must be unix:///path/to/csi.sock, got {endpoint!r}")
    return endpoint[len("unix://"):]


def build_server(endpoint: str, node_id: str, mode: str, agent_socket: str) -> grpc.Server:
    from csi.controller import ControllerService
    from csi.identity import IdentityService
    from csi.node import NodeService

    path = socket_path(endpoint)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if os.path.exists(path):
        os.unlink(path)                   # a previous plugin's socket
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    has_node, has_controller = mode in ("node", "both"), mode in ("controller", "both")
    rpc.add_IdentityServicer_to_server(IdentityService(has_controller, agent_socket if has_node else None), server)
    if has_node:
        rpc.add_NodeServicer_to_server(NodeService(node_id, agent_socket), server)
    if has_controller:
        rpc.add_ControllerServicer_to_server(ControllerService(), server)
    server.add_insecure_port(f"unix://{path}")
    return server


def serve(endpoint: str, node_id: str, mode: str, agent_socket: str) -> int:
    server = build_server(endpoint, node_id, mode, agent_socket)
    server.start()
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    log.info("cachefs csi (%s) serving on %s, node %s, agent %s", mode, endpoint, node_id, agent_socket)
    stopped.wait()
    server.stop(grace=5).wait()
    return 0
