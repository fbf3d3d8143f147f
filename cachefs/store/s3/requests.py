"""S3 requests from worker threads without botocore: built, signed (``sigv4``) and sent with urllib3.

The one place for threaded lean requests; ``http`` is the one for GETs as trio tasks. Both sign
with ``sigv4.Signer`` and check answers with ``answer``.

Which call goes where:

- here: GetObject where the trio path cannot be used, ListObjectsV2 pages (botocore spends ~60 us
  per listed object parsing a page: dateutil timestamps, its shape walker; ElementTree's C parser
  and ``datetime.fromisoformat`` do it in a few), PutObject and UploadPart. A body is hashed once
  with SHA-256 (~1.7 GB/s with SHA-NI; hashlib releases the GIL) and signed as
  ``x-amz-content-sha256`` over HTTP and HTTPS alike: the server recomputes it and refuses a body
  damaged in transit, which is what Content-MD5 was for (botocore hashed a part twice);
- boto3, the rare calls: HeadBucket, HeadObject, CreateMultipartUpload, CompleteMultipartUpload,
  AbortMultipartUpload, DeleteObject, CopyObject, directory markers; and every call under
  ``--no-lean-requests`` (or with proxy settings, or no credentials found).

Answers come back in botocore's shapes (a response dict with ``ETag``, ``ContentRange``,
``ResponseMetadata.HTTPStatusCode``; ``ClientError`` for an error status), so the store's checks,
retries, error mapping and metrics apply unchanged.
"""

import datetime
import hashlib
import os
import xml.etree.ElementTree as ET
from typing import Any
from urllib.parse import unquote_plus, urlsplit

import urllib3
from botocore import exceptions as bx

from cachefs.store.s3.answer import BadAnswer, Window, content_length, error_of
from cachefs.store.s3.sigv4 import EMPTY_SHA256, Signer, object_path, query_string

_READ = 1 << 20


def lean_usable(endpoint_url: str | None, credentials: Any) -> bool:
    """Whether the lean paths can stand in for boto3 here (no proxy settings, credentials found)."""
    proxied = any(os.environ.get(name) for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"))
    return credentials is not None and not proxied and bool(endpoint_url)


class Requests:
    """Path-style signed requests on one endpoint, sharing one urllib3 connection pool."""

    def __init__(self, endpoint_url: str, region: str, credentials: Any, *, max_connections: int,
                 connect_timeout: float, read_timeout: float) -> None:
        parts = urlsplit(endpoint_url.rstrip("/"))
        self._endpoint = f"{parts.scheme}://{parts.netloc}"
        self._root = parts.path
        self._host = parts.netloc
        self._signer = Signer(credentials, region)
        timeout = urllib3.Timeout(connect=connect_timeout, read=read_timeout)
        self._pool = urllib3.PoolManager(num_pools=4, maxsize=max_connections, block=False, timeout=timeout,
                                         retries=False, ca_certs=os.environ.get("AWS_CA_BUNDLE"))

    def get(self, bucket: str, key: str, headers: dict[str, str], window: Window | None = None) -> tuple[dict, bytes]:
        """(response dict, body) of one GET; ClientError for an HTTP error status."""
        answer = self._send("GET", object_path(bucket, key), headers, preload=False)
        response = {"ETag": answer.headers.get("ETag"), "ContentRange": answer.headers.get("Content-Range"),
                    "ContentLength": content_length(answer.headers.get("Content-Length")),
                    "ResponseMetadata": {"HTTPStatusCode": answer.status}}
        cut, body = None, None
        try:
            if window is not None and answer.status < 300:
                cut = window(answer.status, response["ContentLength"])
            body = _read_window(answer, *cut) if cut else answer.read()
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ConnectionError(f"GET {self._endpoint}{object_path(bucket, key)}: {type(exc).__name__}: "
                                  f"{exc}") from None
        finally:
            if body is None:
                answer.close()        # not read to its end (an error, or refused by ``window``): not reusable
            answer.release_conn()
        response["Cut"] = bool(cut)
        if answer.status >= 300:
            response["RetryAfter"] = answer.headers.get("Retry-After")
            raise bx.ClientError({"Error": error_of(answer.status, body), **response}, "GetObject")
        return response, body

    def list_page(self, bucket: str, params: dict[str, str]) -> dict:
        """One ListObjectsV2 page (``prefix``, ``delimiter``, ``continuation-token`` in ``params``)
        in the shape boto3's ``list_objects_v2`` returns; ClientError for an HTTP error status."""
        query = {"list-type": "2", "encoding-type": "url", **params}
        answer = self._send("GET", f"/{bucket}", {}, query=query)
        meta = {"ResponseMetadata": {"HTTPStatusCode": answer.status}}
        if answer.status >= 300:
            meta["RetryAfter"] = answer.headers.get("Retry-After")
            raise bx.ClientError({"Error": error_of(answer.status, answer.data), **meta}, "ListObjectsV2")
        try:
            return {**parse_list_page(answer.data), **meta}
        except (ET.ParseError, ValueError, KeyError) as exc:
            raise BadAnswer(f"unreadable ListObjectsV2 answer: {exc}") from None

    def put(self, bucket: str, key: str, body: bytes, query: dict[str, str] | None = None,
            operation: str = "PutObject") -> dict:
        """The response dict of one PUT of ``body``; ClientError for an HTTP error status."""
        answer = self._send("PUT", object_path(bucket, key), {"Content-Length": str(len(body))}, query=query,
                            body=body)
        response = {"ETag": answer.headers.get("ETag"), "ResponseMetadata": {"HTTPStatusCode": answer.status}}
        if answer.status >= 300:
            response["RetryAfter"] = answer.headers.get("Retry-After")
            raise bx.ClientError({"Error": error_of(answer.status, answer.data), **response}, operation)
        return response

    def upload_part(self, bucket: str, key: str, upload_id: str, number: int, body: bytes) -> dict:
        return self.put(bucket, key, body, {"partNumber": str(number), "uploadId": upload_id}, "UploadPart")

    def _send(self, method: str, path: str, headers: dict[str, str], *, query: dict[str, str] | None = None,
              body: bytes | None = None, preload: bool = True) -> urllib3.BaseHTTPResponse:
        path = self._root + path
        qs = query_string(query)
        digest = hashlib.sha256(body).hexdigest() if body else EMPTY_SHA256
        signed = self._signer.headers(method, self._host, path, headers, query=qs, payload_sha256=digest)
        url = f"{self._endpoint}{path}" + (f"?{qs}" if qs else "")
        try:
            return self._pool.urlopen(method, url, body=body, headers=signed, preload_content=preload,
                                      decode_content=False, redirect=False)
        except urllib3.exceptions.TimeoutError as exc:
            raise TimeoutError(f"{method} {url}: {exc}") from None
        except urllib3.exceptions.HTTPError as exc:
            raise ConnectionError(f"{method} {url}: {type(exc).__name__}: {exc}") from None


def _read_window(answer: urllib3.BaseHTTPResponse, skip: int, take: int) -> bytes:
    """Bytes [skip, skip + take) of a streamed body, nothing after; the connection is then closed
    (it still carries the rest of the body, so it cannot be reused)."""
    try:
        while skip:
            data = answer.read(min(skip, _READ))
            if not data:
                return b""
            skip -= len(data)
        return answer.read(take)
    finally:
        answer.close()


def parse_list_page(body: bytes) -> dict:
    """A ListObjectsV2 result as boto3 shapes it: Contents (Key, Size, LastModified as an aware
    datetime, ETag), CommonPrefixes (Prefix), IsTruncated, NextContinuationToken. Keys and
    prefixes are URL-decoded when the answer says ``EncodingType`` url, as botocore does.
    ValueError (or ET.ParseError) for an answer that is not a sane page: an object without Key or
    with a Size that is not a non-negative integer, a CommonPrefixes without Prefix."""
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
                         "Size": _size(key, item.findtext(f"{ns}Size")),
                         "LastModified": _timestamp(item.findtext(f"{ns}LastModified")),
                         "ETag": item.findtext(f"{ns}ETag") or ""})
    prefixes = []
    for item in root.iterfind(f"{ns}CommonPrefixes"):
        prefix = item.findtext(f"{ns}Prefix")
        if prefix is None:
            raise ValueError("CommonPrefixes without Prefix")
        prefixes.append({"Prefix": name(prefix)})
    page: dict[str, Any] = {"IsTruncated": (root.findtext(f"{ns}IsTruncated") or "").lower() == "true"}
    if contents:
        page["Contents"] = contents
    if prefixes:
        page["CommonPrefixes"] = prefixes
    token = root.findtext(f"{ns}NextContinuationToken")
    if token:
        page["NextContinuationToken"] = token
    return page


def _size(key: str, text: str | None) -> int:
    try:
        size = int(text or 0)
    except ValueError:
        raise ValueError(f"object {key[:100]!r}: Size {text[:40]!r} is not a number") from None
    if size < 0:
        raise ValueError(f"object {key[:100]!r}: negative Size {size}")
    return size


def _timestamp(text: str | None) -> datetime.datetime:
    if not text:
        raise ValueError("object without LastModified")
    value = datetime.datetime.fromisoformat(text.strip())
    return value if value.tzinfo else value.replace(tzinfo=datetime.UTC)
