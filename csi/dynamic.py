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
    """The few S3 calls the controller makes (boto3; credentials from the request's secrets, or the
    standard chain when there are none)."""

    def __init__(self, volume: DynamicVolume, secrets: dict[str, str]) -> None:
        import boto3
        from botocore.config import Config

        from csi.attributes import SECRET_ENV
        names = {"AWS_ACCESS_KEY_ID": "aws_access_key_id", "AWS_SECRET_ACCESS_KEY": "aws_secret_access_key",
                 "AWS_SESSION_TOKEN": "aws_session_token"}
        creds = {names[SECRET_ENV[k]]: v for k, v in secrets.items() if k in SECRET_ENV and v}
        self.volume = volume
        self.client = boto3.client("s3", endpoint_url=volume.endpoint or None,
                                   region_name=volume.region or "us-east-1", **creds,
                                   config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 3},
                                                 connect_timeout=5, read_timeout=30))

    def read_record(self) -> dict | None:
        try:
            body = self._call("get_object", Bucket=self.volume.bucket, Key=self.volume.record_key)["Body"].read()
        except _Missing:
            return None
        return json.loads(body)

    def write_record(self, record: dict) -> None:
        self._call("put_object", Bucket=self.volume.bucket, Key=self.volume.record_key,
                   Body=json.dumps(record).encode())

    def delete(self, data: bool) -> None:
        """Drop the record, and with ``data`` every object under the volume's prefix."""
        if data:
            paginator = self.client.get_paginator("list_objects_v2")
            try:
                for page in paginator.paginate(Bucket=self.volume.bucket, Prefix=self.volume.prefix + "/"):
                    keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                    if keys:
                        self._call("delete_objects", Bucket=self.volume.bucket, Delete={"Objects": keys})
            except _Missing:
                pass
            except Exception as exc:
                raise _status(exc) from None
        try:
            self._call("delete_object", Bucket=self.volume.bucket, Key=self.volume.record_key)
        except _Missing:
            pass

    def _call(self, method: str, **kwargs):
        try:
            return getattr(self.client, method)(**kwargs)
        except Exception as exc:
            raise _status(exc) from None


class _Missing(CsiError):
    pass


def _status(exc: Exception) -> CsiError:
    if isinstance(exc, CsiError):
        return exc
    code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
    if code in ("NoSuchKey", "404"):
        return _Missing("NOT_FOUND", "no such object")
    if code == "NoSuchBucket":
        return CsiError("FAILED_PRECONDITION", "the StorageClass bucket does not exist")
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
        return CsiError("PERMISSION_DENIED", f"the object store refused the credentials ({code})")
    return CsiError("UNAVAILABLE", f"object store error: {code or type(exc).__name__}")
