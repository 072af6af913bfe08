"""Blob locations by URL."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from casckpt.errors import InvalidArgumentError
from casckpt.storage.base import BlobStore
from casckpt.storage.local import LocalBlobStore
from casckpt.storage.redact import redact_url


def open_blob_store(url: str, s3: Mapping[str, Any] | None = None, *, create: bool = True) -> BlobStore:
    """Build the blob store a URL names: ``file:///dir`` or ``s3://bucket/prefix``.

    S3 stores are wrapped in :class:`~casckpt.storage.retry.RetryingBlobStore`;
    ``s3`` holds S3BlobStore options (endpoint_url, region, sse, ...) plus
    ``retry_attempts`` for the wrapper (default 5). ``create=False``: a directory
    that does not exist is an error, not made (buckets are never made).

    Raises:
        InvalidArgumentError: an unsupported scheme.
        StorageError: ``create`` is False and the directory does not exist.
    """
    parts = urlsplit(url)
    if parts.scheme == "file":
        return LocalBlobStore(Path(unquote(parts.path)), create=create)
    if parts.scheme == "s3":
        from casckpt.storage.retry import RetryingBlobStore
        from casckpt.storage.s3 import S3BlobStore

        options = dict(s3 or {})
        attempts = int(options.pop("retry_attempts", 5))
        return RetryingBlobStore(S3BlobStore(url, **options), attempts=attempts)
    raise InvalidArgumentError(
        f"unsupported blob location {redact_url(url)!r}: use a directory, file:///path or "
        "s3://bucket/prefix"
    )
