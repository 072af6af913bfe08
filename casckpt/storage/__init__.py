"""Blob stores: where packs and manifests live. No SQL, no LMDB here.

Backends are registered by URL scheme (:mod:`casckpt.storage.registry`).
``S3BlobStore`` (and ``parse_s3_url``, ``S3Location``) load boto3 on first
use, so importing casckpt does not need or pay for the SDK.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from casckpt.storage.base import BlobInfo, BlobStore, check_object_name
from casckpt.storage.local import LocalBlobStore
from casckpt.storage.redact import redact_url
from casckpt.storage.registry import open_blob_store
from casckpt.storage.retry import RetryingBlobStore

if TYPE_CHECKING:
    from casckpt.storage.s3 import S3BlobStore, S3Location, parse_s3_url

__all__ = [
    "BlobInfo",
    "BlobStore",
    "LocalBlobStore",
    "RetryingBlobStore",
    "S3BlobStore",
    "S3Location",
    "check_object_name",
    "open_blob_store",
    "parse_s3_url",
    "redact_url",
]

_S3_NAMES = frozenset({"S3BlobStore", "S3Location", "parse_s3_url"})


def __getattr__(name: str) -> Any:
    if name in _S3_NAMES:
        from casckpt.storage import s3

        return getattr(s3, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
