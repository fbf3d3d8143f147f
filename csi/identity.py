"""CSI Identity service: the driver's name and version, its capabilities, readiness."""

from google.protobuf.wrappers_pb2 import BoolValue

from cachefs import __version__
from csi.agent import protocol as agent
from csi.errors import CsiError, handled
from csi.proto import pb, rpc

DRIVER_NAME = "csi.cachefs.io"


class IdentityService(rpc.IdentityServicer):
    def __init__(self, controller: bool, agent_socket: str | None) -> None:
        self.controller = controller
        self.agent_socket = agent_socket        # None in controller-only mode

    @handled
    def GetPluginInfo(self, request, context):
        return pb.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    @handled
    def GetPluginCapabilities(self, request, context):
        caps = []
        if self.controller:
            caps.append(pb.PluginCapability(service=pb.PluginCapability.Service(
                type=pb.PluginCapability.Service.CONTROLLER_SERVICE)))
        return pb.GetPluginCapabilitiesResponse(capabilities=caps)

    @handled
    def Probe(self, request, context):
        """Ready once the node agent answers (the node service cannot work without it)."""
        if self.agent_socket is None:
            return pb.ProbeResponse(ready=BoolValue(value=True))
        try:
            agent.call(self.agent_socket, "ping", timeout=5)
        except CsiError as exc:
            raise CsiError("FAILED_PRECONDITION", exc.message) from None
        return pb.ProbeResponse(ready=BoolValue(value=True))
