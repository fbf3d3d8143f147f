"""CSI Node service: a thin front of the node agent, which owns the daemons and the mounts.

The plugin keeps no state: a restarted plugin finds every volume where the agent left it.
NodeStage = one daemon per volume at the staging path; NodePublish = a bind mount of it (read-only
when asked), reported only once the target is the live FUSE mount.
"""

from csi import capability
from csi.agent import protocol as agent
from csi.errors import handled, invalid, required
from csi.proto import pb, rpc

Cap = pb.NodeServiceCapability.RPC


class NodeService(rpc.NodeServicer):
    def __init__(self, node_id: str, agent_socket: str) -> None:
        self.node_id = node_id
        self.agent_socket = agent_socket

    def _agent(self, op: str, **args) -> dict:
        return agent.call(self.agent_socket, op, **args)

    @handled
    def NodeStageVolume(self, request, context):
        required(request.volume_id, "volume_id")
        required(request.staging_target_path, "staging_target_path")
        cap = capability.checked(request.volume_capability if request.HasField("volume_capability") else None)
        self._agent("stage", volume_id=request.volume_id, staging=request.staging_target_path,
                    attributes=with_mount_group(dict(request.volume_context), cap),
                    secrets=dict(request.secrets), readonly=capability.reader_only(cap))
        return pb.NodeStageVolumeResponse()

    @handled
    def NodeUnstageVolume(self, request, context):
        required(request.volume_id, "volume_id")
        required(request.staging_target_path, "staging_target_path")
        self._agent("unstage", volume_id=request.volume_id, staging=request.staging_target_path)
        return pb.NodeUnstageVolumeResponse()

    @handled
    def NodePublishVolume(self, request, context):
        required(request.volume_id, "volume_id")
        required(request.target_path, "target_path")
        cap = capability.checked(request.volume_capability if request.HasField("volume_capability") else None)
        required(request.staging_target_path, "staging_target_path (the volume must be staged first)")
        self._agent("publish", volume_id=request.volume_id, staging=request.staging_target_path,
                    target=request.target_path, readonly=request.readonly or capability.reader_only(cap))
        return pb.NodePublishVolumeResponse()

    @handled
    def NodeUnpublishVolume(self, request, context):
        required(request.volume_id, "volume_id")
        required(request.target_path, "target_path")
        self._agent("unpublish", volume_id=request.volume_id, target=request.target_path)
        return pb.NodeUnpublishVolumeResponse()

    @handled
    def NodeGetVolumeStats(self, request, context):
        required(request.volume_id, "volume_id")
        required(request.volume_path, "volume_path")
        stats = self._agent("stats", volume_id=request.volume_id, path=request.volume_path)
        usage = []
        if "bytes" in stats:
            (total, free), (files, ffree) = stats["bytes"], stats["inodes"]
            usage = [pb.VolumeUsage(total=total, available=free, used=max(0, total - free), unit=pb.VolumeUsage.BYTES),
                     pb.VolumeUsage(total=files, available=ffree, used=max(0, files - ffree),
                                    unit=pb.VolumeUsage.INODES)]
        return pb.NodeGetVolumeStatsResponse(usage=usage, volume_condition=pb.VolumeCondition(
            abnormal=stats["abnormal"], message=stats["message"]))

    @handled
    def NodeGetCapabilities(self, request, context):
        types = (Cap.STAGE_UNSTAGE_VOLUME, Cap.GET_VOLUME_STATS, Cap.VOLUME_CONDITION, Cap.VOLUME_MOUNT_GROUP)
        return pb.NodeGetCapabilitiesResponse(capabilities=[
            pb.NodeServiceCapability(rpc=Cap(type=t)) for t in types])

    @handled
    def NodeGetInfo(self, request, context):
        return pb.NodeGetInfoResponse(node_id=self.node_id)


def with_mount_group(attributes: dict[str, str], cap) -> dict[str, str]:
    """The pod's fsGroup (VOLUME_MOUNT_GROUP: kubelet delegates it instead of a recursive chown,
    which through FUSE would touch every object) becomes the files' group, group-writable when the
    volume is writable. A ``gid`` attribute wins; one daemon serves every pod of the volume on a
    node, so the first stage's group applies to all of them."""
    group = cap.mount.volume_mount_group if cap.HasField("mount") else ""
    if not group or "gid" in attributes:
        return attributes
    if not group.isdigit():
        raise invalid(f"volume_mount_group must be a numeric group id, got {group!r}")
    attributes = {**attributes, "gid": group}
    writable = not capability.reader_only(cap) and all(
        attributes.get(key, "false").lower() != "true" for key in ("readOnly", "immutable"))
    if writable:
        attributes.setdefault("fileMode", "0664")
        attributes.setdefault("dirMode", "0775")
    return attributes
