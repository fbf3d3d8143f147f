"""Test support, outside the product: the S3 server harness the tests and benchmarks start on
loopback (``s3``) and the latency and fault injecting TCP proxy (``latency_proxy``). Not installed
with cachefs; tests (pytest's ``pythonpath``) and benchmarks (run from the checkout) import it."""
