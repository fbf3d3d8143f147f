"""The node agent's own Prometheus metrics (each daemon exports its own on its own port).

Labels: the CSI volume id only (a handle the admin chose; never a secret, bounded by the volumes
staged on the node).
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics


class AgentMetrics:
    def __init__(self) -> None:
        disable_created_metrics()
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.repairs = Counter("cachefs_csi_volume_repairs", "Volumes mounted again after their daemon died",
                               ["volume_id"], registry=r)
        self.abnormal_volumes = Gauge("cachefs_csi_volume_abnormal", "1 while a volume is down, or while "
                                      "containers on the node still hold a view of its dead mount",
                                      ["volume_id"], registry=r)
        self.volumes = Gauge("cachefs_csi_volumes", "Volumes staged on this node", registry=r)

    def repaired(self, volume_id: str) -> None:
        self.repairs.labels(volume_id).inc()

    def abnormal(self, volume_id: str, value: bool) -> None:
        self.abnormal_volumes.labels(volume_id).set(1 if value else 0)

    def forget(self, volume_id: str) -> None:
        for family in (self.repairs, self.abnormal_volumes):
            try:
                family.remove(volume_id)
            except KeyError:
                pass
