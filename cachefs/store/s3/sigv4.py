"""AWS Signature Version 4 for bodiless S3 requests (GET), with the signing key kept for the day.

botocore's signer derives the signing key (four HMACs) and rebuilds its header tables for every
request: ~15% of the daemon's CPU during a warmup. This signer computes the same signature
(``tests/test_sigv4.py`` checks it against botocore's, header by header) from the same
credentials object, so rotation and refresh behave as in boto3, and derives the key once per
(secret, day, region). Only what a GET needs: no query string, an empty payload, path-style
URLs whose path is already percent-encoded as S3 wants it (encoded once, "/" kept).
"""

import hashlib
import hmac
import time

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
ALGORITHM = "AWS4-HMAC-SHA256"


class Signer:
    def __init__(self, credentials, region: str, service: str = "s3") -> None:
        self._credentials = credentials
        self._region = region
        self._service = service
        self._key_for: tuple[str, str] | None = None     # (secret, date) the cached key belongs to
        self._key = b""

    def headers(self, method: str, host: str, path: str, headers: dict[str, str],
                now: float | None = None) -> dict[str, str]:
        """``headers`` plus Host, X-Amz-Date, X-Amz-Content-SHA256, the session token if any, and
        Authorization: everything to send for a bodiless request of ``path`` on ``host``."""
        creds = self._credentials.get_frozen_credentials()
        amz_date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        out = {"Host": host, **headers, "X-Amz-Date": amz_date, "X-Amz-Content-SHA256": EMPTY_SHA256}
        if creds.token:
            out["X-Amz-Security-Token"] = creds.token
        canonical = sorted((name.lower(), " ".join(str(value).split())) for name, value in out.items())
        signed = ";".join(name for name, _ in canonical)
        request = "\n".join([method, path, "", *(f"{name}:{value}" for name, value in canonical), "",
                             signed, EMPTY_SHA256])
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
