"""cachefs: a caching FUSE filesystem for ML datasets on S3 / Ceph RGW."""

__version__ = "0.1.0"
