"""Dynamically provisioned volumes: a prefix per volume under a StorageClass's bucket.

A volume is ``s3://BUCKET/[BASE/]NAME``; its id is that URL plus what DeleteVolume needs (which
gets nothing but the id): ``s3://b/base/pvc-1?endpoint=http://rgw:7480&region=r&onDelete=retain``.
A record ``BASE/.cachefs-volumes/NAME.json`` (outside the volume's own prefix, so the mount never
shows it) holds the requested capacity and parameters: CreateVolume is idempotent on the name and
refuses the same name with another capacity or parameters (ALREADY_EXISTS).
"""

import json
import re
import urllib.parse
from dataclasses import dataclass

from csi.errors import CsiError, invalid

PARAMETERS = ("bucket", "endpoint", "prefix", "region", "onDelete")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,62}$")
RECORDS = ".cachefs-volumes"


@dataclass(frozen=True)
class DynamicVolume:
    bucket: str
    base: str
    name: str
    endpoint: str = ""
    region: str = ""
    on_delete: str = "delete"

    @property
    def prefix(self) -> str:
        return f"{self.base}/{self.name}" if self.base else self.name

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def record_key(self) -> str:
        return f"{self.base}/{RECORDS}/{self.name}.json" if self.base else f"{RECORDS}/{self.name}.json"

    @property
    def volume_id(self) -> str:
        query = {k: v for k, v in (("endpoint", self.endpoint), ("region", self.region)) if v}
        if self.on_delete != "delete":
            query["onDelete"] = self.on_delete
        return self.url + (f"?{urllib.parse.urlencode(query)}" if query else "")

    def context(self) -> dict[str, str]:
        """The volume_context the node receives (mount attributes, csi.attributes)."""
        return {"url": self.url, **({"endpoint": self.endpoint} if self.endpoint else {}),
                **({"region": self.region} if self.region else {})}


def from_parameters(name: str, parameters: dict[str, str]) -> DynamicVolume:
    if not _NAME_RE.match(name):
        raise invalid(f"volume name {name!r}: letters, digits, '.', '_' and '-' only, at most 128")
    bucket = parameters.get("bucket", "")
    if not _BUCKET_RE.match(bucket):
        raise invalid("StorageClass parameter 'bucket' is required (an S3 bucket name)"
                      if not bucket else f"StorageClass parameter 'bucket': not a bucket name: {bucket!r}")
    on_delete = parameters.get("onDelete", "delete")
    if on_delete not in ("delete", "retain"):
        raise invalid(f"StorageClass parameter 'onDelete': expected delete or retain, got {on_delete!r}")
    base = parameters.get("prefix", "").strip("/")
    if ".." in base.split("/"):
        raise invalid("StorageClass parameter 'prefix': must not contain '..'")
    return DynamicVolume(bucket, base, name, parameters.get("endpoint", ""), parameters.get("region", ""), on_delete)


def from_id(volume_id: str) -> DynamicVolume | None:
    """The volume an id names, or None if it is not a dynamic volume id of this driver."""
    url, _, query = volume_id.partition("?")
    if not url.startswith("s3://"):
        return None
    bucket, _, prefix = url[5:].partition("/")
    base, _, name = prefix.rpartition("/")
    args = dict(urllib.parse.parse_qsl(query))
    if not bucket or not _NAME_RE.match(name) or set(args) - {"endpoint", "region", "onDelete"}:
        return None
    return DynamicVolume(bucket, base, name, args.get("endpoint", ""), args.get("region", ""),
                         args.get("onDelete", "delete"))


class Buckets:
    """The few S3 calls the controller makes, through cachefs's S3 store (credentials from the
    request's secrets, or the standard chain when there are none)."""

    def __init__(self, volume: DynamicVolume, secrets: dict[str, str]) -> None:
        from botocore.credentials import Credentials

        from cachefs.metrics import Metrics
        from cachefs.store.s3.store import S3Options, S3Store
        from csi.attributes import SECRET_ENV
        given = {SECRET_ENV[k]: v for k, v in secrets.items() if k in SECRET_ENV and v}
        credentials = None
        if given.get("AWS_ACCESS_KEY_ID") and given.get("AWS_SECRET_ACCESS_KEY"):
            credentials = Credentials(given["AWS_ACCESS_KEY_ID"], given["AWS_SECRET_ACCESS_KEY"],
                                      given.get("AWS_SESSION_TOKEN"))
        self.volume = volume
        options = S3Options(endpoint_url=volume.endpoint or None, region=volume.region or "us-east-1",
                            max_connections=4, connect_timeout=5, read_timeout=30, max_attempts=3,
                            lean_requests=False)
        self.store = S3Store(volume.bucket, "", metrics=Metrics(), options=options, credentials=credentials)

    def read_record(self) -> dict | None:
        key = self.volume.record_key
        try:
            info = self._call(self.store.head, key)
            body = self._call(self.store.get, key, 0, info.size, info.etag, info.size)
        except _Missing:
            return None
        return json.loads(body)

    def write_record(self, record: dict) -> None:
        self._call(self.store.put, self.volume.record_key, json.dumps(record).encode())

    def delete(self, data: bool) -> None:
        """Drop the record, and with ``data`` every object under the volume's prefix."""
        if data:
            try:
                keys = self._call(lambda: [info.path for info in self.store.list_all(self.volume.prefix + "/")])
                self._call(self.store.delete_many, keys)
            except _Missing:
                pass
        self._call(self.store.delete, self.volume.record_key)

    def __enter__(self) -> "Buckets":
        return self

    def __exit__(self, *exc) -> None:
        self.store.close()

    @staticmethod
    def _call(method, *args):
        try:
            return method(*args)
        except Exception as exc:
            raise _status(exc) from None


class _Missing(CsiError):
    pass


def _status(exc: Exception) -> CsiError:
    from cachefs.errors import AccessDenied, CachefsError, NoSuchBucket, NoSuchKey
    if isinstance(exc, CsiError):
        return exc
    if isinstance(exc, NoSuchBucket):
        return CsiError("FAILED_PRECONDITION", "the StorageClass bucket does not exist")
    if isinstance(exc, NoSuchKey):
        return _Missing("NOT_FOUND", "no such object")
    if isinstance(exc, AccessDenied):
        return CsiError("PERMISSION_DENIED", f"the object store refused the credentials ({exc})")
    if isinstance(exc, CachefsError):
        return CsiError("UNAVAILABLE", f"object store error: {exc}")
    return CsiError("UNAVAILABLE", f"object store error: {type(exc).__name__}")
