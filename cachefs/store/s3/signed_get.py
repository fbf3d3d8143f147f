"""Object GETs without botocore's request and response machinery.

A cold epoch of small files is bound by client CPU on a small node. botocore spends most of a
GET's ~1.5-2 ms building the request through its event hooks and parsing the response
(dateutil timestamps included), not on the network. This module signs the request with
botocore's own SigV4 signer (credentials from the same session, refreshed as usual) and sends
it with urllib3 (botocore's transport). It answers in botocore's shapes: a response dict with
``ETag``, ``ContentRange`` and ``ResponseMetadata.HTTPStatusCode``, and ``ClientError`` for an
error status, so the store's verification, retries, error mapping and metrics apply unchanged.
GETs of object bytes use it where the trio path (``async_get``) cannot; ListObjectsV2 pages use
it always (``list_page``): botocore spends ~60 us per listed object parsing a page (dateutil
timestamps, its shape walker), a minute of CPU for an ImageNet-sized listing; ElementTree's C
parser and ``datetime.fromisoformat`` do it in a few. Everything else goes through the boto3 client.
"""

import datetime
import os
import re
import xml.etree.ElementTree as ET
from typing import Any
from urllib.parse import quote, unquote_plus, urlencode

import urllib3
from botocore import exceptions as bx
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest

_CODE_RE = re.compile(rb"<Code>([^<]*)</Code>")
_MESSAGE_RE = re.compile(rb"<Message>([^<]*)</Message>")


class SignedGetter:
    """Path-style signed GETs on one endpoint, sharing one urllib3 connection pool."""

    def __init__(self, client: Any, credentials: Any, *, max_connections: int, connect_timeout: float,
                 read_timeout: float) -> None:
        self._endpoint = client.meta.endpoint_url.rstrip("/")
        self._region = client.meta.region_name or "us-east-1"
        self._credentials = credentials
        timeout = urllib3.Timeout(connect=connect_timeout, read=read_timeout)
        self._pool = urllib3.PoolManager(num_pools=4, maxsize=max_connections, block=False, timeout=timeout,
                                         retries=False, ca_certs=os.environ.get("AWS_CA_BUNDLE"))

    @staticmethod
    def usable(client: Any, credentials: Any) -> bool:
        """Whether this path can stand in for boto3 here (no proxy settings, credentials found)."""
        proxied = any(os.environ.get(name) for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy",
                                                        "https_proxy"))
        return credentials is not None and not proxied and bool(client.meta.endpoint_url)

    def url(self, bucket: str, key: str) -> str:
        return self._endpoint + object_path(bucket, key)

    def get(self, bucket: str, key: str, headers: dict[str, str]) -> tuple[dict, bytes]:
        """(response dict, body) of one GET; ClientError for an HTTP error status."""
        answer = self._send(self.url(bucket, key), headers)
        response = {"ETag": answer.headers.get("ETag"), "ContentRange": answer.headers.get("Content-Range"),
                    "ResponseMetadata": {"HTTPStatusCode": answer.status}}
        if answer.status >= 300:
            raise bx.ClientError({"Error": error_of(answer.status, answer.data), **response}, "GetObject")
        return response, answer.data

    def list_page(self, bucket: str, params: dict[str, str]) -> dict:
        """One ListObjectsV2 page (``prefix``, ``delimiter``, ``continuation-token`` in ``params``)
        in the shape boto3's ``list_objects_v2`` returns; ClientError for an HTTP error status."""
        query = urlencode(sorted({"list-type": "2", "encoding-type": "url", **params}.items()),
                          quote_via=quote, safe="-_.~")
        answer = self._send(f"{self._endpoint}/{bucket}?{query}", {})
        meta = {"ResponseMetadata": {"HTTPStatusCode": answer.status}}
        if answer.status >= 300:
            raise bx.ClientError({"Error": error_of(answer.status, answer.data), **meta}, "ListObjectsV2")
        try:
            return {**parse_list_page(answer.data), **meta}
        except (ET.ParseError, ValueError, KeyError) as exc:
            raise ConnectionError(f"list {bucket}: unreadable ListObjectsV2 answer: {exc}") from None

    def _send(self, url: str, headers: dict[str, str]) -> urllib3.BaseHTTPResponse:
        request = AWSRequest(method="GET", url=url, headers=headers)
        S3SigV4Auth(self._credentials.get_frozen_credentials(), "s3", self._region).add_auth(request)
        try:
            return self._pool.urlopen("GET", url, headers=dict(request.headers.items()),
                                      preload_content=True, redirect=False)
        except urllib3.exceptions.TimeoutError as exc:
            raise TimeoutError(f"GET {url}: {exc}") from None
        except urllib3.exceptions.HTTPError as exc:
            raise ConnectionError(f"GET {url}: {type(exc).__name__}: {exc}") from None


def parse_list_page(body: bytes) -> dict:
    """A ListObjectsV2 result as boto3 shapes it: Contents (Key, Size, LastModified as an aware
    datetime, ETag), CommonPrefixes (Prefix), IsTruncated, NextContinuationToken. Keys and
    prefixes are URL-decoded when the answer says ``EncodingType`` url, as botocore does."""
    root = ET.fromstring(body)
    ns = root.tag[:root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    decode = (root.findtext(f"{ns}EncodingType") or "").lower() == "url"
    name = unquote_plus if decode else str
    contents = []
    for item in root.iterfind(f"{ns}Contents"):
        key = item.findtext(f"{ns}Key")
        if key is None:
            raise ValueError("object without Key")
        contents.append({"Key": name(key),
                         "Size": int(item.findtext(f"{ns}Size") or 0),
                         "LastModified": _timestamp(item.findtext(f"{ns}LastModified")),
                         "ETag": item.findtext(f"{ns}ETag") or ""})
    prefixes = [{"Prefix": name(p.findtext(f"{ns}Prefix"))} for p in root.iterfind(f"{ns}CommonPrefixes")]
    page: dict[str, Any] = {"IsTruncated": (root.findtext(f"{ns}IsTruncated") or "").lower() == "true"}
    if contents:
        page["Contents"] = contents
    if prefixes:
        page["CommonPrefixes"] = prefixes
    token = root.findtext(f"{ns}NextContinuationToken")
    if token:
        page["NextContinuationToken"] = token
    return page


def _timestamp(text: str | None) -> datetime.datetime:
    if not text:
        raise ValueError("object without LastModified")
    value = datetime.datetime.fromisoformat(text.strip())
    return value if value.tzinfo else value.replace(tzinfo=datetime.UTC)


def object_path(bucket: str, key: str) -> str:
    """The path-style request path of an object, percent-encoded once as S3 signs it ("/" kept)."""
    return f"/{bucket}/{quote(key, safe='/~')}"


def error_of(status: int, body: bytes | None) -> dict:
    """botocore's error shape from an S3 error response: Code and Message from the XML body."""
    body = body or b""
    code = _CODE_RE.search(body)
    message = _MESSAGE_RE.search(body)
    return {"Code": code[1].decode(errors="replace") if code else str(status),
            "Message": message[1].decode(errors="replace") if message else ""}
