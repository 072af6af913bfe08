"""Whether the credentials in use may delete objects on a blob location, found out without
deleting anything real: gc's preflight (see :mod:`casckpt.engine.maintenance.deleterights`).

What the backend's capabilities (:class:`~casckpt.storage.registry.Capabilities`) allow:
a local directory (``local_directory``): every directory of the location (objects live in
subdirectories) must be writable and searchable by this process. A backend with
``delete_probe`` (S3, Azure): a delete of a probe key that does not exist -- such a backend
answers a delete of a missing key with success when the right is held and a refusal when it is
not, so nothing is removed either way. Neither: nothing is known before deleting.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from casckpt.errors import AccessDeniedError
from casckpt.storage.base import BlobStore
from casckpt.storage.registry import backend_for, local_path

PROBE_PREFIX = "tmp/casckpt-delete-probe-"
"""Probe keys: under ``tmp/``, where no object casckpt reads lives, with a random suffix."""


def delete_refused(blobs: BlobStore) -> AccessDeniedError | None:
    """The refusal deleting on ``blobs`` would meet (naming the missing right), or None.

    Raises:
        StorageError: the location could not be asked (unreachable): nothing is known.
    """
    root = local_path(blobs.url)
    if root is not None:
        return _local_refused(root)
    if not backend_for(blobs.url).capabilities.delete_probe:
        return None
    try:
        blobs.delete(PROBE_PREFIX + uuid.uuid4().hex)
    except AccessDeniedError as exc:
        return exc
    return None


def _local_refused(root: Path) -> AccessDeniedError | None:
    for top, dirs, _ in os.walk(root):
        if os.path.realpath(top) == os.path.realpath(root / "tmp"):
            dirs[:] = []
            continue
        if not os.access(top, os.W_OK | os.X_OK):
            right = f"write access to {top}"
            return AccessDeniedError(
                f"this process may not delete objects in {top} (it lacks {right}); deleting needs "
                "the admin role: run as the store's owner", right=right)
    return None
