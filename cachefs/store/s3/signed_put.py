"""Object PUTs and UploadParts without botocore's request and response machinery.

A 1 GiB checkpoint is 64 parts of 16 MiB: botocore's per-request overhead matters less than
what it does to the body. Through the client, a part was hashed twice: Content-MD5 (~0.5 GB/s
on one core) and the SigV4 payload SHA-256 (over plain HTTP). Here the body is hashed once
with SHA-256 (~1.7 GB/s with SHA-NI; hashlib releases the GIL) and the digest is signed as
``x-amz-content-sha256`` over HTTP and HTTPS alike: the server recomputes it and refuses a
body damaged in transit (``XAmzContentSHA256Mismatch``), which is what Content-MD5 was for.

The request is signed with botocore's own SigV4 signer and sent with urllib3, as in
``signed_get``; answers come back in botocore's shapes (a response dict with ``ETag`` and
``ResponseMetadata.HTTPStatusCode``; ``ClientError`` for an error status), so the store's
retries, error mapping and metrics apply unchanged. CreateMultipartUpload,
CompleteMultipartUpload and everything else stay on the boto3 client.
"""

import hashlib
from typing import Any
from urllib.parse import quote

import urllib3
from botocore import exceptions as bx
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest

from cachefs.store.s3.signed_get import SignedGetter, error_of


class _PresignedPayload(S3SigV4Auth):
    """SigV4 with a payload digest computed by the caller (never UNSIGNED-PAYLOAD)."""

    def __init__(self, credentials: Any, region: str, digest: str) -> None:
        super().__init__(credentials, "s3", region)
        self._digest = digest

    def payload(self, request: AWSRequest) -> str:
        return self._digest


class SignedPutter(SignedGetter):
    """Path-style signed PUTs (whole objects and parts) on one endpoint, one urllib3 pool."""

    def put(self, bucket: str, key: str, body: bytes, query: dict[str, str] | None = None,
            operation: str = "PutObject") -> dict:
        """The response dict of one PUT of ``body``; ClientError for an HTTP error status."""
        url = self.url(bucket, key)
        if query:
            url += "?" + "&".join(f"{name}={quote(value, safe='~')}" for name, value in query.items())
        request = AWSRequest(method="PUT", url=url, headers={"Content-Length": str(len(body))})
        digest = hashlib.sha256(body).hexdigest()
        _PresignedPayload(self._credentials.get_frozen_credentials(), self._region, digest).add_auth(request)
        try:
            answer = self._pool.urlopen("PUT", url, body=body, headers=dict(request.headers.items()),
                                        preload_content=True, redirect=False)
        except urllib3.exceptions.TimeoutError as exc:
            raise TimeoutError(f"PUT {url}: {exc}") from None
        except urllib3.exceptions.HTTPError as exc:
            raise ConnectionError(f"PUT {url}: {type(exc).__name__}: {exc}") from None
        response = {"ETag": answer.headers.get("ETag"), "ResponseMetadata": {"HTTPStatusCode": answer.status}}
        if answer.status >= 300:
            raise bx.ClientError({"Error": error_of(answer.status, answer.data), **response}, operation)
        return response

    def upload_part(self, bucket: str, key: str, upload_id: str, number: int, body: bytes) -> dict:
        return self.put(bucket, key, body, {"partNumber": str(number), "uploadId": upload_id}, "UploadPart")
