"""The generated CSI messages (``pb``) and service stubs (``rpc``), built on first use if needed."""

from csi import _build

_build.ensure()

from csi._proto import csi_pb2 as pb  # noqa: E402
from csi._proto import csi_pb2_grpc as rpc  # noqa: E402

__all__ = ["pb", "rpc"]
