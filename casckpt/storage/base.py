"""The narrow BlobStore protocol every backend implements.

Keys are relative, '/'-separated, lower-case ASCII (``packs/ab/<id>``,
``manifests/<id>``). Objects are immutable once written: ``put`` of an
existing key with the same content is a no-op in effect (content addressing
makes every key's content unique), which makes retries safe.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from casckpt.errors import (
    AccessDeniedError,
    BlobNotFoundError,
    InvalidArgumentError,
    InvalidNameError,
    StorageError,
)

log = logging.getLogger(__name__)

_OBJECT_NAME = re.compile(r"^[a-z0-9_-]+(/[a-z0-9._-]+)*$")
_PREFIX_SEGMENT = re.compile(r"^[A-Za-z0-9_=+-][A-Za-z0-9._=+-]*$")
_LIST_PREFIX = re.compile(r"^[a-z0-9._/-]*$")

T = TypeVar("T")


def is_object_name(key: str) -> bool:
    """Whether ``key`` is a safe relative object name."""
    return bool(_OBJECT_NAME.match(key)) and not any(part in (".", "..") for part in key.split("/"))


def check_object_name(key: str) -> str:
    """Return ``key`` if it is a safe relative object name, else raise InvalidNameError."""
    if not is_object_name(key):
        raise InvalidNameError(f"invalid object name {key!r}: it could escape the blob location")
    return key


def location_prefix(prefix: str, url: str, service: str) -> str:
    """The key prefix of a remote location from the path of its ``url`` (given without the
    trailing '/'): ``""`` or ``prefix + "/"``.

    Raises:
        InvalidNameError: a segment is empty, ``.``/``..`` or uses characters other than
            letters, digits and ``._=+-``; or the prefix is over 512 characters.
    """
    if not prefix:
        return ""
    for segment in prefix.split("/"):
        if not _PREFIX_SEGMENT.match(segment) or segment in (".", ".."):
            raise InvalidNameError(f"invalid {service} prefix in {url!r}: segment {segment!r} is "
                                   "empty or uses characters other than letters, digits and ._=+-")
    if len(prefix) > 512:
        raise InvalidNameError(f"{service} prefix in {url!r} is too long (over 512 characters)")
    return prefix + "/"


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


class RemoteBlobStore:
    """What the stores behind a cloud SDK (S3, Azure) share: error mapping and the closed
    check around every request, scatter reads from one ranged read, and listing page by page.

    A subclass sets ``url``, ``prefix`` (its keys' prefix, ``""`` or ending in '/') and
    ``_root`` (``s3://bucket/``), and implements :meth:`_map_error`, :meth:`_pages` and
    :meth:`_entries`; it sets ``_closed`` when it is closed.
    """

    service = ""  # the service's name in messages: "S3", "Azure"
    url: str
    prefix: str
    _root: str
    _closed = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _where(self, key: str) -> str:
        return f"{self._root}{self.prefix}{key}"

    def _map_error(self, exc: Exception, op: str, where: str) -> Exception:
        """The casckpt error for what the SDK raised."""
        raise NotImplementedError

    def _pages(self, prefix: str) -> Iterator[Any]:
        """The listing's pages of the objects whose full names start with ``prefix``."""
        raise NotImplementedError

    def _entries(self, page: Any) -> list[tuple[str, int, float]]:
        """A page's objects: full name, size, modification time."""
        raise NotImplementedError

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run ``fn``, mapping whatever the SDK raises into casckpt errors (a refused request
        into :class:`~casckpt.errors.AccessDeniedError`, which is not a ``StorageError``)."""
        if self._closed:
            raise StorageError(f"{self.service} {op} of {self._where(key)}: the store is closed")
        try:
            return fn()
        except (StorageError, AccessDeniedError):
            raise
        except Exception as exc:
            raise self._map_error(exc, op, self._where(key)) from exc

    def _unless_missing(self, op: str, key: str, fn: Callable[[], T], missing: T) -> T:
        """``fn`` as :meth:`_call` runs it, but ``missing`` when it finds no object ``key``."""
        def attempt() -> T:
            try:
                return fn()
            except Exception as exc:
                if isinstance(self._map_error(exc, op, self._where(key)), BlobNotFoundError):
                    return missing
                raise

        return self._call(op, key, attempt)

    def _file_size(self, key: str, path: Path) -> int:
        """The size of the file ``path`` about to be uploaded under ``key`` (checked first)."""
        check_object_name(key)
        try:
            return os.stat(path).st_size
        except OSError as exc:
            raise StorageError(f"cannot upload {path} to {self._where(key)}: {exc}") from exc

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        raise NotImplementedError

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """One ranged read covering the buffers, scattered into them."""
        return scatter(self.get_range(key, offset, sum(len(b) for b in buffers)), buffers)

    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        """Yield the objects whose keys start with ``prefix``, page by page.

        Objects under the location whose names are not valid keys (not written by casckpt)
        are skipped.
        """
        if (not _LIST_PREFIX.match(prefix) or prefix.startswith("/") or "//" in prefix
                or ".." in prefix.split("/")):
            raise InvalidNameError(f"invalid listing prefix {prefix!r}")
        pages = self._call("list", prefix, lambda: self._pages(self.prefix + prefix))
        while True:
            page = self._call("list", prefix, lambda: next(pages, None))
            if page is None:
                return
            for name, size, mtime in self._call("list", prefix, partial(self._entries, page)):
                key = name[len(self.prefix):]
                if is_object_name(key):
                    yield BlobInfo(key, size, mtime)
                else:
                    log.debug("skipping foreign object %s in the listing", self._where(key))
