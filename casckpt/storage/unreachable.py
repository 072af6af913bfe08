"""A stand-in for a blob location this host cannot open (a removed disk, a bad URL).

Every operation raises StorageError saying why, so readers fall back to
other shards and writers to other locations, exactly as if the location
had failed mid-operation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from casckpt.errors import StorageError
from casckpt.storage.base import BlobInfo
from casckpt.storage.redact import redact_text


class UnreachableBlobStore:
    """A BlobStore that refuses everything. Thread-safe."""

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        self.reason = reason

    def _refuse(self) -> StorageError:
        return StorageError(f"blob location {redact_text(self.url)} is unreachable: "
                            f"{redact_text(self.reason)}")

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Refuse."""
        raise self._refuse()

    def put_file(self, key: str, path: Path) -> None:
        """Refuse."""
        raise self._refuse()

    def get(self, key: str, *, max_size: int | None = None) -> bytes:
        """Refuse."""
        raise self._refuse()

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Refuse."""
        raise self._refuse()

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Refuse."""
        raise self._refuse()

    def size(self, key: str) -> int | None:
        """Refuse."""
        raise self._refuse()

    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        """Refuse."""
        raise self._refuse()

    def delete(self, key: str) -> None:
        """Refuse."""
        raise self._refuse()

    def close(self) -> None:
        """Nothing to release."""
