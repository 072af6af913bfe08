"""SealedBlobStore: an encrypted store's view of one location, every object sealed.

Everything above this layer reads and writes plaintext objects; every byte that
reaches the location is sealed (:mod:`casckpt.format.crypto`: AES-256-GCM in
fixed segments, each bound to the object's key and header). Two objects stay in
the clear because a store must be recognised before its key is known: the identity
record and the key record (wrapped keys only). Sizes are reported as plaintext
sizes, so catalog sizes, listings and ranges mean what they mean in a plain store.

A range read fetches the header once per object (cached: objects are immutable
under their key, and a rewrite under the same key -- a healed shard -- is caught by
authentication and read again with a fresh header), then only the segments the
range covers, in one ranged read into a buffer the reading thread reuses, and
decrypts each into the caller's buffer its plaintext falls in, checked there (a
segment that fails is wiped before the error is raised).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

from casckpt.errors import SealedObjectError
from casckpt.format import objectnames
from casckpt.format.crypto import HEADER_SIZE, SEGMENT, SealedHead, StoreCrypto, plain_size, sealed_size
from casckpt.storage.base import BlobInfo, BlobStore, scatter
from casckpt.storage.local import full_error

CLEAR_NAMES = frozenset({objectnames.IDENTITY, objectnames.KEYS_RECORD})
"""Objects a location keeps unsealed: they say whose store it is and hold only wrapped keys."""

_HEADS = 4096


class SealedBlobStore:
    """A :class:`~casckpt.storage.BlobStore` sealing what it writes and opening what it reads."""

    def __init__(self, inner: BlobStore, crypto: StoreCrypto) -> None:
        self.inner = inner
        self.crypto = crypto
        self.url = inner.url
        self._heads: OrderedDict[str, SealedHead] = OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"SealedBlobStore({self.inner!r})"

    # -- writing --

    def put(self, key: str, data: bytes | memoryview) -> None:
        if key in CLEAR_NAMES:
            self.inner.put(key, data)
            return
        self._forget(key)
        self.inner.put(key, memoryview(self.crypto.seal(key, data)))

    def put_file(self, key: str, path: Path) -> None:
        if key in CLEAR_NAMES:
            self.inner.put_file(key, path)
            return
        self._forget(key)
        sealed_path = path.with_name(path.name + ".sealed")  # beside it: a rename away on local disks
        try:
            with open(path, "rb") as src, open(sealed_path, "wb") as dst:
                self.crypto.seal_file(key, src, os.fstat(src.fileno()).st_size, dst)
        except OSError as exc:
            sealed_path.unlink(missing_ok=True)
            raise full_error(exc, f"{key} (sealing {path})", str(path.parent), None) from exc
        try:
            self.inner.put_file(key, sealed_path)
        finally:
            sealed_path.unlink(missing_ok=True)
        path.unlink(missing_ok=True)

    def delete(self, key: str) -> None:
        self._forget(key)
        self.inner.delete(key)

    # -- reading --

    def get(self, key: str, *, max_size: int | None = None) -> bytes:
        if key in CLEAR_NAMES:
            return self.inner.get(key, max_size=max_size)
        data = self.inner.get(key, max_size=None if max_size is None else sealed_size(max_size))
        return bytes(self.crypto.open(key, data))

    def _head(self, key: str) -> SealedHead:
        with self._lock:
            head = self._heads.get(key)
            if head is not None:
                self._heads.move_to_end(key)
                return head
        head = self.crypto.head(key, self.inner.get_range(key, 0, HEADER_SIZE))
        with self._lock:
            self._heads[key] = head
            while len(self._heads) > _HEADS:
                self._heads.popitem(last=False)
        return head

    def _forget(self, key: str) -> None:
        with self._lock:
            self._heads.pop(key, None)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        if key in CLEAR_NAMES:
            return self.inner.get_range(key, offset, length)
        out = bytearray(max(0, length))
        return bytes(memoryview(out)[: self.read_into(key, offset, [memoryview(out)])])

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """The range's sealed segments are read in one ranged read into this thread's reused
        buffer, then each is decrypted straight into the buffer its plaintext falls in (or
        through a reused segment buffer, for one that straddles two) and checked there."""
        if key in CLEAR_NAMES:
            return scatter(self.inner.get_range(key, offset, sum(len(b) for b in buffers)), buffers)
        try:
            return self._read_into(key, offset, buffers)
        except SealedObjectError:  # maybe rewritten under its key since its header was cached
            self._forget(key)
            return self._read_into(key, offset, buffers)

    def _read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        head = self._head(key)
        want = sum(len(b) for b in buffers)
        if want <= 0 or offset >= head.length:
            return 0
        first, start, stop = self.crypto.segment_span(offset, want, head.length)
        scratch = _scratch(stop - start)
        body = scratch.sealed[: stop - start]
        got = self.inner.read_into(key, start, [body])
        if got != stop - start:
            raise SealedObjectError(f"object {key} is truncated: {got} of the {stop - start} "
                                    "sealed bytes a read needs are there")
        return self.crypto.open_segments_into(key, head, first, body, buffers, offset - first * SEGMENT,
                                              scratch.segment)

    def size(self, key: str) -> int | None:
        stored = self.inner.size(key)
        return stored if stored is None or key in CLEAR_NAMES else _plain(stored)

    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        for info in self.inner.list(prefix):
            yield info if info.key in CLEAR_NAMES else BlobInfo(info.key, _plain(info.size), info.mtime)

    def close(self) -> None:
        self.inner.close()


class _Scratch:
    """One thread's reused read buffers: the sealed bytes of a range, and one segment."""

    def __init__(self) -> None:
        self.sealed = memoryview(bytearray(0))
        self.segment = memoryview(bytearray(SEGMENT))


_SCRATCH = threading.local()
_KEEP_MAX = 16 << 20  # the most a thread keeps between reads (the default read_coalesce)


def _scratch(size: int) -> _Scratch:
    """This thread's scratch buffers, the sealed one at least ``size`` bytes (a range larger
    than :data:`_KEEP_MAX`, e.g. a whole shard, gets buffers of its own, not kept)."""
    if size > _KEEP_MAX:
        own = _Scratch()
        own.sealed = memoryview(bytearray(size))
        return own
    scratch: _Scratch | None = getattr(_SCRATCH, "scratch", None)
    if scratch is None:
        scratch = _SCRATCH.scratch = _Scratch()
    if len(scratch.sealed) < size:
        scratch.sealed = memoryview(bytearray(size))
    return scratch


def sealed(blobs: BlobStore, crypto: StoreCrypto) -> BlobStore:
    """``blobs`` as an encrypted store's location (as it is for a plain store, or sealed already)."""
    if not crypto.encrypted or isinstance(blobs, SealedBlobStore):
        return blobs
    return SealedBlobStore(blobs, crypto)


def _plain(stored: int) -> int:
    """A sealed object's plaintext size; a size no sealed object has is passed on as is
    (the catalog's size check then reports the object damaged)."""
    size = plain_size(stored)
    return size if size >= 0 else stored
