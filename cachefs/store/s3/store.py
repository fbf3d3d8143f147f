"""S3 and Ceph RGW: one transport of our own, our own retries, strict GET checks.

Every request is built, signed (``sigv4``) and read by cachefs: GETs as trio tasks (``http``),
everything else, and GETs under ``--no-lean-requests`` or behind a proxy, from worker threads
(``requests``); answers come back as ``answer.Reply`` and ``answer.S3Error``. botocore is used
for one thing: its standard credentials chain (environment, profile, credentials file, web
identity, instance metadata) and the refresh of what it finds. Credentials never come from
arguments or URLs and are never logged.

``call_with_retries`` retries what ``is_temp_failure`` calls transient, and ``map_error`` turns
what is left into the cachefs vocabulary with a message naming the operation and
``s3://bucket/key``. GET answers are checked by ``answer`` because servers differ
(docs/design.md, measured facts); a ranged GET answered 200 that provably holds the asked bytes is
accepted, counted in ``cachefs_store_range_fallbacks_total`` and warned about once per kind per
store.
"""

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import botocore.exceptions as bx
import trio

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
from cachefs.store.metrics import StoreMetrics
from cachefs.store.retry import RetryPolicy, call_with_retries, call_with_retries_async
from cachefs.store.s3.answer import (
    BEHAVIOUR,
    BadAnswer,
    Reply,
    S3Error,
    Want,
    etag_of,
    get_headers,
    http_date,
    verify,
    window,
)
from cachefs.store.s3.http import AsyncGetter
from cachefs.store.s3.requests import Listed, Page, Requests
from cachefs.store.s3.sigv4 import NoCredentials

log = logging.getLogger(__name__)

_TEMP_CODES = frozenset({"SlowDown", "RequestTimeout", "Throttling", "ThrottlingException", "InternalError",
                         "ServiceUnavailable", "TooManyRequests", "RequestLimitExceeded",
                         "BandwidthLimitExceeded", "500", "502", "503", "504"})
_TEMP_STATUS = frozenset({429, 500, 502, 503, 504})
_DENIED_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                           "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "Forbidden", "403"})
_MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "NoSuchUpload", "404"})
_CHANGED_CODES = frozenset({"PreconditionFailed", "412"})
# answers to a request signed for the wrong region (x-amz-bucket-region names the right one)
_REGION_CODES = frozenset({"AuthorizationHeaderMalformed", "PermanentRedirect", "301", "400"})
# what botocore's credentials chain may raise when it looks for or refreshes credentials
_CREDENTIAL_ERRORS = (NoCredentials, bx.NoCredentialsError, bx.PartialCredentialsError,
                      bx.CredentialRetrievalError)
_TEMP_EXCEPTIONS = (BadAnswer, ConnectionError, TimeoutError)
_MAPPED = (S3Error, BadAnswer, ConnectionError, TimeoutError, *_CREDENTIAL_ERRORS)
_DELETE_BATCH = 1000     # keys per DeleteObjects request (the S3 limit)
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
    lean_requests: bool = True        # GETs as trio tasks (http); False: from worker threads (requests)


# --- error classification and mapping ---------------------------------------------------------

def is_temp_failure(exc: BaseException) -> bool:
    """True for errors worth retrying: connection trouble, timeouts, 5xx, throttling, short bodies."""
    if isinstance(exc, S3Error):
        return exc.code in _TEMP_CODES or exc.status in _TEMP_STATUS
    return isinstance(exc, _TEMP_EXCEPTIONS)


def is_refusal(exc: BaseException) -> bool:
    """A refused, reset or cut connection (a server restarting), not a timeout: retried for the
    policy's window rather than a number of attempts."""
    return isinstance(exc, ConnectionError) and not isinstance(exc, TimeoutError)


def retry_after(exc: BaseException) -> float | None:
    """The seconds a 503/429 answer's Retry-After asks to wait (the delta form only), else None."""
    if not isinstance(exc, S3Error):
        return None
    value = exc.retry_after
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
    """The cachefs error for a failure of ``op`` on ``url`` (retries already spent)."""
    where = f"{op} {url}"
    if isinstance(exc, S3Error):
        return _map_s3_error(exc, where, missing)
    if isinstance(exc, _CREDENTIAL_ERRORS):
        return AccessDenied(f"{where}: no usable credentials ({type(exc).__name__}: {exc})")
    if isinstance(exc, BadAnswer):
        return BadResponse(f"{where}: {exc}")
    if is_temp_failure(exc):
        return Unreachable(f"{where}: {type(exc).__name__}: {exc}")
    return StoreError(f"{where}: {type(exc).__name__}: {exc}")


def _map_s3_error(exc: S3Error, where: str, missing: type[StoreError]) -> StoreError:
    code, status = exc.code, exc.status
    label = code or str(status)
    if exc.region and code in _REGION_CODES:
        return AccessDenied(f"{where}: the bucket is in region {exc.region}, not the one requests were "
                           f"signed for; pass --region {exc.region} ({label})")
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
    return StoreError(f"{where}: {label}: {exc.message}")


# --- the client ---------------------------------------------------------------------------------

def make_session(options: S3Options) -> Any:
    """The botocore session whose credentials chain (and region setting) the store uses."""
    try:
        return boto3.session.Session(profile_name=options.profile)
    except bx.ProfileNotFound as exc:
        raise ConfigError(f"AWS profile {options.profile!r} not found") from exc


def aws_endpoint(region: str) -> str:
    """The AWS S3 endpoint of ``region`` (path-style requests)."""
    return f"https://s3.{region}.amazonaws.com"


def endpoint_of(options: S3Options, region: str) -> str:
    """The endpoint requests go to: the option, else ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``
    as botocore reads them, else AWS in ``region``. ConfigError for one carrying credentials."""
    endpoint = options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or \
        os.environ.get("AWS_ENDPOINT_URL") or aws_endpoint(region)
    if "@" in endpoint:
        raise ConfigError("endpoint URL must not carry credentials")
    return endpoint


def _info(path: str, obj: Listed) -> ObjectInfo:
    return ObjectInfo(path=path, size=obj.size, mtime=obj.mtime, etag=obj.etag)


# --- the store ----------------------------------------------------------------------------------

class S3Store(ObjectStore):
    """An S3 bucket (AWS, Ceph RGW, moto, ...) below an optional root prefix.

    ``credentials`` (a botocore credentials object) stands in for the standard chain: the CSI
    controller passes what a request's secrets hold."""

    def __init__(self, bucket: str, prefix: str, *, metrics: Metrics, options: S3Options = S3Options(),
                 credentials: Any = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._root = f"{self.prefix}/" if self.prefix else ""
        self._metrics = metrics
        self._m = metrics.group(StoreMetrics)
        self._options = options
        self._retry = retry_policy(options)
        session = make_session(options) if credentials is None or options.region is None else None
        region = options.region or (session.region_name if session is not None else None) or "us-east-1"
        endpoint = endpoint_of(options, region)
        if credentials is None:
            credentials = session.get_credentials()
        self._requests = Requests(endpoint, region, credentials, max_connections=options.max_connections,
                                  connect_timeout=options.connect_timeout, read_timeout=options.read_timeout)
        self._async_getter = None
        if options.lean_requests and self._requests.proxy is None:
            self._async_getter = AsyncGetter(endpoint, region, credentials, max_idle=options.max_connections,
                                             connect_timeout=options.connect_timeout,
                                             read_timeout=options.read_timeout)
        self._fallbacks_warned: set[str] = set()
        self.endpoint = endpoint
        # what the cache's keys and the listing snapshot belong to: AWS's default endpoint stays "aws"
        named = endpoint if endpoint != aws_endpoint(region) else options.endpoint_url or "aws"
        self.identity = f"s3|{named}|{bucket}|{self.prefix}"
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")

    @property
    def cancellable_gets(self) -> bool:
        return self._async_getter is not None

    def _url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _timed(self, op: str, request: Callable[[], Any]) -> Any:
        """Run one HTTP request (``request`` returns a Reply, or a tuple that starts with one) and
        count it by the status it was answered with."""
        started, status = time.monotonic(), "error"
        try:
            result = request()
            status = str((result[0] if isinstance(result, tuple) else result).status)
            return result
        except S3Error as exc:
            status = str(exc.status)
            raise
        finally:
            self._count(op, status, started)

    def _count(self, op: str, status: str, started: float) -> None:
        self._m.store_requests.labels(op, status).inc()
        self._m.store_latency.labels(op).observe(time.monotonic() - started)

    def _call(self, op: str, key: str, attempt: Callable[[], Any], missing: type[StoreError] = NoSuchKey) -> Any:
        """``attempt()`` with retries; errors left over become cachefs errors."""
        try:
            return call_with_retries(attempt, op=op, policy=self._retry, metrics=self._metrics)
        except _MAPPED as exc:
            raise map_error(exc, op=op, url=self._url(key), missing=missing) from exc

    def _send(self, op: str, key: str, request: Callable[[], Any], missing: type[StoreError] = NoSuchKey) -> Any:
        """One request, counted, with retries: what ``request()`` returns."""
        return self._call(op, key, lambda: self._timed(op, request), missing)

    # --- ObjectStore ---

    def check(self) -> None:
        self._send("head_bucket", "", lambda: self._requests.head_bucket(self.bucket), NoSuchBucket)
        if not self.prefix:
            return
        page = self._list_page(self._root, {"prefix": self._root, "max-keys": "1"}, NoSuchBucket)
        if not page.objects and not page.prefixes:
            raise NoSuchKey(f"no objects under s3://{self.bucket}/{self.prefix}")

    def head(self, path: str) -> ObjectInfo:
        key = self._root + path
        reply = self._send("head", key, lambda: self._requests.head(self.bucket, key))
        try:
            mtime = http_date(reply.last_modified)
        except BadAnswer as exc:
            raise BadResponse(f"head {self._url(key)}: {exc}") from None
        if reply.content_length is None:
            raise BadResponse(f"head {self._url(key)}: answer without a Content-Length")
        return ObjectInfo(path=path, size=reply.content_length, mtime=mtime, etag=etag_of(reply.etag))

    def get(self, path: str, start: int, end: int, etag: str, size: int) -> bytes:
        key, want = self._want(path, start, end, etag, size)
        if start == end:
            return b""
        data = self._call("get", key, lambda: self._get_once(key, want))
        self._m.store_bytes.inc(len(data))
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
        self._m.store_bytes.inc(len(data))
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
        headers = get_headers(want)
        reply, body = self._timed("get", lambda: self._requests.get(self.bucket, key, headers,
                                                                     functools.partial(window, want)))
        return self._verified(want, reply, body)

    def _verified(self, want: Want, reply: Reply, body: bytes) -> bytes:
        """The asked bytes of a GET answer (``answer.verify``); a 200 accepted for a ranged GET is
        counted and, the first time for its kind, logged."""
        data, kind = verify(want, reply, body)
        if kind is not None:
            self._m.store_range_fallbacks.labels(kind).inc()
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
            reply, body = await self._async_getter.get(self.bucket, key, headers, functools.partial(window, want))
            status = str(reply.status)
        except S3Error as exc:
            status = str(exc.status)
            raise
        except trio.Cancelled:
            status = "cancelled"          # a hedge that lost, or a reader gone
            raise
        finally:
            self._count("get", status, started)
        return self._verified(want, reply, body)

    def list_dir(self, prefix: str) -> Listing:
        full = self._root + prefix
        listing, dirs = Listing(), {}
        for page in self._pages(full, delimiter=True):
            for obj in page.objects:
                self._add_listed(listing, dirs, full, obj)
            for common in page.prefixes:
                _add_dir(dirs, common[len(full):])
        listing.dirs = list(dirs)
        return listing

    def _add_listed(self, listing: Listing, dirs: dict[str, None], full: str, obj: Listed) -> None:
        rel = obj.key[len(full):]
        if "/" in rel:          # "name/" marks a sub-directory ("" is this directory's own marker)
            _add_dir(dirs, rel)
        elif rel not in ("", ".", ".."):
            listing.files.append(_info(obj.key[len(self._root):], obj))

    def list_tree(self, prefix: str, limit: int) -> Generator[tuple[str, Listing], None, bool]:
        # Keys come sorted, and the keys under one prefix are contiguous: a directory is complete
        # once a key outside it arrives. The open directories are the last key's ancestors.
        full = self._root + prefix
        open_dirs: dict[str, tuple[Listing, dict[str, None]]] = {}
        last, count = "", 0
        for page in self._pages(full, delimiter=False):
            for obj in page.objects:
                key = obj.key
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
            for obj in page.objects:
                if not obj.key.endswith("/"):
                    yield _info(obj.key[len(self._root):], obj)

    def _pages(self, full: str, *, delimiter: bool) -> Iterator[Page]:
        """Every ListObjectsV2 page under ``full``; each page retried on its own."""
        params = {"prefix": full}
        if delimiter:
            params["delimiter"] = "/"
        while True:
            page = self._list_page(full, params)
            yield page
            if not page.truncated:
                return
            if not page.token:
                raise BadResponse(f"list {self._url(full)}: truncated page without a continuation token")
            params["continuation-token"] = page.token

    def _list_page(self, full: str, params: dict[str, str], missing: type[StoreError] = NoSuchKey) -> Page:
        """One retried, counted ListObjectsV2 page."""
        return self._send("list", full, lambda: self._requests.list_page(self.bucket, params), missing)[1]

    # --- writes ---

    def put(self, path: str, data: bytes) -> ObjectInfo:
        key = self._root + path     # the body is signed by its SHA-256: the server checks it
        reply = self._send("put", key, lambda: self._requests.put(self.bucket, key, data))
        return ObjectInfo(path=path, size=len(data), mtime=time.time(), etag=etag_of(reply.etag))

    def start_upload(self, path: str) -> str:
        key = self._root + path
        return self._send("start_upload", key, lambda: self._requests.start_upload(self.bucket, key))[1]

    def upload_part(self, path: str, upload_id: str, number: int, data: bytes) -> str:
        key = self._root + path
        reply = self._send("upload_part", key,
                           lambda: self._requests.upload_part(self.bucket, key, upload_id, number, data))
        if not reply.etag:
            raise BadResponse(f"upload_part {self._url(key)}: part {number} answered without an ETag")
        return etag_of(reply.etag)

    def finish_upload(self, path: str, upload_id: str, parts: list[tuple[int, str]], size: int) -> ObjectInfo:
        key = self._root + path
        try:
            self._send("finish_upload", key,
                       lambda: self._requests.finish_upload(self.bucket, key, upload_id, parts))
        except NoSuchKey:
            pass   # NoSuchUpload after a retried completion whose first answer was lost: HEAD decides
        info = self.head(path)   # Ceph RGW answers the completion with an empty ETag (docs/design.md, measured facts)
        if info.size != size:
            raise BadResponse(f"finish_upload {self._url(key)}: object has {info.size} bytes, uploaded {size}")
        return info

    def abort_upload(self, path: str, upload_id: str) -> None:
        key = self._root + path
        with contextlib.suppress(NoSuchKey):     # NoSuchUpload: already gone
            self._send("abort_upload", key, lambda: self._requests.abort_upload(self.bucket, key, upload_id))

    def delete(self, path: str) -> None:
        key = self._root + path
        with contextlib.suppress(NoSuchKey):
            self._send("delete", key, lambda: self._requests.delete(self.bucket, key))

    def delete_many(self, paths: list[str]) -> None:
        """Delete ``paths`` with DeleteObjects, 1,000 a request; what is gone already is fine. The
        first key the server refuses raises, as ``delete`` would."""
        for at in range(0, len(paths), _DELETE_BATCH):
            keys = [self._root + path for path in paths[at:at + _DELETE_BATCH]]
            _, failed = self._send("delete", keys[0], lambda keys=keys: self._requests.delete_many(self.bucket, keys))
            for key, code in failed:
                if code not in _MISSING_CODES:
                    raise map_error(S3Error("DeleteObjects", 200, code), op="delete", url=self._url(key))

    def copy(self, src: str, dst: str) -> ObjectInfo:
        key = self._root + dst
        self._send("copy", key, lambda: self._requests.copy(self.bucket, self._root + src, key))
        return self.head(dst)

    def make_dir(self, path: str) -> None:
        key = f"{self._root}{path}/"
        self._send("put", key, lambda: self._requests.put(self.bucket, key, b""))

    def remove_dir(self, path: str) -> None:
        self.delete(path + "/")

    def close(self) -> None:
        if self._async_getter is not None:
            self._async_getter.close()
        self._requests.close()


def _add_dir(dirs: dict[str, None], rel: str) -> None:
    """Record the sub-directory named by the first component of ``rel`` ("name/..." -> "name")."""
    name = rel.split("/", 1)[0]
    if name not in ("", ".", ".."):
        dirs[name] = None
