"""The bandwidth-throttling proxy the ``tiers`` benchmark puts in front of moto (``benchmarks/throttle.py``).

What the benchmark's figures rest on: bytes pass unchanged, and no faster than the rate, for
all connections together, each way; the child-process variant serves S3 and goes away.
"""

from __future__ import annotations

import io
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # the proxy lives with the benchmarks
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.throttle import ThrottledProxy, TokenBucket, throttled_s3  # noqa: E402

MB = 1_000_000


def test_token_bucket_shares_its_rate_between_threads() -> None:
    bucket = TokenBucket(10 * MB, burst=100_000)
    piece, pieces = 50_000, 20  # 1 MB per thread, 2 MB in all: at least 0.19 s at 10 MB/s

    def take() -> None:
        for _ in range(pieces):
            bucket.take(piece)

    threads = [threading.Thread(target=take) for _ in range(2)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    assert elapsed >= (2 * piece * pieces - bucket.burst) / bucket.rate * 0.98
    assert elapsed < 5.0


def test_token_bucket_refuses_a_zero_rate() -> None:
    with pytest.raises(ValueError, match="rate and burst"):
        TokenBucket(0, burst=1)


def _client(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def test_proxy_relays_s3_bytes_unchanged_and_no_faster_than_its_rate(
        aws_env: None, moto_endpoint: str) -> None:
    body = bytes(range(256)) * (12 * 4096)  # 12.6 MB: put and got back through the proxy
    with ThrottledProxy(moto_endpoint, rate=25 * MB, burst=256 * 1024) as proxy:
        client = _client(proxy.endpoint_url)
        client.create_bucket(Bucket="throttle-a")
        start = time.perf_counter()
        client.put_object(Bucket="throttle-a", Key="k", Body=body)
        put_s = time.perf_counter() - start
        start = time.perf_counter()
        got = client.get_object(Bucket="throttle-a", Key="k")["Body"].read()
        get_s = time.perf_counter() - start
        assert got == body
        assert proxy.bytes_up >= len(body) and proxy.bytes_down >= len(body)
    floor = (len(body) - 256 * 1024) / (25 * MB)
    assert put_s >= floor * 0.98 and get_s >= floor * 0.98
    assert put_s < 20 * floor and get_s < 20 * floor


def test_proxy_rate_is_shared_by_concurrent_connections(aws_env: None, moto_endpoint: str) -> None:
    body = b"\x5a" * (3 * MB)
    with ThrottledProxy(moto_endpoint, rate=20 * MB, burst=128 * 1024) as proxy:
        clients = [_client(proxy.endpoint_url) for _ in range(2)]
        clients[0].create_bucket(Bucket="throttle-b")
        errors: list[BaseException] = []

        def put(i: int) -> None:
            try:
                clients[i].put_object(Bucket="throttle-b", Key=f"k{i}", Body=body)
            except BaseException as exc:  # reported by the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=put, args=(i,)) for i in range(2)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
    assert errors == []
    assert elapsed >= (2 * len(body) - 128 * 1024) / (20 * MB) * 0.98  # one rate, not one each


def test_stopped_proxy_refuses_connections(aws_env: None, moto_endpoint: str) -> None:
    import botocore.exceptions

    proxy = ThrottledProxy(moto_endpoint, rate=100 * MB).start()
    endpoint = proxy.endpoint_url
    _client(endpoint).list_buckets()
    proxy.stop()
    with pytest.raises(botocore.exceptions.EndpointConnectionError):
        _client(endpoint).list_buckets()


def test_throttled_s3_serves_from_a_child_process_counts_and_stops(aws_env: None) -> None:
    import multiprocessing

    before = set(multiprocessing.active_children())
    with throttled_s3(50 * MB) as s3:
        assert s3.endpoint != s3.direct
        client = _client(s3.endpoint)
        client.create_bucket(Bucket="throttle-c")
        up, down = s3.counters()
        client.upload_fileobj(io.BytesIO(b"x" * 100_000), "throttle-c", "k")
        got = _client(s3.direct).get_object(Bucket="throttle-c", Key="k")["Body"].read()
        assert got == b"x" * 100_000
        after_up, after_down = s3.counters()
        assert 100_000 <= after_up - up < 110_000  # the body and its request's headers
        assert after_down - down < 10_000  # the answer only: the get went around the proxy
        assert set(multiprocessing.active_children()) - before
    assert not set(multiprocessing.active_children()) - before
