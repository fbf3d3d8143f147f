"""S3 and Ceph RGW through boto3: one shared client, our own retries, strict GET checks.

botocore's own retries are off (one attempt per call); ``call_with_retries``
retries what ``is_temp_failure`` calls transient, and ``map_error`` turns what
is left into the cachefs vocabulary with a message naming the operation and
``s3://bucket/key``. Credentials come only from boto3's standard chain (env,
profile, credentials file), never from arguments or URLs, and are never logged.

Requests: GETs as trio tasks (``http``), threaded GETs, listings, PUTs and parts
(``requests``), all signed by ``sigv4``; the rare calls through boto3 (see
``requests`` for which). GET answers are checked by ``answer`` because servers
differ (docs/design.md, measured facts); a ranged GET answered 200 that provably holds the
asked bytes is accepted, counted in ``cachefs_store_range_fallbacks_total``
and warned about once per kind per store.
"""

import base64
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import botocore.exceptions as bx
import trio
from botocore.config import Config

from cachefs.errors import (
    AccessDenied,
    BadResponse,
    ConfigError,
    NoSuchBucket,
    NoSuchKey,
    StoreError,
    Unreachable,
    VersionChanged,
)
from cachefs.metrics import Metrics
from cachefs.sched import held
from cachefs.store.base import Listing, ObjectInfo, ObjectStore
from cachefs.store.retry import RetryPolicy, call_with_retries, call_with_retries_async
from cachefs.store.s3.answer import BEHAVIOUR, BadAnswer, Want, etag_of, get_headers, verify, window
from cachefs.store.s3.http import AsyncGetter
from cachefs.store.s3.requests import Requests, lean_usable

log = logging.getLogger(__name__)

_TEMP_CODES = frozenset({"SlowDown", "RequestTimeout", "Throttling", "ThrottlingException", "InternalError",
                         "ServiceUnavailable", "TooManyRequests", "RequestLimitExceeded",
                         "BandwidthLimitExceeded", "500", "502", "503", "504"})
_TEMP_STATUS = frozenset({429, 500, 502, 503, 504})
_DENIED_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                           "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "Forbidden", "403"})
_MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "NoSuchUpload", "404"})
_CHANGED_CODES = frozenset({"PreconditionFailed", "412"})
_CREDENTIAL_ERRORS = (bx.NoCredentialsError, bx.PartialCredentialsError, bx.CredentialRetrievalError)
_TEMP_EXCEPTIONS = (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError, BadAnswer,
                    ConnectionError, TimeoutError)
_MAPPED = (bx.ClientError, bx.BotoCoreError, BadAnswer, ConnectionError, TimeoutError)
_TIMEOUTS = (TimeoutError, bx.ConnectTimeoutError, bx.ReadTimeoutError)
RESTART_WINDOW = 5.0      # seconds a refused or reset connection is retried (at most the read timeout)


@dataclass(frozen=True, slots=True)
class S3Options:
    endpoint_url: str | None = None   # None: AWS
    region: str | None = None
    profile: str | None = None
    max_connections: int = 64
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    max_attempts: int = 5
    lean_requests: bool = True             # GETs and listings as trio tasks (http) or requests, not botocore
    lean_put: bool = True             # PUTs and parts through requests, not botocore


# --- error classification and mapping ---------------------------------------------------------

def _code_and_status(exc: bx.ClientError) -> tuple[str, int]:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    return code, int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def is_temp_failure(exc: BaseException) -> bool:
    """True for errors worth retrying: connection trouble, timeouts, 5xx, throttling, short bodies."""
    if isinstance(exc, bx.ClientError):
        code, status = _code_and_status(exc)
        return code in _TEMP_CODES or status in _TEMP_STATUS
    return isinstance(exc, _TEMP_EXCEPTIONS)


def is_refusal(exc: BaseException) -> bool:
    """A refused, reset or cut connection (a server restarting), not a timeout: retried for the
    policy's window rather than a number of attempts."""
    return isinstance(exc, (ConnectionError, bx.ConnectionError, bx.ConnectionClosedError)) and \
        not isinstance(exc, _TIMEOUTS)


def retry_after(exc: BaseException) -> float | None:
    """The seconds a 503/429 answer's Retry-After asks to wait (the delta form only), else None."""
    if not isinstance(exc, bx.ClientError):
        return None
    value = exc.response.get("RetryAfter") or \
        exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("retry-after")
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 < seconds < float("inf") else None


def retry_policy(options: "S3Options") -> RetryPolicy:
    """Attempts for errors, a window bounded by the read timeout for a restarting server."""
    return RetryPolicy(is_temp_failure, options.max_attempts, window=min(RESTART_WINDOW, options.read_timeout),
                       is_refusal=is_refusal, retry_after=retry_after)


def map_error(exc: BaseException, *, op: str, url: str, missing: type[StoreError] = NoSuchKey) -> StoreError:
    """The cachefs error for a botocore failure of ``op`` on ``url`` (retries already spent)."""
    where = f"{op} {url}"
    if isinstance(exc, bx.ClientError):
        return _map_client_error(exc, where, missing)
    if isinstance(exc, _CREDENTIAL_ERRORS):
        return AccessDenied(f"{where}: no usable credentials ({type(exc).__name__})")
    if isinstance(exc, BadAnswer):
        return BadResponse(f"{where}: {exc}")
    if is_temp_failure(exc):
        return Unreachable(f"{where}: {type(exc).__name__}: {exc}")
    return StoreError(f"{where}: {type(exc).__name__}: {exc}")


def _map_client_error(exc: bx.ClientError, where: str, missing: type[StoreError]) -> StoreError:
    code, status = _code_and_status(exc)
    label = code or str(status)
    if code == "NoSuchBucket":
        return NoSuchBucket(f"{where}: no such bucket")
    if code in _DENIED_CODES or status == 403:
        return AccessDenied(f"{where}: access denied ({label})")
    if code in _CHANGED_CODES or status == 412:
        return VersionChanged(f"{where}: object changed since it was opened ({label})")
    if code in _MISSING_CODES or status == 404:
        return missing(f"{where}: not found ({label})")
    if is_temp_failure(exc):
        return Unreachable(f"{where}: server kept failing ({label})")
    return StoreError(f"{where}: {label}: {exc.response.get('Error', {}).get('Message', '')}")


# --- the client ---------------------------------------------------------------------------------

def make_session(options: S3Options) -> Any:
    try:
        return boto3.session.Session(profile_name=options.profile)
    except bx.ProfileNotFound as exc:
        raise ConfigError(f"AWS profile {options.profile!r} not found") from exc


def make_client(options: S3Options, session: Any = None) -> Any:
    """One thread-safe boto3 S3 client: path-style, big pool, no botocore retries."""
    if options.endpoint_url and "@" in options.endpoint_url:
        raise ConfigError("endpoint URL must not carry credentials")
    config = Config(s3={"addressing_style": "path"}, max_pool_connections=options.max_connections,
                    connect_timeout=options.connect_timeout, read_timeout=options.read_timeout,
                    retries={"total_max_attempts": 1, "mode": "standard"},
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required", tcp_keepalive=True)
    session = session or make_session(options)
    return session.client("s3", endpoint_url=options.endpoint_url, region_name=options.region, config=config)


def _requests(client: Any, session: Any, options: S3Options) -> Requests | None:
    """The threaded lean requests (see ``requests``), unless disabled or not usable here."""
    credentials = session.get_credentials() if options.lean_requests else None
    if not lean_usable(client.meta.endpoint_url, credentials):
        return None
    return Requests(client.meta.endpoint_url, client.meta.region_name or "us-east-1", credentials,
                    max_connections=options.max_connections, connect_timeout=options.connect_timeout,
                    read_timeout=options.read_timeout)


def _async_getter(client: Any, session: Any, options: S3Options) -> AsyncGetter | None:
    """GETs as trio tasks (see ``http``): the lean path, where the lean path is usable."""
    credentials = session.get_credentials() if options.lean_requests else None
    if not lean_usable(client.meta.endpoint_url, credentials):
        return None
    return AsyncGetter(client.meta.endpoint_url, client.meta.region_name or "us-east-1", credentials,
                       max_idle=options.max_connections, connect_timeout=options.connect_timeout,
                       read_timeout=options.read_timeout)


def _status_of(response: dict) -> str:
    return str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", "error"))


def _info(path: str, obj: dict) -> ObjectInfo:
    size = obj.get("Size", obj.get("ContentLength", 0))
    return ObjectInfo(path=path, size=size, mtime=obj["LastModified"].timestamp(), etag=etag_of(obj.get("ETag")))


# --- the store ----------------------------------------------------------------------------------

class S3Store(ObjectStore):
    """An S3 bucket (AWS, Ceph RGW, moto, ...) below an optional root prefix."""

    def __init__(self, bucket: str, prefix: str, *, metrics: Metrics, options: S3Options = S3Options()) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._root = f"{self.prefix}/" if self.prefix else ""
        self._metrics = metrics
        self._options = options
        self._retry = retry_policy(options)
        session = make_session(options)
        self._client = make_client(options, session)
        self._requests = _requests(self._client, session, options)
        self._async_getter = _async_getter(self._client, session, options)
        self._putter = self._requests if options.lean_put else None     # PUTs and parts
        self._fallbacks_warned: set[str] = set()
        self.identity = f"s3|{options.endpoint_url or 'aws'}|{bucket}|{self.prefix}"
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")

    @property
    def cancellable_gets(self) -> bool:
        return self._async_getter is not None

    def _url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _timed(self, op: str, request: Callable[[], tuple[dict, Any]]) -> tuple[dict, Any]:
        """Run one HTTP request (``request`` returns (response, payload)) and count it."""
        started, status = time.monotonic(), "error"
        try:
            response, payload = request()
            status = _status_of(response)
            return response, payload
        except bx.ClientError as exc:
            status = _status_of(exc.response)
            raise
        finally:
            self._count(op, status, started)

    def _count(self, op: str, status: str, started: float) -> None:
        self._metrics.store_requests.labels(op, status).inc()
        self._metrics.store_latency.labels(op).observe(time.monotonic() - started)

    def _call(self, op: str, key: str, attempt: Callable[[], Any], missing: type[StoreError] = NoSuchKey) -> Any:
        """``attempt()`` with retries; botocore errors left over become cachefs errors."""
        try:
            return call_with_retries(attempt, op=op, policy=self._retry, metrics=self._metrics)
        except _MAPPED as exc:
            raise map_error(exc, op=op, url=self._url(key), missing=missing) from exc

    def _simple(self, op: str, key: str, method: str, missing: type[StoreError] = NoSuchKey,
                **kwargs: Any) -> dict:
        """A retried, counted request whose whole answer is its response dict."""
        call = getattr(self._client, method)

        def request() -> tuple[dict, None]:
            return call(**kwargs), None
        return self._call(op, key, lambda: self._timed(op, request)[0], missing)

    # --- ObjectStore ---

    def check(self) -> None:
        self._simple("head_bucket", "", "head_bucket", NoSuchBucket, Bucket=self.bucket)
        if not self.prefix:
            return
        page = self._list_page(self._root, {"Bucket": self.bucket, "Prefix": self._root, "MaxKeys": 1},
                               NoSuchBucket)
        if not page.get("Contents") and not page.get("CommonPrefixes"):
            raise NoSuchKey(f"no objects under s3://{self.bucket}/{self.prefix}")

    def head(self, path: str) -> ObjectInfo:
        key = self._root + path
        response = self._simple("head", key, "head_object", Bucket=self.bucket, Key=key)
        return _info(path, response)

    def get(self, path: str, start: int, end: int, etag: str, size: int) -> bytes:
        key, want = self._want(path, start, end, etag, size)
        if start == end:
            return b""
        data = self._call("get", key, lambda: self._get_once(key, want))
        self._metrics.store_bytes.inc(len(data))
        return data

    async def get_async(self, path: str, start: int, end: int, etag: str, size: int, *,
                        limiter: trio.CapacityLimiter) -> bytes:
        """``get`` as a trio task (no worker thread) on the lean path; in a thread otherwise."""
        if self._async_getter is None:
            return await super().get_async(path, start, end, etag, size, limiter=limiter)
        key, want = self._want(path, start, end, etag, size)
        if start == end:
            return b""
        async with held(limiter):
            try:
                data = await call_with_retries_async(lambda: self._get_once_async(key, want), op="get",
                                                     policy=self._retry, metrics=self._metrics)
            except _MAPPED as exc:
                raise map_error(exc, op="get", url=want.url) from exc
        self._metrics.store_bytes.inc(len(data))
        return data

    def start_get(self, path: str, start: int, end: int, etag: str, size: int) -> None:
        """Send the GET now on an idle connection (``AsyncGetter.send_early``); ``get_async``
        of the same range reads its answer. Nothing when GETs go through threads."""
        if self._async_getter is None or start == end:
            return
        try:
            key, want = self._want(path, start, end, etag, size)
            headers = get_headers(want)
        except (ValueError, BadResponse):     # get_async raises it, at the caller that reports errors
            return
        self._async_getter.send_early(self.bucket, key, headers)

    def _want(self, path: str, start: int, end: int, etag: str, size: int) -> tuple[str, Want]:
        if not 0 <= start <= end <= size:
            raise ValueError(f"bad range [{start}, {end}) for an object of {size} bytes")
        key = self._root + path
        return key, Want(self._url(key), etag, start, end, size)

    def _get_once(self, key: str, want: Want) -> bytes:
        def request() -> tuple[dict, bytes]:
            headers = get_headers(want)
            if self._requests is not None:
                return self._requests.get(self.bucket, key, headers, functools.partial(window, want))
            return self._boto3_get(key, want, headers)
        response, body = self._timed("get", request)
        return self._verified(want, response, body)

    def _boto3_get(self, key: str, want: Want, headers: dict[str, str]) -> tuple[dict, bytes]:
        kwargs = {"Bucket": self.bucket, "Key": key}
        if "If-Match" in headers:
            kwargs["IfMatch"] = headers["If-Match"]
        if "Range" in headers:
            kwargs["Range"] = headers["Range"]
        response = self._client.get_object(**kwargs)
        status = response["ResponseMetadata"]["HTTPStatusCode"]
        cut = window(want, status, response.get("ContentLength"))
        response["Cut"] = cut is not None
        with response["Body"] as body:     # inside the attempt: a mid-body reset is retried
            if cut is None:
                return response, body.read()
            skip, take = cut
            while skip and (data := body.read(min(skip, 1 << 20))):
                skip -= len(data)
            return response, body.read(take) if not skip else b""

    def _verified(self, want: Want, response: dict, body: bytes) -> bytes:
        """The asked bytes of a GET answer (``answer.verify``); a 200 accepted for a ranged GET is
        counted and, the first time for its kind, logged."""
        data, kind = verify(want, response, body)
        if kind is not None:
            self._metrics.store_range_fallbacks.labels(kind).inc()
            if kind not in self._fallbacks_warned:
                self._fallbacks_warned.add(kind)
                log.warning("the S3 server at %s %s; accepted (it provably holds the asked bytes), counted in "
                            "cachefs_store_range_fallbacks_total", self._options.endpoint_url or "aws",
                            BEHAVIOUR[kind])
        return data

    async def _get_once_async(self, key: str, want: Want) -> bytes:
        headers = get_headers(want)
        # timed from when the request left, which start_get may have made earlier
        started, status = self._async_getter.sent_at(self.bucket, key, headers) or time.monotonic(), "error"
        try:
            response, body = await self._async_getter.get(self.bucket, key, headers, functools.partial(window, want))
            status = _status_of(response)
        except bx.ClientError as exc:
            status = _status_of(exc.response)
            raise
        except trio.Cancelled:
            status = "cancelled"          # a hedge that lost, or a reader gone
            raise
        finally:
            self._count("get", status, started)
        return self._verified(want, response, body)

    def list_dir(self, prefix: str) -> Listing:
        full = self._root + prefix
        listing, dirs = Listing(), {}
        for page in self._pages(full, delimiter=True):
            for obj in page.get("Contents", []):
                self._add_listed(listing, dirs, full, obj)
            for common in page.get("CommonPrefixes", []):
                _add_dir(dirs, common["Prefix"][len(full):])
        listing.dirs = list(dirs)
        return listing

    def _add_listed(self, listing: Listing, dirs: dict[str, None], full: str, obj: dict) -> None:
        rel = obj["Key"][len(full):]
        if "/" in rel:          # "name/" marks a sub-directory ("" is this directory's own marker)
            _add_dir(dirs, rel)
        elif rel not in ("", ".", ".."):
            listing.files.append(_info(obj["Key"][len(self._root):], obj))

    def list_tree(self, prefix: str, limit: int) -> Generator[tuple[str, Listing], None, bool]:
        # Keys come sorted, and the keys under one prefix are contiguous: a directory is complete
        # once a key outside it arrives. The open directories are the last key's ancestors.
        full = self._root + prefix
        open_dirs: dict[str, tuple[Listing, dict[str, None]]] = {}
        last, count = "", 0
        for page in self._pages(full, delimiter=False):
            for obj in page.get("Contents", []):
                key = obj["Key"]
                if key <= last:
                    raise BadResponse(f"list {self._url(full)}: keys out of order ({last!r} before {key!r})")
                last, count = key, count + 1
                chain, start = [prefix], len(full)
                while (at := key.find("/", start)) >= 0 and key[start:at] not in ("", ".", ".."):
                    chain.append(key[len(self._root):at + 1])      # a directory a lookup can reach
                    start = at + 1
                for done in [d for d in open_dirs if d not in chain]:
                    yield done, self._closed(open_dirs.pop(done))
                for d in chain:
                    listing, dirs = open_dirs.setdefault(d, (Listing(), {}))
                    self._add_listed(listing, dirs, self._root + d, obj)
                if count >= limit:
                    return True       # the directories still open are not known to be complete
        for done in list(open_dirs):
            yield done, self._closed(open_dirs.pop(done))
        return False

    @staticmethod
    def _closed(entry: tuple[Listing, dict[str, None]]) -> Listing:
        listing, dirs = entry
        listing.dirs = list(dirs)
        return listing

    def list_all(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for page in self._pages(self._root + prefix, delimiter=False):
            for obj in page.get("Contents", []):
                if not obj["Key"].endswith("/"):
                    yield _info(obj["Key"][len(self._root):], obj)

    def _pages(self, full: str, *, delimiter: bool) -> Iterator[dict]:
        """Every ListObjectsV2 page under ``full``; each page retried on its own."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
        if delimiter:
            kwargs["Delimiter"] = "/"
        while True:
            page = self._list_page(full, kwargs)
            yield page
            if not page.get("IsTruncated"):
                return
            if not page.get("NextContinuationToken"):
                raise BadResponse(f"list {self._url(full)}: truncated page without a continuation token")
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def _list_page(self, full: str, kwargs: dict[str, Any], missing: type[StoreError] = NoSuchKey) -> dict:
        """One retried, counted ListObjectsV2 page: lean (``requests.list_page``) or boto3."""
        if self._requests is None:
            return self._simple("list", full, "list_objects_v2", missing, **kwargs)
        params = {"prefix": kwargs["Prefix"]}
        if "Delimiter" in kwargs:
            params["delimiter"] = kwargs["Delimiter"]
        if "ContinuationToken" in kwargs:
            params["continuation-token"] = kwargs["ContinuationToken"]
        if "MaxKeys" in kwargs:
            params["max-keys"] = str(kwargs["MaxKeys"])

        def request() -> tuple[dict, None]:
            return self._requests.list_page(self.bucket, params), None
        return self._call("list", full, lambda: self._timed("list", request)[0], missing)

    # --- writes ---

    def _lean(self, op: str, key: str, send: Callable[[], dict]) -> dict:
        """A retried, counted request through the lean PUT path."""
        return self._call(op, key, lambda: self._timed(op, lambda: (send(), None))[0])

    def put(self, path: str, data: bytes) -> ObjectInfo:
        key = self._root + path
        if self._putter is not None:     # a signed SHA-256 of the body: the server checks it
            response = self._lean("put", key, lambda: self._putter.put(self.bucket, key, data))
        else:
            response = self._simple("put", key, "put_object", Bucket=self.bucket, Key=key, Body=data,
                                    ContentMD5=_md5(data))
        return ObjectInfo(path=path, size=len(data), mtime=time.time(), etag=etag_of(response.get("ETag")))

    def start_upload(self, path: str) -> str:
        key = self._root + path
        return self._simple("start_upload", key, "create_multipart_upload", Bucket=self.bucket,
                            Key=key)["UploadId"]

    def upload_part(self, path: str, upload_id: str, number: int, data: bytes) -> str:
        key = self._root + path
        if self._putter is not None:
            response = self._lean("upload_part", key,
                                  lambda: self._putter.upload_part(self.bucket, key, upload_id, number, data))
        else:
            response = self._simple("upload_part", key, "upload_part", Bucket=self.bucket, Key=key,
                                    UploadId=upload_id, PartNumber=number, Body=data, ContentMD5=_md5(data))
        if not response.get("ETag"):
            raise BadResponse(f"upload_part {self._url(key)}: part {number} answered without an ETag")
        return etag_of(response.get("ETag"))

    def finish_upload(self, path: str, upload_id: str, parts: list[tuple[int, str]], size: int) -> ObjectInfo:
        key = self._root + path
        layout = {"Parts": [{"PartNumber": n, "ETag": f'"{etag}"'} for n, etag in parts]}
        try:
            self._simple("finish_upload", key, "complete_multipart_upload", Bucket=self.bucket, Key=key,
                         UploadId=upload_id, MultipartUpload=layout)
        except NoSuchKey:
            pass   # NoSuchUpload after a retried completion whose first answer was lost: HEAD decides
        info = self.head(path)   # Ceph RGW answers the completion with an empty ETag (docs/design.md, measured facts)
        if info.size != size:
            raise BadResponse(f"finish_upload {self._url(key)}: object has {info.size} bytes, uploaded {size}")
        return info

    def abort_upload(self, path: str, upload_id: str) -> None:
        key = self._root + path
        try:
            self._simple("abort_upload", key, "abort_multipart_upload", Bucket=self.bucket, Key=key,
                         UploadId=upload_id)
        except NoSuchKey:
            pass   # NoSuchUpload: already gone

    def delete(self, path: str) -> None:
        key = self._root + path
        with contextlib.suppress(NoSuchKey):
            self._simple("delete", key, "delete_object", Bucket=self.bucket, Key=key)

    def copy(self, src: str, dst: str) -> ObjectInfo:
        key = self._root + dst
        source = {"Bucket": self.bucket, "Key": self._root + src}
        self._simple("copy", key, "copy_object", Bucket=self.bucket, Key=key, CopySource=source)
        return self.head(dst)

    def make_dir(self, path: str) -> None:
        key = f"{self._root}{path}/"
        self._simple("put", key, "put_object", Bucket=self.bucket, Key=key, Body=b"")

    def remove_dir(self, path: str) -> None:
        self.delete(path + "/")

    def close(self) -> None:
        if self._async_getter is not None:
            self._async_getter.close()
        self._client.close()


def _md5(data: bytes) -> str:
    """Content-MD5: the server rejects a body damaged in transit."""
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def _add_dir(dirs: dict[str, None], rel: str) -> None:
    """Record the sub-directory named by the first component of ``rel`` ("name/..." -> "name")."""
    name = rel.split("/", 1)[0]
    if name not in ("", ".", ".."):
        dirs[name] = None
