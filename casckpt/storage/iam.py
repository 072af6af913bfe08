"""S3 IAM policies of the three roles (reader, writer, admin) for a store's buckets and prefixes.

- *reader*: ``s3:GetObject`` on the prefix's objects, ``s3:ListBucket`` limited to the prefix.
- *writer*: the reader's, plus ``s3:PutObject`` and the multipart calls a large upload makes
  (``s3:AbortMultipartUpload``, ``s3:ListMultipartUploadParts``). No ``s3:DeleteObject``: a
  commit never needs it (a pack write below quorum tries to remove what it wrote, logs the
  refusal and goes on; gc removes the leftovers).
- *admin*: the writer's, plus ``s3:DeleteObject`` (gc, repair).

Torch-free and I/O-free: it only builds the JSON document.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from casckpt.errors import InvalidArgumentError
from casckpt.storage.redact import redact_text

PLACEHOLDER_URL = "s3://BUCKET/PREFIX"
"""Used when the store has no S3 location to name."""

_OBJECT_ACTIONS = {
    "reader": ["s3:GetObject"],
    "writer": ["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"],
    "admin": ["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts",
              "s3:DeleteObject"],
}


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> ``("bucket", "a/b")``."""
    if not url.startswith("s3://") or redact_text(url) != url:
        raise InvalidArgumentError(f"{redact_text(url)!r} is not an s3://bucket/prefix URL "
                                   "(credentials never go in a location URL)")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not bucket:
        raise InvalidArgumentError(f"{url!r} names no bucket: use s3://bucket/prefix")
    return bucket, prefix.strip("/")


def s3_policy(role: str, urls: Iterable[str]) -> dict[str, Any]:
    """The IAM policy document granting ``role`` on every ``s3://`` URL among ``urls``
    (other URLs are skipped; none left: :data:`PLACEHOLDER_URL`)."""
    if role not in _OBJECT_ACTIONS:
        raise InvalidArgumentError(f"unknown role {role!r}: choose one of {', '.join(_OBJECT_ACTIONS)}")
    places = sorted({split_s3_url(u) for u in urls if u.startswith("s3://")}) or [
        split_s3_url(PLACEHOLDER_URL)]
    statements: list[dict[str, Any]] = []
    for n, (bucket, prefix) in enumerate(places):
        objects = f"arn:aws:s3:::{bucket}/{prefix}/*" if prefix else f"arn:aws:s3:::{bucket}/*"
        listing: dict[str, Any] = {"Sid": f"CasckptList{n}", "Effect": "Allow",
                                   "Action": ["s3:ListBucket"], "Resource": f"arn:aws:s3:::{bucket}"}
        if prefix:
            listing["Condition"] = {"StringLike": {"s3:prefix": [prefix, f"{prefix}/*"]}}
        statements += [{"Sid": f"CasckptObjects{n}", "Effect": "Allow",
                        "Action": list(_OBJECT_ACTIONS[role]), "Resource": objects}, listing]
    return {"Version": "2012-10-17", "Statement": statements}
