"""The ``s3://bucket/prefix`` backend's registration: options, capabilities, roles.

Imports neither boto3 nor :mod:`casckpt.storage.s3` until a location is opened.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from casckpt.config_file import INT, NUMBER, TEXT
from casckpt.storage.base import BlobStore
from casckpt.storage.iam import s3_policy
from casckpt.storage.registry import Backend, Capabilities, RoleGrants

OPTIONS: Mapping[str, str] = {
    "endpoint_url": TEXT, "region": TEXT, "profile": TEXT, "sse": TEXT, "kms_key_id": TEXT,
    "checksum": TEXT, "addressing_style": TEXT,
    "multipart_threshold": INT, "multipart_chunksize": INT, "max_concurrency": INT,
    "max_pool_connections": INT, "sdk_attempts": INT, "list_page_size": INT,
    "retry_attempts": INT, "connect_timeout": NUMBER, "read_timeout": NUMBER,
}
"""What ``s3=`` and an ``[s3]`` table may hold: :class:`~casckpt.storage.s3.S3BlobStore`'s
options, and ``retry_attempts`` for the :class:`~casckpt.storage.retry.RetryingBlobStore` around
it (5)."""


def _open(url: str, options: Mapping[str, Any], create: bool) -> BlobStore:
    from casckpt.storage.retry import RetryingBlobStore
    from casckpt.storage.s3 import S3BlobStore

    given = dict(options)
    attempts = int(given.pop("retry_attempts", 5))
    return RetryingBlobStore(S3BlobStore(url, **given), attempts=attempts)  # buckets are never made


def _grants(role: str, urls: Sequence[str]) -> RoleGrants:
    return RoleGrants("s3_policy", f"S3 IAM policy of the {role} role", s3_policy(role, urls))


BACKEND = Backend(
    scheme="s3", example="s3://bucket/prefix", open=_open, options=OPTIONS, grants=_grants,
    capabilities=Capabilities(),  # strong read-after-write, listings included, since Dec 2020
)
"""S3 and S3-compatible endpoints (:mod:`casckpt.storage.s3`)."""
