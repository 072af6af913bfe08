"""S3BlobStore against a real HTTP S3 endpoint (moto server on 127.0.0.1).

The conformance suite runs against it; the tests below check what is S3
specific: URL parsing, multipart uploads, checksums, SSE, ranged GETs,
paginated listing, error mapping, and that credentials never leak.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from casckpt.errors import (
    AccessDeniedError,
    BlobNotFoundError,
    InvalidArgumentError,
    InvalidNameError,
    RetryableStorageError,
    StorageError,
)
from casckpt.storage import BlobStore, RetryingBlobStore, open_blob_store
from casckpt.storage.s3 import S3BlobStore, parse_s3_url
from casckpt.storage.s3_errors import map_s3_error
from casckpt.testing import BlobStoreConformance
from casckpt.testing.blobstore import blob
from casckpt.testing.faultproxy import FaultProxy

MiB = 1024 * 1024
SMALL_MULTIPART = {"multipart_threshold": 5 * MiB, "multipart_chunksize": 5 * MiB}


class TestS3BlobStoreConformance(BlobStoreConformance):
    list_count = 60  # three pages of list_page_size=25
    large_size = 11 * MiB + 3  # above the 5 MiB threshold: three parallel parts

    @pytest.fixture
    def blob_store(self, moto_endpoint: str, bucket: str, s3_admin: Any,
                   boto_session: Any) -> Iterator[BlobStore]:
        self.admin = s3_admin
        store = S3BlobStore(f"s3://{bucket}/team/run-1", endpoint_url=moto_endpoint,
                            session=boto_session, list_page_size=25, **SMALL_MULTIPART)
        yield store
        store.close()

    def raw_get(self, store: BlobStore, key: str) -> bytes | None:
        assert isinstance(store, S3BlobStore)
        try:
            resp = self.admin.get_object(Bucket=store.bucket, Key=f"team/run-1/{key}")
        except self.admin.exceptions.NoSuchKey:
            return None
        data: bytes = resp["Body"].read()
        return data


@pytest.fixture
def store(moto_endpoint: str, bucket: str, boto_session: Any) -> Iterator[S3BlobStore]:
    s = S3BlobStore(f"s3://{bucket}/pfx", endpoint_url=moto_endpoint, session=boto_session,
                    **SMALL_MULTIPART)
    yield s
    s.close()


@pytest.fixture
def proxied(fault_proxy: FaultProxy, bucket: str, boto_session: Any) -> Iterator[S3BlobStore]:
    """A store whose every request goes through the proxy (no SDK retries)."""
    s = S3BlobStore(f"s3://{bucket}/pfx", endpoint_url=fault_proxy.endpoint_url,
                    session=boto_session, sdk_attempts=1, **SMALL_MULTIPART)
    yield s
    s.close()


# URLs and options -----------------------------------------------------------

@pytest.mark.parametrize(("url", "bucket", "prefix", "canonical"), [
    ("s3://my-bucket", "my-bucket", "", "s3://my-bucket"),
    ("s3://my-bucket/", "my-bucket", "", "s3://my-bucket"),
    ("s3://my.bucket.1/ckpts", "my.bucket.1", "ckpts/", "s3://my.bucket.1/ckpts"),
    ("s3://abc/Team/run_1=x/", "abc", "Team/run_1=x/", "s3://abc/Team/run_1=x"),
])
def test_parse_valid_urls(url: str, bucket: str, prefix: str, canonical: str) -> None:
    loc = parse_s3_url(url)
    assert (loc.bucket, loc.prefix, loc.url) == (bucket, prefix, canonical)


@pytest.mark.parametrize("url", [
    "my-bucket/x", "s3:/my-bucket", "http://my-bucket/x", "s3://", "s3://ab", "s3://Bucket",
    "s3://-bucket", "s3://bucket-", "s3://my..bucket", "s3://my_bucket", "s3://192.168.1.2",
    "s3://xn--bucket", "s3://" + "a" * 64, "s3://bucket//x", "s3://bucket/a//b",
    "s3://bucket/../x", "s3://bucket/a/./b", "s3://bucket/x?y=1", "s3://bucket/x#f",
    "s3://user:pw@bucket/x", "s3://bucket:9000/x", "s3://bucket/a b", "s3://bucket/x//",
])
def test_parse_invalid_urls(url: str) -> None:
    with pytest.raises(InvalidNameError):
        parse_s3_url(url)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="s3:/abcXYZ09.-_ @?#", max_size=40))
def test_parse_accepts_only_well_formed_urls(text: str) -> None:
    url = "s3://" + text if text.startswith("a") else text
    try:
        loc = parse_s3_url(url)
    except InvalidNameError:
        return
    assert parse_s3_url(loc.url) == loc
    assert 3 <= len(loc.bucket) <= 63 and "/" not in loc.bucket
    assert loc.prefix == "" or (loc.prefix.endswith("/") and "//" not in loc.prefix)


@pytest.mark.parametrize("options", [
    {"sse": "aes256"}, {"kms_key_id": "k"}, {"sse": "AES256", "kms_key_id": "k"},
    {"checksum": "MD5"}, {"multipart_chunksize": MiB}, {"max_concurrency": 0},
    {"sdk_attempts": 0}, {"list_page_size": 1001}, {"addressing_style": "dns"},
])
def test_invalid_options(options: dict[str, Any], aws_env: None) -> None:
    with pytest.raises(InvalidArgumentError):
        S3BlobStore("s3://bucket/x", **options)


def test_open_blob_store_builds_a_retrying_s3_store(moto_endpoint: str, bucket: str) -> None:
    s = open_blob_store(f"s3://{bucket}/p", {"s3": {"endpoint_url": moto_endpoint}})
    try:
        assert isinstance(s, RetryingBlobStore) and isinstance(s.inner, S3BlobStore)
        assert s.url == f"s3://{bucket}/p"
        s.put("manifests/x", b"hello")
        assert s.get("manifests/x") == b"hello"
    finally:
        s.close()


def test_endpoint_from_the_environment(moto_endpoint: str, bucket: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    s = S3BlobStore(f"s3://{bucket}")
    try:
        s.put("manifests/env", b"from env")
        assert s.get("manifests/env") == b"from env"
        assert s.url == f"s3://{bucket}"
    finally:
        s.close()


def test_keys_live_under_the_prefix(store: S3BlobStore, s3_admin: Any, bucket: str) -> None:
    store.put("packs/ab/abc", b"x")
    s3_admin.put_object(Bucket=bucket, Key="pfx-other/packs/zz", Body=b"outside")
    s3_admin.put_object(Bucket=bucket, Key="pfx/Foreign File.txt", Body=b"not ours")
    keys = [o["Key"] for o in s3_admin.list_objects_v2(Bucket=bucket)["Contents"]]
    assert "pfx/packs/ab/abc" in keys
    assert [i.key for i in store.list()] == ["packs/ab/abc"]


# multipart, checksums, SSE ---------------------------------------------------

def test_put_file_above_threshold_is_multipart_with_parallel_parts(
        proxied: S3BlobStore, fault_proxy: FaultProxy, tmp_path: Path, s3_admin: Any,
        bucket: str) -> None:
    data = blob(16 * MiB + 5, seed=11)
    path = tmp_path / "pack"
    path.write_bytes(data)
    proxied.put_file("packs/aa/big", path)
    head = s3_admin.head_object(Bucket=bucket, Key="pfx/packs/aa/big")
    assert head["ETag"].strip('"').endswith("-4")
    parts = [r for r in fault_proxy.records if r.method == "PUT" and "partNumber=" in r.path]
    assert len(parts) == 4
    assert sum(r.request_bytes for r in parts) == len(data)
    assert all("x-amz-checksum-crc32" in r.headers for r in parts)
    assert proxied.get("packs/aa/big") == data
    assert path.read_bytes() == data, "put_file must leave the file in place"


def test_put_below_threshold_is_one_request(proxied: S3BlobStore, fault_proxy: FaultProxy,
                                            tmp_path: Path) -> None:
    path = tmp_path / "pack"
    path.write_bytes(blob(5 * MiB - 1))
    proxied.put_file("packs/aa/small", path)
    proxied.put("packs/aa/small2", blob(1000))
    assert fault_proxy.requests_by_method() == {"PUT": 2}


def test_put_bytes_above_threshold_is_multipart(store: S3BlobStore, s3_admin: Any,
                                                bucket: str) -> None:
    data = blob(6 * MiB, seed=12)
    store.put("packs/bb/big", memoryview(data))
    head = s3_admin.head_object(Bucket=bucket, Key="pfx/packs/bb/big")
    assert head["ETag"].strip('"').endswith("-2")
    assert store.get("packs/bb/big") == data


@pytest.mark.parametrize("checksum", ["CRC32", "SHA256"])
def test_uploads_carry_a_checksum(moto_endpoint: str, bucket: str, s3_admin: Any,
                                  checksum: str, tmp_path: Path, boto_session: Any) -> None:
    s = S3BlobStore(f"s3://{bucket}", endpoint_url=moto_endpoint, checksum=checksum,
                    session=boto_session,
                    **SMALL_MULTIPART)
    try:
        s.put("manifests/c", b"checked")
        path = tmp_path / "p"
        path.write_bytes(blob(5 * MiB + 1))
        s.put_file("packs/cc/c", path)
    finally:
        s.close()
    for key in ("manifests/c", "packs/cc/c"):
        head = s3_admin.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        assert head.get(f"Checksum{checksum}"), (key, head)


def test_checksum_header_is_sent(proxied: S3BlobStore, fault_proxy: FaultProxy) -> None:
    proxied.put("manifests/h", b"hello")
    proxied.get("manifests/h")
    put, get = fault_proxy.records
    assert put.headers["x-amz-checksum-crc32"] == "NhCmhg=="  # CRC32 of b"hello"
    assert get.headers["x-amz-checksum-mode"] == "ENABLED"


def test_no_checksum_option(fault_proxy: FaultProxy, bucket: str, boto_session: Any) -> None:
    s = S3BlobStore(f"s3://{bucket}", endpoint_url=fault_proxy.endpoint_url, checksum=None,
                    session=boto_session)
    try:
        s.put("manifests/plain", b"plain")
        assert s.get("manifests/plain") == b"plain"
    finally:
        s.close()
    put, get = fault_proxy.records
    assert not [h for h in put.headers if "checksum" in h], put.headers
    assert "x-amz-checksum-mode" not in get.headers


@pytest.mark.parametrize(("sse", "kms_key_id"), [
    ("AES256", None), ("aws:kms", None), ("aws:kms", "alias/casckpt-test"),
])
def test_sse_options_pass_through(moto_endpoint: str, bucket: str, s3_admin: Any,
                                  tmp_path: Path, sse: str, kms_key_id: str | None,
                                  boto_session: Any) -> None:
    s = S3BlobStore(f"s3://{bucket}", endpoint_url=moto_endpoint, sse=sse, session=boto_session,
                    kms_key_id=kms_key_id, **SMALL_MULTIPART)
    try:
        s.put("manifests/enc", b"secret-ish")
        path = tmp_path / "p"
        path.write_bytes(blob(5 * MiB + 1))
        s.put_file("packs/ee/enc", path)
        assert s.get("manifests/enc") == b"secret-ish"
    finally:
        s.close()
    for key in ("manifests/enc", "packs/ee/enc"):
        head = s3_admin.head_object(Bucket=bucket, Key=key)
        assert head["ServerSideEncryption"] == sse
        if kms_key_id is not None:
            assert kms_key_id in head["SSEKMSKeyId"]


# ranges and listing ---------------------------------------------------------

def test_ranged_get_fetches_only_the_range(proxied: S3BlobStore, fault_proxy: FaultProxy,
                                           s3_admin: Any, bucket: str) -> None:
    data = blob(8 * MiB, seed=13)
    s3_admin.put_object(Bucket=bucket, Key="pfx/packs/dd/r", Body=data)
    got = proxied.get_range("packs/dd/r", 3 * MiB + 17, 4096)
    assert got == data[3 * MiB + 17:3 * MiB + 17 + 4096]
    (record,) = fault_proxy.records
    assert record.headers["range"] == f"bytes={3 * MiB + 17}-{3 * MiB + 17 + 4095}"
    assert record.response_bytes == 4096


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offset=st.integers(0, 70_000), length=st.integers(0, 70_000))
def test_get_range_matches_slicing(store: S3BlobStore, offset: int, length: int) -> None:
    data = blob(65_536, seed=14)
    if store.size("packs/dd/prop") is None:
        store.put("packs/dd/prop", data)
    assert store.get_range("packs/dd/prop", offset, length) == data[offset:offset + length]


def test_range_past_the_end(proxied: S3BlobStore) -> None:
    proxied.put("packs/dd/short", b"0123456789")
    assert proxied.get_range("packs/dd/short", 8, 100) == b"89"
    assert proxied.get_range("packs/dd/short", 10, 1) == b""
    assert proxied.get_range("packs/dd/short", 1000, 1) == b""
    with pytest.raises(InvalidArgumentError):
        proxied.get_range("packs/dd/short", -1, 1)


def test_listing_is_paginated(fault_proxy: FaultProxy, bucket: str, s3_admin: Any,
                              boto_session: Any) -> None:
    for i in range(23):
        s3_admin.put_object(Bucket=bucket, Key=f"p/packs/{i:02d}/x", Body=b"x" * i)
    s = S3BlobStore(f"s3://{bucket}/p", endpoint_url=fault_proxy.endpoint_url, list_page_size=5,
                    session=boto_session)
    try:
        infos = list(s.list("packs/"))
    finally:
        s.close()
    assert [(i.key, i.size) for i in infos] == [(f"packs/{i:02d}/x", i) for i in range(23)]
    lists = [r for r in fault_proxy.records if "list-type=2" in r.path]
    assert len(lists) == 5


def test_invalid_listing_prefix(store: S3BlobStore) -> None:
    with pytest.raises(InvalidNameError):
        list(store.list("../"))


# errors --------------------------------------------------------------------

@pytest.mark.parametrize(("status", "code", "expected"), [
    (503, "SlowDown", RetryableStorageError),
    (500, "InternalError", RetryableStorageError),
    (502, "BadGateway", RetryableStorageError),
    (504, "GatewayTimeout", RetryableStorageError),
    (400, "RequestTimeout", RetryableStorageError),
    (400, "ThrottlingException", RetryableStorageError),
    (403, "InvalidAccessKeyId", StorageError),
    (403, "SignatureDoesNotMatch", StorageError),
    (400, "KMS.NotFoundException", StorageError),
    (400, "ExpiredToken", StorageError),
    (404, "NoSuchBucket", StorageError),
    (404, "NoSuchKey", BlobNotFoundError),
])
def test_error_mapping(proxied: S3BlobStore, fault_proxy: FaultProxy, status: int, code: str,
                       expected: type[Exception]) -> None:
    fault_proxy.fail_next(1, status=status, code=code, methods={"GET"})
    with pytest.raises(StorageError) as info:
        proxied.get("packs/ff/x")
    assert type(info.value) is expected
    message = str(info.value)
    assert "packs/ff/x" in message and proxied.bucket in message
    if expected is not BlobNotFoundError:
        assert code in message
    if expected is StorageError:
        assert "look the error code up" not in message, "known permanent errors say what to do"


OBJECT = "arn:aws:s3:::{bucket}/pfx/packs/ff/x"


@pytest.mark.parametrize(("op", "method", "right", "sid"), [
    (lambda s: list(s.list("packs/")), "GET",
     "s3:ListBucket on arn:aws:s3:::{bucket} with s3:prefix 'pfx/packs/'", "CasckptList0"),
    (lambda s: s.get("packs/ff/x"), "GET", "s3:GetObject on " + OBJECT, "CasckptObjects0"),
    (lambda s: s.get_range("packs/ff/x", 1, 2), "GET", "s3:GetObject on " + OBJECT, "CasckptObjects0"),
    (lambda s: s.size("packs/ff/x"), "HEAD", "s3:GetObject on " + OBJECT, "CasckptObjects0"),
    (lambda s: s.put("packs/ff/x", b"x"), "PUT", "s3:PutObject on " + OBJECT, "CasckptObjects0"),
    (lambda s: s.put("packs/ff/x", blob(6 * MiB)), "POST", "s3:PutObject on " + OBJECT,
     "CasckptObjects0"),  # multipart: its first request is a POST
    (lambda s: s.delete("packs/ff/x"), "DELETE", "s3:DeleteObject on " + OBJECT, "CasckptObjects0"),
], ids=["list", "get", "get_range", "size", "put", "multipart", "delete"])
def test_a_refused_request_is_denied_not_missing(
        proxied: S3BlobStore, fault_proxy: FaultProxy, op: Any, method: str, right: str,
        sid: str) -> None:
    """A 403 is an AccessDeniedError (never a StorageError, which callers may take for an
    unreachable location or a missing object) naming the IAM action AWS authorizes the request
    under, the resource (a listing's s3:prefix) and the printed policy's statement that grants it."""
    proxied.put("packs/ff/x", b"abc")
    fault_proxy.fail_next(10, status=403, code="AccessDenied", methods={method})
    with pytest.raises(AccessDeniedError) as info:
        op(proxied)
    assert not isinstance(info.value, StorageError)
    assert info.value.right == right.format(bucket=proxied.bucket)
    message = str(info.value)
    assert f'"Sid":"{sid}"' in message and "--print-grants" in message
    assert f"arn:aws:s3:::{proxied.bucket}" in message


def test_denial_mapping_without_a_location_names_the_role() -> None:
    from botocore.exceptions import ClientError

    refused = ClientError({"Error": {"Code": "403", "Message": ""},
                           "ResponseMetadata": {"HTTPStatusCode": 403}}, "HeadObject")
    error = map_s3_error(refused, "size", "s3://b/p/manifests/m")
    assert isinstance(error, AccessDeniedError)
    assert error.right == "s3:GetObject on arn:aws:s3:::b/p/manifests/m"
    assert "--print-grants reader" in str(error) and "Sid" not in str(error)
    credentials = ClientError({"Error": {"Code": "InvalidAccessKeyId", "Message": "no such key"},
                               "ResponseMetadata": {"HTTPStatusCode": 403}}, "GetObject")
    assert type(map_s3_error(credentials, "get", "s3://b/p/x", "s3://b/p")) is StorageError


def test_missing_bucket_is_permanent(moto_endpoint: str, boto_session: Any) -> None:
    s = S3BlobStore("s3://casckpt-no-such-bucket/x", endpoint_url=moto_endpoint,
                    session=boto_session)
    try:
        with pytest.raises(StorageError) as info:
            s.put("manifests/a", b"x")
        assert not isinstance(info.value, RetryableStorageError)
        assert "NoSuchBucket" in str(info.value) and "bucket" in str(info.value)
        with pytest.raises(StorageError) as info:
            list(s.list())
        assert "NoSuchBucket" in str(info.value)
    finally:
        s.close()


def test_unreachable_endpoint_is_retryable(boto_session: Any) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = S3BlobStore("s3://some-bucket/x", endpoint_url=f"http://127.0.0.1:{port}",
                    sdk_attempts=1, connect_timeout=1, session=boto_session)
    try:
        with pytest.raises(RetryableStorageError, match="some-bucket"):
            s.get("manifests/a")
    finally:
        s.close()


def test_closed_store_refuses_work(store: S3BlobStore) -> None:
    store.close()
    with pytest.raises(StorageError, match="closed"):
        store.get("manifests/a")


def test_credentials_never_appear_in_errors_or_logs(
        fault_proxy: FaultProxy, bucket: str, moto_endpoint: str, aws_env: None,
        caplog: pytest.LogCaptureFixture, fake_credentials: tuple[str, str]) -> None:
    key_id, secret = fake_credentials
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    inner = S3BlobStore(f"s3://{bucket}/x", endpoint_url=fault_proxy.endpoint_url,
                        sdk_attempts=1)
    s = RetryingBlobStore(inner, attempts=2, base_delay=0)
    faults = [
        lambda: fault_proxy.fail_next(4, status=403, code="InvalidAccessKeyId"),
        lambda: fault_proxy.fail_next(4, status=403, code="SignatureDoesNotMatch"),
        lambda: fault_proxy.fail_next(4, status=503, code="SlowDown"),
        lambda: fault_proxy.cut_next_download(4),
        lambda: fault_proxy.cut_next_upload(4),
    ]
    s.put("manifests/present", b"x" * 1000)
    for arm in faults:
        for call in (lambda: s.get("manifests/present"), lambda: s.put("manifests/p2", b"y" * 99)):
            fault_proxy.clear_faults()
            arm()
            try:
                call()
            except StorageError as exc:
                texts.append("".join(traceback.format_exception(exc)))
                texts.append(repr(exc))
    fault_proxy.clear_faults()
    no_bucket = S3BlobStore("s3://casckpt-none/x", endpoint_url=moto_endpoint)
    no_server = S3BlobStore("s3://x-y-z/x", endpoint_url="http://127.0.0.1:9", sdk_attempts=1)
    for call in (lambda: s.get("manifests/missing"), lambda: no_bucket.get("manifests/a"),
                 lambda: no_server.get("manifests/a")):
        try:
            call()
        except StorageError as exc:
            texts.append("".join(traceback.format_exception(exc)))
    for each in (s, no_bucket, no_server):
        each.close()
    assert len(texts) >= 10
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("casckpt")]
    everything_info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    everything = [r.getMessage() for r in caplog.records]
    assert any("retrying" in m for m in ours), "retries are logged"
    for text in texts + ours + everything_info:
        assert key_id not in text
        assert secret not in text
    for text in everything:  # botocore's own DEBUG logs may show the key id, never the secret
        assert secret not in text


def test_one_client_per_store(store: S3BlobStore) -> None:
    client = store._client
    store.put("manifests/a", b"a")
    store.get("manifests/a")
    assert store._client is client
