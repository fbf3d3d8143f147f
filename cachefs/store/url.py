"""Store URLs: ``scheme://bucket/prefix``, parsed and checked in one place."""

import re
from dataclasses import dataclass

import fsspec

from cachefs.errors import ConfigError


@dataclass(frozen=True, slots=True)
class StoreURL:
    """A parsed store URL. For ``s3://`` ``bucket`` is the bucket; for other
    schemes it is the URL's host part (often "" as in ``file:///data``).
    ``prefix`` is the mount root inside it: no leading or trailing "/"."""

    scheme: str
    bucket: str
    prefix: str

    def __str__(self) -> str:
        tail = f"/{self.prefix}" if self.prefix else ""
        return f"{self.scheme}://{self.bucket}{tail}"


_SCHEME_RE = re.compile(r"^[a-z][a-z0-9+.-]*$")
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SIGNED_RE = re.compile(r"(?i)[?&](x-amz-(credential|signature|security-token)|awsaccesskeyid|signature)=")


def parse_url(url: str) -> StoreURL:
    """Split ``scheme://bucket/prefix``; raise ConfigError (one line) if malformed."""
    scheme, sep, rest = url.partition("://")
    if not sep or not _SCHEME_RE.match(scheme.lower()):
        shown = "(not shown: it may carry credentials)" if "@" in url else repr(url)
        raise ConfigError(f"not a store URL (expected scheme://bucket/prefix): {shown}")
    netloc, _, path = rest.partition("/")
    if "@" in netloc or _SIGNED_RE.search(rest):
        raise ConfigError(f"{scheme}:// URL must not carry credentials; use the environment or a credentials file")
    parsed = StoreURL(scheme.lower(), netloc, path.strip("/"))
    _check_parsed(parsed, url)
    return parsed


def _check_parsed(parsed: StoreURL, url: str) -> None:
    if parsed.scheme == "s3" and not _BUCKET_RE.match(parsed.bucket):
        raise ConfigError(f"s3 URL needs a bucket name (s3://bucket/prefix): {url!r}")
    if not parsed.bucket and not parsed.prefix:
        raise ConfigError(f"store URL names no location: {url!r}")
    if parsed.scheme != "s3" and parsed.scheme not in fsspec.available_protocols():
        raise ConfigError(f"unknown store URL scheme {parsed.scheme!r}: {url!r}")
    if any(part in (".", "..") for part in parsed.prefix.split("/")):
        raise ConfigError(f"store URL prefix must not contain '.' or '..': {url!r}")
