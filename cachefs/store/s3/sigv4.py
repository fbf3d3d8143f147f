"""AWS Signature Version 4 for S3, the one signer of every request cachefs sends, with the signing
key kept for the day; and the one check of every header value we send. botocore only supplies
the credentials object (its standard chain and refresh).

botocore's signer derives the signing key (four HMACs) and rebuilds its header tables for every
request: ~15% of the daemon's CPU during a warmup. This signer computes the same signature
(``tests/store/test_sigv4.py`` checks it against botocore's for GET, PUT, ListObjectsV2 and UploadPart,
with query strings, session tokens and odd keys) from the same credentials object, so rotation and
refresh behave as in boto3, and derives the key once per (secret, day, region).

Path-style URLs only. The path is percent-encoded once as S3 wants it (``object_path``; "/" kept,
never encoded twice) and the query string is built by ``query_string``, which is both what goes on
the wire and the canonical query the signature covers. A body is signed by its SHA-256 (the caller
hashes it once; the server recomputes it), never ``UNSIGNED-PAYLOAD``.

``check_headers`` refuses a header value holding CR, LF or another control character (an ETag
read from a listing is written back as ``If-Match``): a ``BadResponse`` before anything is sent.
"""

import hashlib
import hmac
import re
import time
from urllib.parse import quote

from cachefs.errors import BadResponse

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
ALGORITHM = "AWS4-HMAC-SHA256"
# Field values: visible ASCII, space, tab and obs-text (RFC 9110 5.5); no CR, LF, NUL or DEL.
_BAD_VALUE = re.compile(r"[^\t\x20-\x7e\x80-\xff]")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def object_path(bucket: str, key: str) -> str:
    """The path-style request path of an object, percent-encoded once as S3 signs it ("/" kept)."""
    return f"/{bucket}/{quote(key, safe='/~')}"


def query_string(params: dict[str, str] | None) -> str:
    """``params`` as a SigV4 canonical query string (sorted, every byte but ``-_.~`` encoded):
    the same string is sent, so what is signed is what the server sees."""
    if not params:
        return ""
    pairs = sorted((quote(name, safe="-_.~"), quote(value, safe="-_.~")) for name, value in params.items())
    return "&".join(f"{name}={value}" for name, value in pairs)


def check_headers(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` unchanged, or BadResponse if a name is not an HTTP token or a value holds a
    control character (CR and LF above all: they would end the header and inject another)."""
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name):
            raise BadResponse(f"refusing to send a header named {name[:40]!r}")
        if _BAD_VALUE.search(str(value)):
            raise BadResponse(f"refusing to send header {name} with a control character: {str(value)[:60]!r}")
    return headers


class NoCredentials(Exception):
    """No credentials were found by the standard chain (environment, profile, credentials file,
    web identity, instance metadata): nothing is sent unsigned."""


class Signer:
    def __init__(self, credentials, region: str, service: str = "s3") -> None:
        self._credentials = credentials
        self._region = region
        self._service = service
        self._key_for: tuple[str, str] | None = None     # (secret, date) the cached key belongs to
        self._key = b""

    def headers(self, method: str, host: str, path: str, headers: dict[str, str], now: float | None = None, *,
                query: str = "", payload_sha256: str = EMPTY_SHA256) -> dict[str, str]:
        """``headers`` plus Host, X-Amz-Date, X-Amz-Content-SHA256, the session token if any, and
        Authorization: everything to send for ``method`` on ``path?query`` (``query`` from
        ``query_string``) with a body whose SHA-256 is ``payload_sha256`` (none by default)."""
        if self._credentials is None:
            raise NoCredentials("no credentials found (environment, AWS profile, credentials file, web "
                                "identity or instance metadata)")
        creds = self._credentials.get_frozen_credentials()
        amz_date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        out = {"Host": host, **headers, "X-Amz-Date": amz_date, "X-Amz-Content-SHA256": payload_sha256}
        if creds.token:
            out["X-Amz-Security-Token"] = creds.token
        check_headers(out)
        canonical = sorted((name.lower(), " ".join(str(value).split())) for name, value in out.items())
        signed = ";".join(name for name, _ in canonical)
        request = "\n".join([method, path, query, *(f"{name}:{value}" for name, value in canonical), "",
                             signed, payload_sha256])
        scope = f"{amz_date[:8]}/{self._region}/{self._service}/aws4_request"
        to_sign = f"{ALGORITHM}\n{amz_date}\n{scope}\n{hashlib.sha256(request.encode()).hexdigest()}"
        signature = hmac.new(self._signing_key(creds.secret_key, amz_date[:8]), to_sign.encode(),
                             hashlib.sha256).hexdigest()
        out["Authorization"] = (f"{ALGORITHM} Credential={creds.access_key}/{scope}, SignedHeaders={signed}, "
                                f"Signature={signature}")
        return out

    def _signing_key(self, secret: str, date: str) -> bytes:
        if self._key_for != (secret, date):
            key = f"AWS4{secret}".encode()
            for part in (date, self._region, self._service, "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            self._key, self._key_for = key, (secret, date)
        return self._key
