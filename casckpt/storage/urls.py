"""Blob locations by URL, and URL redaction for messages."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from casckpt.errors import InvalidArgumentError
from casckpt.storage.base import BlobStore
from casckpt.storage.local import LocalBlobStore


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


_URL_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


def redact_text(text: str) -> str:
    """Every ``scheme://user:secret@`` in ``text`` -> ``scheme://***@`` (for messages that quote URLs)."""
    return _URL_USERINFO.sub("***@", text)


def redact_url(url: str) -> str:
    """``scheme://user:secret@host/db`` -> ``scheme://***@host/db`` (for messages and logs)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return scheme + sep + netloc + slash + tail
