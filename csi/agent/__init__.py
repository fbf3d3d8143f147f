"""The node agent: owns the per-volume cachefs daemons, their cache dirs under the node cache root,
and the bind mounts of published targets; watches the daemons and repairs a dead one."""
