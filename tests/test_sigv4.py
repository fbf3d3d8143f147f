"""cachefs.store.s3.sigv4 signs exactly as botocore does (the reference), and reuses its signing key."""

import time

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from cachefs.store.s3.sigv4 import Signer

NOW = 1_795_000_000.0      # a fixed instant: 2026-11-18


def botocore_signature(creds: Credentials, region: str, url: str, headers: dict[str, str]) -> str:
    """botocore's Authorization header for a GET of ``url`` with ``headers`` (the X-Amz-* ones
    ours sent, Authorization excluded) at the X-Amz-Date ours used."""
    sent = {k: v for k, v in headers.items() if k not in ("Authorization", "X-Amz-Date", "X-Amz-Content-SHA256")}
    request = AWSRequest(method="GET", url=url, headers=sent)
    auth = S3SigV4Auth(creds, "s3", region)
    request.context["timestamp"] = headers["X-Amz-Date"]
    request.context["payload_signing_enabled"] = True
    auth._modify_request_before_signing(request)
    assert request.headers["X-Amz-Content-SHA256"] == headers["X-Amz-Content-SHA256"]
    canonical = auth.canonical_request(request)
    signature = auth.signature(auth.string_to_sign(request, canonical), request)
    auth._inject_signature_to_request(request, signature)
    return request.headers["Authorization"]


@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzEJr//////////token+with/odd=chars"])
@pytest.mark.parametrize("host,path,headers", [
    ("127.0.0.1:9000", "/bucket/train/class-001/img%20000.jpg", {}),
    ("s3.example.com", "/bucket/a/b~c/%C3%A9t%C3%A9.bin",
     {"If-Match": '"0123456789abcdef0123456789abcdef"', "Range": "bytes=4194304-8388607"}),
    ("[::1]:7480", "/prefix/bucket/k", {"Range": "bytes=0-0"}),
])
def test_signature_matches_botocore(token, host, path, headers):
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    ours = Signer(creds, "eu-west-3").headers("GET", host, path, headers, now=NOW)
    assert ours["X-Amz-Date"] == time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(NOW))
    assert ours["Host"] == host and all(ours[k] == v for k, v in headers.items())
    assert ours.get("X-Amz-Security-Token") == token
    assert ours["Authorization"] == botocore_signature(creds, "eu-west-3", f"http://{host}{path}", ours)
    assert "wJalrXUtnFEMI" not in "".join(ours.values())       # the secret is never sent


def test_the_signing_key_is_derived_once_per_day_and_follows_rotation():
    class Rotating:
        secret = "secret-1"

        def get_frozen_credentials(self):
            return Credentials("AKID", self.secret, None)
    creds = Rotating()
    signer = Signer(creds, "us-east-1")
    first = signer.headers("GET", "h", "/b/k", {}, now=NOW)
    key = signer._key
    assert signer.headers("GET", "h", "/b/k", {}, now=NOW + 60)["Authorization"] != first["Authorization"]
    assert signer._key is key                                       # same day: the same key object
    signer.headers("GET", "h", "/b/k", {}, now=NOW + 86400)
    assert signer._key != key                                       # next day: a new key
    creds.secret = "secret-2"
    rotated = signer.headers("GET", "h", "/b/k", {}, now=NOW)
    assert rotated["Authorization"] != first["Authorization"]
    assert rotated["Authorization"] == botocore_signature(Credentials("AKID", "secret-2"), "us-east-1",
                                                         "http://h/b/k", rotated)
