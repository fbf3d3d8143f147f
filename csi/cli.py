"""`cachefs csi` (the CSI plugin) and `cachefs csi-agent` (the node agent): parse, log, serve.

Registered as `cachefs` subcommands through the ``cachefs.commands`` entry point.
"""

import logging
import os
import sys

from cachefs.config import parse_size
from cachefs.errors import ConfigError, UsageError
from cachefs.extras import require

DEFAULT_AGENT_SOCKET = "/run/cachefs/agent.sock"


def _logging(level: str) -> None:
    logging.basicConfig(stream=sys.stderr, level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def register(subparsers) -> None:
    p = subparsers.add_parser("csi", help="run the Kubernetes CSI plugin (Identity, Node, Controller over gRPC)",
                              description="The cachefs CSI plugin. Node mode needs the node agent "
                              "(`cachefs csi-agent`) on the same host; see docs/kubernetes.md.")
    p.add_argument("--endpoint", default="unix:///csi/csi.sock", help="gRPC endpoint (unix:///path)")
    p.add_argument("--node-id", default=os.environ.get("NODE_NAME", ""), help="this node's name (default $NODE_NAME)")
    p.add_argument("--mode", choices=("node", "controller", "both"), default="both",
                   help="which services to serve (Identity always)")
    p.add_argument("--agent-socket", default=DEFAULT_AGENT_SOCKET, help="the node agent's unix socket")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run_plugin)


def register_agent(subparsers) -> None:
    p = subparsers.add_parser("csi-agent", help="run the CSI node agent (owns the per-volume daemons)",
                              description="The node agent of the cachefs CSI driver: starts one cachefs daemon "
                              "per staged volume, outside the plugin's container, binds published targets, and "
                              "mounts a volume again when its daemon dies.")
    p.add_argument("--socket", default=DEFAULT_AGENT_SOCKET, help="unix socket the plugin calls (root-only)")
    p.add_argument("--state-dir", default="/var/lib/cachefs-csi", help="host directory for the agent's state")
    p.add_argument("--cache-root", default="/var/cache/cachefs-csi", help="node cache root (one dir per volume)")
    p.add_argument("--cache-size", default="100G", help="node-wide disk budget split across volumes")
    p.add_argument("--volume-slots", type=int, default=4,
                   help="a volume without cacheSize gets cache-size / volume-slots (default 4)")
    p.add_argument("--metrics-port", type=int, default=9567,
                   help="first Prometheus port of the daemons (each takes the next free one); 0 disables")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address the agent's and daemons' metrics listen on")
    p.add_argument("--agent-metrics-port", type=int, default=9566,
                   help="Prometheus port of the agent's own metrics (volume repairs, abnormal volumes); 0 disables")
    p.add_argument("--check-interval", type=float, default=1.0, help="seconds between liveness checks")
    p.add_argument("--ready-file", default=None,
                   help="a file written once the agent serves (after taking over from a running agent): "
                        "the pod's readiness probe")
    p.add_argument("--supervise", action="store_true",
                   help="run the agent as a child and start it again if it dies, so that the container (and the "
                        "volumes' keepers in it) outlives the agent process; the DaemonSet's entry point")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run_agent)


def run_plugin(args) -> int:
    require("csi", "cachefs csi")
    from csi.errors import CsiError
    from csi.server import serve

    if args.mode != "controller" and not args.node_id:
        raise UsageError("--node-id (or $NODE_NAME) is required in node mode")
    _logging(args.log_level)
    try:
        return serve(args.endpoint, args.node_id, args.mode, args.agent_socket)
    except CsiError as exc:
        raise UsageError(exc.message) from None


def run_agent(args) -> int:
    from csi.agent.server import run_agent as serve_agent
    from csi.agent.volumes import NodeConfig

    if os.geteuid() != 0:
        raise UsageError("the csi agent mounts filesystems: run it as root")
    try:
        size = parse_size(args.cache_size, "--cache-size")
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    if size <= 0 or args.volume_slots < 1 or args.check_interval <= 0:
        raise UsageError("--cache-size, --volume-slots and --check-interval must be positive")
    _logging(args.log_level)
    if args.supervise:
        from csi.agent.supervise import supervise

        return supervise(sys.argv[1:])
    node = NodeConfig(os.path.abspath(args.state_dir), os.path.abspath(args.cache_root), size,
                      args.volume_slots, args.metrics_port, args.metrics_host,
                      agent_metrics_port=args.agent_metrics_port)
    return serve_agent(args.socket, node, args.check_interval, args.ready_file)
