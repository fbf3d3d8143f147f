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


def botocore_authorization(creds: Credentials, region: str, method: str, url: str, sent: dict[str, str],
                           body: bytes = b"") -> str:
    """botocore's Authorization for ``method`` of ``url`` (query included, as botocore encodes it)
    with a signed payload of ``body``, at the X-Amz-Date and with the headers ours sent."""
    headers = {k: v for k, v in sent.items() if k not in ("Authorization", "X-Amz-Date", "X-Amz-Content-SHA256")}
    request = AWSRequest(method=method, url=url, headers=headers, data=body)
    auth = S3SigV4Auth(creds, "s3", region)
    request.context["timestamp"] = sent["X-Amz-Date"]
    request.context["payload_signing_enabled"] = True
    auth._modify_request_before_signing(request)
    assert request.headers["X-Amz-Content-SHA256"] == sent["X-Amz-Content-SHA256"]   # the body's SHA-256
    canonical = auth.canonical_request(request)
    signature = auth.signature(auth.string_to_sign(request, canonical), request)
    auth._inject_signature_to_request(request, signature)
    return request.headers["Authorization"]


ODD_KEYS = ["plain/key.bin", "with space/and+plus.jpg", "tilde~/percent%25/é t é/日本.txt",
            "a=b&c/?hash#/semi;colon,comma", "dots/../and/./slashes//end/"]


@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzEJr//////////token+with/odd=chars"])
@pytest.mark.parametrize("key", ODD_KEYS)
@pytest.mark.parametrize("method,params,body,extra", [
    ("GET", None, b"", {"Range": "bytes=0-1023", "If-Match": '"abc"'}),
    ("PUT", None, b"checkpoint bytes \x00\xff" * 100, {"Content-Length": "1900"}),
    ("PUT", {"partNumber": "7", "uploadId": "2~Up+load/Id=="}, b"part" * 1000, {"Content-Length": "4000"}),
    ("GET", {"list-type": "2", "encoding-type": "url", "prefix": "with space/a+b~é/", "delimiter": "/",
             "continuation-token": "1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=", "max-keys": "1000"}, b"", {}),
    ("DELETE", {"uploadId": "x y"}, b"", {}),
])
def test_every_request_shape_signs_as_botocore(token, key, method, params, body, extra):
    import hashlib

    from botocore.utils import percent_encode, percent_encode_sequence

    from cachefs.store.s3.sigv4 import object_path, query_string
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    path = object_path("bucket-1", key)
    assert path == "/bucket-1/" + percent_encode(key, safe="/~")        # the path boto3's serializer builds
    query = query_string(params)
    ours = Signer(creds, "us-west-2").headers(method, "127.0.0.1:9000", path, extra, now=NOW, query=query,
                                              payload_sha256=hashlib.sha256(body).hexdigest())
    url = f"http://127.0.0.1:9000{path}" + (f"?{percent_encode_sequence(params)}" if params else "")
    assert ours["Authorization"] == botocore_authorization(creds, "us-west-2", method, url, ours, body)


@pytest.mark.parametrize("value", ['"abc"\r\nX-Injected: 1', "etag\n", "nul\x00", "bell\x07", "del\x7f",
                                   "tab-is-fine\tbut cr is not\r"])
def test_a_header_value_with_a_control_character_is_refused_before_signing(value):
    from cachefs.errors import BadResponse, StoreError
    creds = Credentials("AKID", "secret", None)
    with pytest.raises(BadResponse, match="control character") as info:
        Signer(creds, "us-east-1").headers("GET", "h", "/b/k", {"If-Match": value}, now=NOW)
    assert isinstance(info.value, StoreError)
    assert "\r" not in str(info.value).replace("\\r", "") and "\n" not in str(info.value)


def test_header_names_must_be_tokens_and_ordinary_values_pass():
    from cachefs.errors import BadResponse
    from cachefs.store.s3.sigv4 import check_headers
    assert check_headers({"If-Match": '"0123abcd-12"', "Range": "bytes=0-9", "X-Tab": "a\tb"})
    with pytest.raises(BadResponse, match="named"):
        check_headers({"Bad Name": "v"})
    with pytest.raises(BadResponse, match="named"):
        check_headers({"X\r\nInjected": "v"})
