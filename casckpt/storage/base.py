"""The narrow BlobStore protocol every backend implements.

Keys are relative, '/'-separated, lower-case ASCII (``packs/ab/<id>``,
``manifests/<id>``). Objects are immutable once written: ``put`` of an
existing key with the same content is a no-op in effect (content addressing
makes every key's content unique), which makes retries safe.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from casckpt.errors import BlobNotFoundError, InvalidArgumentError, InvalidNameError

_OBJECT_NAME = re.compile(r"^[a-z0-9_-]+(/[a-z0-9._-]+)*$")


def is_object_name(key: str) -> bool:
    """Whether ``key`` is a safe relative object name."""
    return bool(_OBJECT_NAME.match(key)) and not any(part in (".", "..") for part in key.split("/"))


def check_object_name(key: str) -> str:
    """Return ``key`` if it is a safe relative object name, else raise InvalidNameError."""
    if not is_object_name(key):
        raise InvalidNameError(f"invalid object name {key!r}: it could escape the blob location")
    return key


def wants_bytes(blobs: BlobStore, key: str, offset: int, length: int, where: str) -> bool:
    """Check a ``get_range`` of a remote store: whether it asks for any bytes (an empty range
    needs no ranged request: the object's existence is probed with ``size``). ``where``
    names the object in messages.

    Raises:
        InvalidNameError: ``key`` is not a safe object name.
        InvalidArgumentError: ``offset`` or ``length`` is negative.
        BlobNotFoundError: an empty range of an object that does not exist.
    """
    check_object_name(key)
    if offset < 0 or length < 0:
        raise InvalidArgumentError(
            f"get_range of {key}: offset and length must be >= 0, not {offset}, {length}")
    if length == 0 and blobs.size(key) is None:
        raise BlobNotFoundError(f"{where} does not exist")
    return length > 0


def scatter(data: bytes | memoryview, buffers: Sequence[memoryview]) -> int:
    """Copy ``data`` into ``buffers`` in order; returns the bytes copied."""
    done = 0
    for buf in buffers:
        part = data[done : done + len(buf)]
        buf[: len(part)] = part
        done += len(part)
        if len(part) < len(buf):
            break
    return done


@dataclass(frozen=True, slots=True)
class BlobInfo:
    """One object in a listing."""

    key: str
    size: int
    mtime: float


@runtime_checkable
class BlobStore(Protocol):
    """Immutable object storage for packs and manifests.

    Implementations are thread-safe: the engine calls them from its I/O pool.
    Every method raises :class:`~casckpt.errors.StorageError` (or
    ``BlobNotFoundError`` for a missing key) and nothing else, but for a
    request refused for want of a right, which raises
    :class:`~casckpt.errors.AccessDeniedError` (not a ``StorageError``: a
    refused listing or read is never taken for an unreachable location or a
    missing object); a write that found no room (disk full, quota, file-size
    limit) raises ``StorageFullError`` and leaves nothing visible. No read blocks on or
    opens what is not an object (``UnsafeObjectError``).
    """

    url: str

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Store ``data`` under ``key`` durably and atomically (all or nothing)."""

    def put_file(self, key: str, path: Path) -> None:
        """Store the finished local file ``path`` under ``key``; ``path`` may be consumed."""

    def get(self, key: str, *, max_size: int | None = None) -> bytes:
        """Return the whole object.

        ``max_size`` bounds the memory a read may take: an object larger than
        that raises :class:`~casckpt.errors.OversizedObjectError` before its
        bytes are read (pass the size the catalog records).
        """

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Return ``length`` bytes from ``offset`` (fewer if the object is shorter)."""

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Fill ``buffers`` in order with the bytes from ``offset``; returns the bytes read.

        A scatter read: restore reads chunk payloads straight into the
        destination tensors. Fewer bytes than the buffers hold means the
        object ended. Backends without a native form use :func:`scatter`.
        """

    def size(self, key: str) -> int | None:
        """Return the object's size, or None if there is no such object."""

    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        """Yield every object whose key starts with ``prefix``."""

    def delete(self, key: str) -> None:
        """Remove the object; a missing key is not an error."""

    def close(self) -> None:
        """Release clients and file handles."""
