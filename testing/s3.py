"""The S3 servers tests and benchmarks talk to on loopback, and their helpers.

moto's server mode is the one cachefs's demo embeds as well (``cachefs.demo.local_s3``: the
demo's default store), so the tests reuse that server class rather than ship a second one; the
helpers here (credentials, ports, clients, buckets) are for tests and benchmarks.
"""

from cachefs.demo.local_s3 import LocalS3Server, free_port, local_credentials_env, make_bucket, s3_client

__all__ = ["LocalS3Server", "free_port", "local_credentials_env", "make_bucket", "s3_client"]
