"""CSI Controller service: dynamic volumes (a prefix per volume, csi.dynamic) and capability checks.

Static volumes need no controller call: their PV carries ``volumeHandle`` and ``volumeAttributes``
(url, endpoint, ...), checked by the node at NodeStage and here by ValidateVolumeCapabilities.
"""

import logging

from csi import capability, dynamic
from csi.attributes import CO_PREFIX, mount_values
from csi.errors import already_exists, handled, invalid, not_found, required
from csi.proto import pb, rpc

log = logging.getLogger("cachefs.csi")
Cap = pb.ControllerServiceCapability.RPC


class ControllerService(rpc.ControllerServicer):
    @handled
    def CreateVolume(self, request, context):
        required(request.name, "name")
        if not request.volume_capabilities:
            raise invalid("volume_capabilities is required")
        for cap in request.volume_capabilities:
            capability.checked(cap, "volume_capabilities")
        params = {k: v for k, v in request.parameters.items() if not k.startswith(CO_PREFIX)}
        attributes = {k: v for k, v in params.items() if k not in dynamic.PARAMETERS}
        volume = dynamic.from_parameters(request.name, params)
        context_attrs = {**volume.context(), **attributes}
        mount_values(context_attrs)                  # unknown or malformed attributes -> INVALID_ARGUMENT
        capacity = _capacity(request.capacity_range)
        record = {"name": request.name, "capacity": capacity, "parameters": params}
        with dynamic.Buckets(volume, dict(request.secrets)) as buckets:
            existing = buckets.read_record()
            if existing is not None and existing != record:
                raise already_exists(f"volume {request.name} exists with another capacity or parameters")
            if existing is None:
                buckets.write_record(record)
                log.info("created volume %s at %s", request.name, volume.url)
        return pb.CreateVolumeResponse(volume=pb.Volume(volume_id=volume.volume_id, capacity_bytes=capacity,
                                                        volume_context=context_attrs))

    @handled
    def DeleteVolume(self, request, context):
        required(request.volume_id, "volume_id")
        volume = dynamic.from_id(request.volume_id)
        if volume is None:
            return pb.DeleteVolumeResponse()          # not ours, or already gone: nothing to delete
        with dynamic.Buckets(volume, dict(request.secrets)) as buckets:
            buckets.delete(data=volume.on_delete == "delete")
        log.info("deleted volume %s (%s)", volume.name, "data deleted" if volume.on_delete == "delete" else "data kept")
        return pb.DeleteVolumeResponse()

    @handled
    def ValidateVolumeCapabilities(self, request, context):
        required(request.volume_id, "volume_id")
        if not request.volume_capabilities:
            raise invalid("volume_capabilities is required")
        attrs = dict(request.volume_context)
        volume = dynamic.from_id(request.volume_id)
        if volume is not None:
            with dynamic.Buckets(volume, dict(request.secrets)) as buckets:
                if buckets.read_record() is None:
                    raise not_found(f"volume {request.volume_id} does not exist")
            attrs = {**volume.context(), **attrs}
        elif "url" not in attrs:
            raise not_found(f"volume {request.volume_id} is not a cachefs volume (no url attribute)")
        values = mount_values(attrs)
        writable = not (values.get("read_only") or values.get("immutable"))
        reasons = [r for cap in request.volume_capabilities if (r := capability.unsupported(cap, writable))]
        if reasons:
            return pb.ValidateVolumeCapabilitiesResponse(message="; ".join(sorted(set(reasons))))
        return pb.ValidateVolumeCapabilitiesResponse(confirmed=pb.ValidateVolumeCapabilitiesResponse.Confirmed(
            volume_context=request.volume_context, volume_capabilities=request.volume_capabilities,
            parameters=request.parameters))

    @handled
    def ControllerGetCapabilities(self, request, context):
        return pb.ControllerGetCapabilitiesResponse(capabilities=[
            pb.ControllerServiceCapability(rpc=Cap(type=Cap.CREATE_DELETE_VOLUME))])


def _capacity(capacity_range) -> int:
    """An object store has no size: report what was asked (required, else the limit, else 0)."""
    required_bytes, limit = capacity_range.required_bytes, capacity_range.limit_bytes
    if required_bytes < 0 or limit < 0 or (limit and required_bytes > limit):
        raise invalid("capacity_range: required_bytes must be >= 0 and <= limit_bytes")
    return required_bytes or limit
