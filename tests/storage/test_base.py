"""The helpers of the BlobStore protocol every backend shares (storage/base.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from casckpt.errors import BlobNotFoundError, InvalidArgumentError, InvalidNameError
from casckpt.storage.base import wants_bytes
from casckpt.storage.local import LocalBlobStore


def test_a_ranged_read_is_checked_once_for_every_remote_backend(tmp_path: Path) -> None:
    """``get_range``'s argument check and its probe for an empty range: what the S3 and
    Azure stores call before any request."""
    blobs = LocalBlobStore(tmp_path)
    blobs.put("packs/a", b"abc")
    assert wants_bytes(blobs, "packs/a", 0, 3, "a") and wants_bytes(blobs, "packs/a", 9, 1, "a")
    assert not wants_bytes(blobs, "packs/a", 3, 0, "a")  # empty, and the object exists
    with pytest.raises(BlobNotFoundError, match="there does not exist"):
        wants_bytes(blobs, "packs/missing", 0, 0, "there")
    for offset, length in ((-1, 1), (0, -1)):
        with pytest.raises(InvalidArgumentError, match="must be >= 0"):
            wants_bytes(blobs, "packs/a", offset, length, "a")
    with pytest.raises(InvalidNameError):
        wants_bytes(blobs, "../escape", 0, 1, "a")
