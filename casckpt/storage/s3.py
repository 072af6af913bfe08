"""A blob store in an S3 bucket, or any S3-compatible endpoint, through boto3.

Location: ``s3://bucket/prefix``; every key lives under ``prefix/``. The
endpoint URL, region and credentials come from the standard AWS chain
(arguments, then ``AWS_ENDPOINT_URL``/``AWS_REGION``/``AWS_PROFILE`` and the
other environment variables, shared config files, instance roles).

Each store holds one boto3 client (thread-safe, with a bounded connection pool)
and one transfer manager (bounded thread pool for multipart parts), both made
in ``__init__`` and released by ``close()``.

- Uploads send a checksum (CRC32 by default) that S3 verifies before it
  stores anything, and pass the SSE options through. Objects at or above
  ``multipart_threshold`` go up as parallel parts of ``multipart_chunksize``.
  A PutObject or CompleteMultipartUpload is atomic: a failed upload leaves no
  object. Keys are content-addressed, so re-putting a key after a failure
  writes the same bytes again: puts are idempotent and safe to retry.
- ``get_range`` sends ``Range: bytes=a-b`` so readers fetch only what they
  need; a body cut short raises ``RetryableStorageError``.
- botocore retries each request (standard mode: throttling, 5xx, connection
  errors) up to ``sdk_attempts`` times in all. Whole operations, including a
  body cut mid-download, are retried by wrapping the store in
  :class:`~casckpt.storage.retry.RetryingBlobStore`.

A multipart upload that fails is aborted; one whose abort also fails leaves
parts that cost space until a bucket lifecycle rule
(``AbortIncompleteMultipartUpload``) removes them.
"""

from __future__ import annotations

import io
import ipaddress
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError
from s3transfer.manager import TransferConfig, TransferManager

from casckpt.errors import (
    InvalidArgumentError,
    InvalidNameError,
    OversizedObjectError,
    RetryableStorageError,
    StorageError,
)
from casckpt.storage.base import RemoteBlobStore, check_object_name, location_prefix, wants_bytes
from casckpt.storage.redact import redact_text
from casckpt.storage.s3_errors import error_code, map_s3_error

MiB = 1024 * 1024
MIN_PART_SIZE = 5 * MiB  # S3's smallest allowed part (all but the last)
SSE_MODES = ("AES256", "aws:kms")
CHECKSUMS = ("CRC32", "CRC32C", "CRC64NVME", "SHA1", "SHA256")

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")

# botocore >= 1.36 adds checksums to every upload by default; checksum=None turns
# that off too, for S3-compatible endpoints that reject them.
_NO_DEFAULT_CHECKSUMS = {
    option: "when_required"
    for option in ("request_checksum_calculation", "response_checksum_validation")
    if option in Config.OPTION_DEFAULTS
}


@dataclass(frozen=True, slots=True)
class S3Location:
    """A parsed ``s3://bucket/prefix``. ``prefix`` is empty or ends with ``/``."""

    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix.rstrip('/')}".rstrip("/")


def parse_s3_url(url: str) -> S3Location:
    """Parse ``s3://bucket[/prefix]`` strictly.

    The bucket must follow S3's naming rules (3-63 characters of lower-case
    letters, digits, dots and hyphens, no IP address). The prefix is
    '/'-separated segments of letters, digits and ``._=+-``, without empty,
    ``.`` or ``..`` segments; one trailing '/' is allowed.

    Raises:
        InvalidNameError: ``url`` is not such a URL (the message says why).
    """
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise InvalidNameError(f"{redact_text(str(url))!r} is not an S3 location: write s3://bucket/prefix")
    if redact_text(url) != url:
        raise InvalidNameError(f"S3 location {redact_text(url)!r} holds a credential: give credentials "
                               "through AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile, never "
                               "in the URL (it is stored in the catalog and shown in messages)")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    _check_bucket(bucket, url)
    return S3Location(bucket, location_prefix(prefix.removesuffix("/"), url, "S3"))


def _check_bucket(bucket: str, url: str) -> None:
    problem = None
    if not _BUCKET.match(bucket):
        problem = "3-63 lower-case letters, digits, dots and hyphens, starting and " \
                  "ending with a letter or digit"
    elif ".." in bucket or ".-" in bucket or "-." in bucket:
        problem = "no '..', '.-' or '-.'"
    elif bucket.startswith(("xn--", "sthree-")) or bucket.endswith(("-s3alias", "--ol-s3")):
        problem = "no reserved prefix or suffix"
    else:
        try:
            ipaddress.IPv4Address(bucket)
            problem = "not an IP address"
        except ValueError:
            pass
    if problem:
        raise InvalidNameError(f"invalid S3 bucket name {bucket!r} in {url!r}: use {problem}")


class S3BlobStore(RemoteBlobStore):
    """Objects under ``s3://bucket/prefix``. Thread-safe; see the module docstring.

    Args:
        url: ``s3://bucket/prefix``.
        endpoint_url: an S3-compatible endpoint (else ``AWS_ENDPOINT_URL`` or AWS).
        region: the bucket's region (else ``AWS_REGION``/config).
        profile: a named profile from the shared AWS config files.
        session: a ``boto3.session.Session`` to build the client from, instead
            of a new one (lets many stores share one session's loaded models;
            ``profile`` is then ignored).
        sse: server-side encryption: ``"AES256"`` (SSE-S3) or ``"aws:kms"`` (SSE-KMS).
        kms_key_id: the KMS key for ``sse="aws:kms"`` (else the account's default key).
        checksum: the checksum sent with every upload (and verified on whole-object
            reads), or None for endpoints that reject checksums.
        multipart_threshold: objects this large or larger are uploaded in parts.
        multipart_chunksize: the part size (at least 5 MiB).
        max_concurrency: parts uploaded at once, per store.
        connect_timeout: seconds to wait for a connection (5: S3 answers in milliseconds).
        read_timeout: seconds to wait for the next bytes on an open connection (15: a
            checkpoint object's first byte comes in well under a second and then streams,
            so an endpoint silent this long went away; the attempt is retried rather than
            held for botocore's 60 s). See docs/DEFAULTS.md.
        max_pool_connections: the client's connection pool size (cover the
            engine's I/O threads plus ``max_concurrency``).
        sdk_attempts: tries per HTTP request inside botocore (1 = no SDK retry).
        addressing_style: ``"path"`` or ``"virtual"`` for S3-compatible endpoints.
        list_page_size: keys per listing request (at most 1000).

    Raises:
        InvalidNameError: ``url`` is not a valid S3 location.
        InvalidArgumentError: an option is out of range.
        StorageError: the client cannot be built (bad profile, bad endpoint).
    """

    service = "S3"

    def __init__(
        self, url: str, *, endpoint_url: str | None = None, region: str | None = None,
        profile: str | None = None, session: Any = None, sse: str | None = None,
        kms_key_id: str | None = None,
        checksum: str | None = "CRC32", multipart_threshold: int = 64 * MiB,
        multipart_chunksize: int = 16 * MiB, max_concurrency: int = 8,
        connect_timeout: float = 5.0, read_timeout: float = 15.0,
        max_pool_connections: int = 32, sdk_attempts: int = 3,
        addressing_style: str | None = None, list_page_size: int = 1000,
    ) -> None:
        location = parse_s3_url(url)
        self.bucket, self.prefix, self.url = location.bucket, location.prefix, location.url
        self._root = f"s3://{self.bucket}/"
        _check_options(sse, kms_key_id, checksum, multipart_threshold, multipart_chunksize,
                       max_concurrency, sdk_attempts, list_page_size, addressing_style)
        self.multipart_threshold = multipart_threshold
        self._page_size = list_page_size
        self._put_args: dict[str, str] = {}
        if checksum is not None:
            self._put_args["ChecksumAlgorithm"] = checksum
        if sse is not None:
            self._put_args["ServerSideEncryption"] = sse
        if kms_key_id is not None:
            self._put_args["SSEKMSKeyId"] = kms_key_id
        self._get_args = {"ChecksumMode": "ENABLED"} if checksum is not None else {}
        config = Config(
            retries={"mode": "standard", "total_max_attempts": sdk_attempts},
            connect_timeout=connect_timeout, read_timeout=read_timeout,
            max_pool_connections=max_pool_connections, user_agent_extra="casckpt",
            s3={"addressing_style": addressing_style} if addressing_style else None,
            **(_NO_DEFAULT_CHECKSUMS if checksum is None else {}),
        )
        try:
            if session is None:
                session = boto3.session.Session(profile_name=profile, region_name=region)
            self._client: Any = session.client("s3", endpoint_url=endpoint_url,
                                                region_name=region, config=config)
        except Exception as exc:  # botocore raises many unrelated types here
            raise StorageError(
                f"cannot set up the S3 client for {self.url}: {type(exc).__name__}: "
                f"{redact_text(str(exc))}; check the profile, region and endpoint URL"
            ) from exc
        self._transfers = TransferManager(self._client, TransferConfig(
            multipart_threshold=multipart_threshold, multipart_chunksize=multipart_chunksize,
            max_request_concurrency=max_concurrency,
            max_in_memory_upload_chunks=max_concurrency * 2,
        ))

    def _map_error(self, exc: Exception, op: str, where: str) -> Exception:
        return map_s3_error(exc, op, where, self.url)

    # writes ----------------------------------------------------------------

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Upload ``data`` (in parallel parts at or above the multipart threshold)."""
        check_object_name(key)
        if len(data) >= self.multipart_threshold:
            self._call("put", key, lambda: self._upload(io.BytesIO(data), key))
            return
        body = data if isinstance(data, bytes) else bytes(data)
        self._call("put", key, lambda: self._client.put_object(
            Bucket=self.bucket, Key=self.prefix + key, Body=body, **self._put_args))

    def put_file(self, key: str, path: Path) -> None:
        """Upload the file at ``path``; the file is left in place (not consumed)."""
        self._file_size(key, path)
        self._call("put_file", key, lambda: self._upload(os.fspath(path), key))

    def _upload(self, source: str | io.BytesIO, key: str) -> None:
        future = self._transfers.upload(source, self.bucket, self.prefix + key,
                                        extra_args=dict(self._put_args))
        future.result()

    # reads -----------------------------------------------------------------

    def get(self, key: str, *, max_size: int | None = None) -> bytes:
        """Fetch the whole object; one larger than ``max_size`` is refused from its
        Content-Length, before the body is read."""
        check_object_name(key)

        def fetch() -> bytes:
            resp = self._client.get_object(Bucket=self.bucket, Key=self.prefix + key,
                                           **self._get_args)
            length = int(resp["ContentLength"])
            if max_size is not None and length > max_size:
                resp["Body"].close()
                raise OversizedObjectError(
                    f"{self._where(key)} is {length} bytes, more than the {max_size} expected; it "
                    "was not read. Run `casckpt check` (it is damaged or not casckpt's)")
            return _read_body(resp, length, self._where(key))

        return self._call("get", key, fetch)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Fetch ``length`` bytes from ``offset`` with one ranged GET (fewer at the end)."""
        if not wants_bytes(self, key, offset, length, self._where(key)):
            return b""
        return self._call("get_range", key, lambda: self._fetch_range(key, offset, length))

    def _fetch_range(self, key: str, offset: int, length: int) -> bytes:
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=self.prefix + key,
                                           Range=f"bytes={offset}-{offset + length - 1}")
        except ClientError as exc:
            code, status = error_code(exc.response)
            if code == "InvalidRange" or status == 416:
                return b""  # the object exists and ends at or before offset
            raise
        content_range = resp.get("ContentRange")
        if not content_range:  # the endpoint ignored Range and sends the whole object
            wanted = min(int(resp["ContentLength"]), offset + length)
            return _read_body(resp, wanted, self._where(key), limit=wanted)[offset:offset + length]
        if int(resp["ContentLength"]) > length:  # more than asked for: never read it
            resp["Body"].close()
            raise RetryableStorageError(
                f"S3 get_range of {self._where(key)}: asked for {length} bytes, the answer holds "
                f"{resp['ContentLength']}; trying again may succeed")
        data = _read_body(resp, int(resp["ContentLength"]), self._where(key))
        start, end = _parse_content_range(content_range)
        if start != offset or end - start + 1 != len(data) or len(data) > length:
            raise RetryableStorageError(
                f"S3 get_range of {self._where(key)}: asked for bytes {offset}+{length}, "
                f"got {content_range!r} with {len(data)} bytes; trying again may succeed"
            )
        return data

    def size(self, key: str) -> int | None:
        check_object_name(key)
        return self._unless_missing("size", key, lambda: int(self._client.head_object(
            Bucket=self.bucket, Key=self.prefix + key)["ContentLength"]), None)

    def _pages(self, prefix: str) -> Iterator[Any]:
        return iter(self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix, PaginationConfig={"PageSize": self._page_size}))

    def _entries(self, page: Any) -> list[tuple[str, int, float]]:
        return [(obj["Key"], int(obj["Size"]), obj["LastModified"].timestamp())
                for obj in page.get("Contents", ())]

    # deletes and lifecycle -------------------------------------------------

    def delete(self, key: str) -> None:
        check_object_name(key)
        self._unless_missing("delete", key, lambda: self._client.delete_object(
            Bucket=self.bucket, Key=self.prefix + key), None)

    def close(self) -> None:
        """Wait for uploads in flight, then release the thread pool and connections.

        Idempotent. The store must not be used afterwards.
        """
        if self._closed:
            return
        self._closed = True
        self._transfers.shutdown()
        self._client.close()


def _read_body(resp: dict[str, Any], expected: int, where: str, limit: int | None = None) -> bytes:
    """Read the body (only its first ``limit`` bytes, if given) and check it is ``expected`` long."""
    body = resp["Body"]
    try:
        data: bytes = body.read() if limit is None else body.read(limit)
    finally:
        body.close()
    if len(data) != expected:
        raise RetryableStorageError(
            f"S3 read of {where} returned {len(data)} of {expected} bytes; "
            "trying again may succeed"
        )
    return data


def _parse_content_range(value: str) -> tuple[int, int]:
    match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", value.strip())
    if match is None:
        raise RetryableStorageError(f"S3 sent a malformed Content-Range {value!r}")
    return int(match.group(1)), int(match.group(2))


def _check_options(sse: str | None, kms_key_id: str | None, checksum: str | None,
                   threshold: int, chunksize: int, concurrency: int, sdk_attempts: int,
                   page_size: int, addressing_style: str | None) -> None:
    problems = []
    if sse is not None and sse not in SSE_MODES:
        problems.append(f"sse must be one of {SSE_MODES} or None, not {sse!r}")
    if kms_key_id is not None and sse != "aws:kms":
        problems.append("kms_key_id needs sse='aws:kms'")
    if checksum is not None and checksum not in CHECKSUMS:
        problems.append(f"checksum must be one of {CHECKSUMS} or None, not {checksum!r}")
    if chunksize < MIN_PART_SIZE:
        problems.append(f"multipart_chunksize must be at least 5 MiB, not {chunksize}")
    if threshold < 1:
        problems.append(f"multipart_threshold must be positive, not {threshold}")
    if concurrency < 1 or sdk_attempts < 1:
        problems.append("max_concurrency and sdk_attempts must be at least 1")
    if not 1 <= page_size <= 1000:
        problems.append(f"list_page_size must be 1..1000, not {page_size}")
    if addressing_style not in (None, "auto", "path", "virtual"):
        problems.append(f"addressing_style must be 'path', 'virtual' or 'auto', "
                        f"not {addressing_style!r}")
    if problems:
        raise InvalidArgumentError("invalid S3 store options: " + "; ".join(problems))
