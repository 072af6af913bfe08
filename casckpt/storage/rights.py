"""Whether the credentials in use may delete objects on a blob location, found out without
deleting anything real: gc's preflight (see :mod:`casckpt.engine.deleterights`).

A local directory: every directory of the location (objects live in subdirectories) must be
writable and searchable by this process. Any other backend (S3): a delete of a probe key that
does not exist -- S3 answers a delete of a missing key with success when the right is held and
``AccessDenied`` when it is not, so nothing is removed either way.
"""

from __future__ import annotations

import os
import uuid

from casckpt.errors import AccessDeniedError
from casckpt.storage.base import BlobStore
from casckpt.storage.local import LocalBlobStore

PROBE_PREFIX = "tmp/casckpt-delete-probe-"
"""Probe keys: under ``tmp/``, where no object casckpt reads lives, with a random suffix."""


def delete_refused(blobs: BlobStore) -> AccessDeniedError | None:
    """The refusal deleting on ``blobs`` would meet (naming the missing right), or None.

    Raises:
        StorageError: the location could not be asked (unreachable): nothing is known.
    """
    local = blobs
    while not isinstance(local, LocalBlobStore) and isinstance(getattr(local, "inner", None), BlobStore):
        local = local.inner  # type: ignore[attr-defined]  # a wrapper (retry, sealed): the directory
    if isinstance(local, LocalBlobStore):
        return _local_refused(local)
    try:
        blobs.delete(PROBE_PREFIX + uuid.uuid4().hex)
    except AccessDeniedError as exc:
        return exc
    return None


def _local_refused(blobs: LocalBlobStore) -> AccessDeniedError | None:
    for top, dirs, _ in os.walk(blobs.root):
        if os.path.realpath(top) == os.path.realpath(blobs.root / "tmp"):
            dirs[:] = []
            continue
        if not os.access(top, os.W_OK | os.X_OK):
            right = f"write access to {top}"
            return AccessDeniedError(
                f"this process may not delete objects in {top} (it lacks {right}); deleting needs "
                "the admin role: run as the store's owner", right=right)
    return None
