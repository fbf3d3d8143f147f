"""Every S3 request that is not a trio GET: built, signed (``sigv4``) and sent with urllib3 from
worker threads, answered in our own types (``answer.Reply``, ``Page``; ``answer.S3Error`` for
an error status). ``http`` sends GETs as trio tasks; nothing goes through botocore, which only
supplies credentials.

- GetObject where the trio path is not used (``--no-lean-requests``, a proxy), ListObjectsV2
  pages (botocore spent ~60 us per listed object parsing a page: dateutil timestamps, its shape
  walker; ElementTree's C parser and ``datetime.fromisoformat`` do it in a few), PutObject and
  UploadPart. A body is hashed once with SHA-256 (~1.7 GB/s with SHA-NI; hashlib releases the
  GIL) and signed as ``x-amz-content-sha256`` over HTTP and HTTPS alike: the server recomputes it
  and refuses a body damaged in transit, which is what Content-MD5 was for;
- the rare calls: HeadBucket, HeadObject, CreateMultipartUpload, CompleteMultipartUpload (its
  XML body signed the same way), AbortMultipartUpload, DeleteObject, CopyObject. The last two
  of these that copy or assemble may answer 200 and fail afterwards, with ``<Error>`` as the body:
  that is an S3Error like any other (InternalError is retried).

Proxies: ``HTTP(S)_PROXY`` and ``NO_PROXY`` as urllib reads them; a proxied endpoint is reached
through urllib3's ProxyManager (CONNECT for https), and its GETs run here rather than as trio tasks.
"""

import base64
import datetime
import hashlib
import os
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_plus, urlsplit
from xml.sax.saxutils import escape

import urllib3

from cachefs.store.s3.answer import BadAnswer, Reply, Window, content_length, error_in_body, error_of
from cachefs.store.s3.sigv4 import EMPTY_SHA256, Signer, check_headers, object_path, query_string

_READ = 1 << 20


@dataclass(slots=True)
class Listed:
    """One object of a listing page."""
    key: str
    size: int
    mtime: float
    etag: str


@dataclass(slots=True)
class Page:
    """One ListObjectsV2 page: objects, sub-prefixes (CommonPrefixes), and where the next begins."""
    objects: list[Listed] = field(default_factory=list)
    prefixes: list[str] = field(default_factory=list)
    truncated: bool = False
    token: str | None = None


def proxy_for(endpoint_url: str) -> str | None:
    """The proxy URL the environment names for ``endpoint_url`` (``NO_PROXY`` respected), or None."""
    parts = urlsplit(endpoint_url)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    return proxy


class Requests:
    """Path-style signed requests on one endpoint, sharing one urllib3 connection pool."""

    def __init__(self, endpoint_url: str, region: str, credentials: Any, *, max_connections: int,
                 connect_timeout: float, read_timeout: float) -> None:
        parts = urlsplit(endpoint_url.rstrip("/"))
        self._endpoint = f"{parts.scheme}://{parts.netloc}"
        self._root = parts.path
        self._host = parts.netloc
        self._signer = Signer(credentials, region)
        self.proxy = proxy_for(self._endpoint)
        timeout = urllib3.Timeout(connect=connect_timeout, read=read_timeout)
        pool = dict(num_pools=4, maxsize=max_connections, block=False, timeout=timeout, retries=False,
                    ca_certs=os.environ.get("AWS_CA_BUNDLE"))
        self._pool = urllib3.ProxyManager(self.proxy, **pool) if self.proxy else urllib3.PoolManager(**pool)

    # --- reads ---

    def get(self, bucket: str, key: str, headers: dict[str, str], window: Window | None = None) -> tuple[Reply, bytes]:
        """(reply, body) of one GET; S3Error for an HTTP error status."""
        answer = self._send("GET", object_path(bucket, key), headers, preload=False)
        reply = _reply(answer)
        cut, body = None, None
        try:
            if window is not None and answer.status < 300:
                cut = window(answer.status, reply.content_length)
            body = _read_window(answer, *cut) if cut else answer.read()
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ConnectionError(f"GET {self._endpoint}{object_path(bucket, key)}: {type(exc).__name__}: "
                                  f"{exc}") from None
        finally:
            if body is None:
                answer.close()        # not read to its end (an error, or refused by ``window``): not reusable
            answer.release_conn()
        reply.cut = bool(cut)
        if answer.status >= 300:
            raise error_of("GetObject", answer.status, body, answer.headers)
        return reply, body

    def head(self, bucket: str, key: str) -> Reply:
        """HeadObject: status, ETag, Content-Length, Last-Modified."""
        return _reply(self._checked("HeadObject", "HEAD", object_path(bucket, key)))

    def head_bucket(self, bucket: str) -> Reply:
        return _reply(self._checked("HeadBucket", "HEAD", f"/{bucket}"))

    def list_page(self, bucket: str, params: dict[str, str]) -> tuple[Reply, Page]:
        """One ListObjectsV2 page (``prefix``, ``delimiter``, ``continuation-token``, ``max-keys``
        in ``params``); S3Error for an HTTP error status, BadAnswer for an unreadable page."""
        query = {"list-type": "2", "encoding-type": "url", **params}
        answer = self._checked("ListObjectsV2", "GET", f"/{bucket}", query=query)
        try:
            return _reply(answer), parse_list_page(answer.data)
        except (ET.ParseError, ValueError, KeyError) as exc:
            raise BadAnswer(f"unreadable ListObjectsV2 answer: {exc}") from None

    # --- writes ---

    def put(self, bucket: str, key: str, body: bytes, query: dict[str, str] | None = None,
            operation: str = "PutObject") -> Reply:
        """The reply to one PUT of ``body``; S3Error for an HTTP error status."""
        return _reply(self._checked(operation, "PUT", object_path(bucket, key), query=query, body=body))

    def upload_part(self, bucket: str, key: str, upload_id: str, number: int, body: bytes) -> Reply:
        return self.put(bucket, key, body, {"partNumber": str(number), "uploadId": upload_id}, "UploadPart")

    def start_upload(self, bucket: str, key: str) -> tuple[Reply, str]:
        """CreateMultipartUpload: the reply and the new upload's id."""
        answer = self._checked("CreateMultipartUpload", "POST", object_path(bucket, key), query={"uploads": ""})
        upload_id = _text(answer.data, "UploadId")
        if not upload_id:
            raise BadAnswer("CreateMultipartUpload answered without an UploadId")
        return _reply(answer), upload_id

    def finish_upload(self, bucket: str, key: str, upload_id: str, parts: list[tuple[int, str]]) -> Reply:
        """CompleteMultipartUpload of ``parts`` ((number, ETag without quotes), in order)."""
        quoted = [(n, escape('"' + etag + '"')) for n, etag in parts]
        layout = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{etag}</ETag></Part>" for n, etag in quoted)
        body = f'<CompleteMultipartUpload xmlns="http://s3.amazonaws.com/doc/2006-03-01/">{layout}' \
               "</CompleteMultipartUpload>"
        return _reply(self._checked("CompleteMultipartUpload", "POST", object_path(bucket, key),
                                    query={"uploadId": upload_id}, body=body.encode()))

    def abort_upload(self, bucket: str, key: str, upload_id: str) -> Reply:
        return _reply(self._checked("AbortMultipartUpload", "DELETE", object_path(bucket, key),
                                    query={"uploadId": upload_id}))

    def delete(self, bucket: str, key: str) -> Reply:
        return _reply(self._checked("DeleteObject", "DELETE", object_path(bucket, key)))

    def delete_many(self, bucket: str, keys: list[str]) -> tuple[Reply, list[tuple[str, str]]]:
        """DeleteObjects of up to 1,000 ``keys`` (quiet): the reply and (key, code) of each key the
        server could not delete. Content-MD5 is sent: S3 requires it for this call."""
        objects = "".join(f"<Object><Key>{escape(key)}</Key></Object>" for key in keys)
        body = f"<Delete><Quiet>true</Quiet>{objects}</Delete>".encode()
        headers = {"Content-MD5": base64.b64encode(hashlib.md5(body).digest()).decode()}
        answer = self._checked("DeleteObjects", "POST", f"/{bucket}", headers, query={"delete": ""}, body=body)
        try:
            root = ET.fromstring(answer.data)
        except ET.ParseError as exc:
            raise BadAnswer(f"unreadable DeleteObjects answer: {exc}") from None
        ns = _namespace(root)
        failed = [(e.findtext(f"{ns}Key") or "", e.findtext(f"{ns}Code") or "") for e in root.iterfind(f"{ns}Error")]
        return _reply(answer), failed

    def copy(self, bucket: str, source: str, key: str) -> Reply:
        """CopyObject of ``source`` to ``key``, both in ``bucket``."""
        headers = {"x-amz-copy-source": object_path(bucket, source)}
        return _reply(self._checked("CopyObject", "PUT", object_path(bucket, key), headers))

    # --- the wire ---

    def _checked(self, operation: str, method: str, path: str, headers: dict[str, str] | None = None, *,
                 query: dict[str, str] | None = None, body: bytes | None = None) -> urllib3.BaseHTTPResponse:
        """The whole answer to one request; S3Error for an error status, or for a 200 whose body
        is an ``<Error>`` (CompleteMultipartUpload, CopyObject)."""
        headers = dict(headers or {})
        if body is not None:
            headers["Content-Length"] = str(len(body))
        answer = self._send(method, path, headers, query=query, body=body)
        if answer.status >= 300:
            raise error_of(operation, answer.status, answer.data, answer.headers)
        if method == "POST" or "x-amz-copy-source" in headers:
            error = error_in_body(operation, answer.status, answer.data, answer.headers)
            if error is not None:
                raise error
        return answer

    def _send(self, method: str, path: str, headers: dict[str, str], *, query: dict[str, str] | None = None,
              body: bytes | None = None, preload: bool = True) -> urllib3.BaseHTTPResponse:
        path = self._root + path
        qs = query_string(query)
        digest = hashlib.sha256(body).hexdigest() if body else EMPTY_SHA256
        signed = self._signer.headers(method, self._host, path, check_headers(headers), query=qs,
                                      payload_sha256=digest)
        url = f"{self._endpoint}{path}" + (f"?{qs}" if qs else "")
        try:
            return self._pool.urlopen(method, url, body=body, headers=signed, preload_content=preload,
                                      decode_content=False, redirect=False)
        except urllib3.exceptions.TimeoutError as exc:
            raise TimeoutError(f"{method} {url}: {exc}") from None
        except urllib3.exceptions.HTTPError as exc:
            raise ConnectionError(f"{method} {url}: {type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        self._pool.clear()


def _reply(answer: urllib3.BaseHTTPResponse) -> Reply:
    headers = answer.headers
    return Reply(answer.status, headers.get("ETag"), headers.get("Content-Range"),
                 content_length(headers.get("Content-Length")), headers.get("Last-Modified"))


def _namespace(root: ET.Element) -> str:
    """The ``{uri}`` prefix of an answer's elements (S3's XML namespace), or "" when it has none."""
    return root.tag[:root.tag.index("}") + 1] if root.tag.startswith("{") else ""


def _text(body: bytes, tag: str) -> str | None:
    """The text of the first ``tag`` element of an XML answer, whatever its namespace."""
    try:
        root = ET.fromstring(body)
    except ET.ParseError as exc:
        raise BadAnswer(f"unreadable answer: {exc}") from None
    for element in root.iter():
        if element.tag == tag or element.tag.endswith("}" + tag):
            return element.text
    return None


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


def parse_list_page(body: bytes) -> Page:
    """A ListObjectsV2 result: its objects (Key, Size, LastModified, ETag), CommonPrefixes,
    IsTruncated and NextContinuationToken. Keys and prefixes are URL-decoded when the answer says
    ``EncodingType`` url.
    ValueError (or ET.ParseError) for an answer that is not a sane page: an object without Key or
    with a Size that is not a non-negative integer, a CommonPrefixes without Prefix."""
    root = ET.fromstring(body)
    ns = _namespace(root)
    decode = (root.findtext(f"{ns}EncodingType") or "").lower() == "url"
    name = unquote_plus if decode else str
    page = Page(truncated=(root.findtext(f"{ns}IsTruncated") or "").lower() == "true",
                token=root.findtext(f"{ns}NextContinuationToken") or None)
    for item in root.iterfind(f"{ns}Contents"):
        key = item.findtext(f"{ns}Key")
        if key is None:
            raise ValueError("object without Key")
        page.objects.append(Listed(name(key), _size(key, item.findtext(f"{ns}Size")),
                                   _timestamp(item.findtext(f"{ns}LastModified")),
                                   (item.findtext(f"{ns}ETag") or "").strip('"')))
    for item in root.iterfind(f"{ns}CommonPrefixes"):
        prefix = item.findtext(f"{ns}Prefix")
        if prefix is None:
            raise ValueError("CommonPrefixes without Prefix")
        page.prefixes.append(name(prefix))
    return page


def _size(key: str, text: str | None) -> int:
    try:
        size = int(text or 0)
    except ValueError:
        raise ValueError(f"object {key[:100]!r}: Size {text[:40]!r} is not a number") from None
    if size < 0:
        raise ValueError(f"object {key[:100]!r}: negative Size {size}")
    return size


def _timestamp(text: str | None) -> float:
    if not text:
        raise ValueError("object without LastModified")
    value = datetime.datetime.fromisoformat(text.strip())
    return (value if value.tzinfo else value.replace(tzinfo=datetime.UTC)).timestamp()
