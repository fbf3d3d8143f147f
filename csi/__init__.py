"""The cachefs CSI driver: Identity, Node and Controller gRPC services, and the node agent that owns
the per-volume daemons (see docs/kubernetes.md). Uses only the core's public API."""
