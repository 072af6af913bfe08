"""Store encryption: master keys, wrapped data keys, keyed ids and sealed objects (no I/O).

An encrypted store has one random 32-byte **data key**. It never leaves memory
unwrapped: the store's **key record** holds it wrapped (AES-256-GCM) under each of
one or more **master keys**, one *slot* per master key; a master key is 32 random
bytes in a key file the user keeps (``casckpt key generate``). Adding, removing or
rotating a master key rewrites the key record only, never data.

Four subkeys are derived from the data key (BLAKE3 derive-key mode, one context
each): the **id key** makes chunk ids keyed hashes (:meth:`StoreCrypto.chunk_id`),
so an id says nothing to anyone without the key and the same tensor has unrelated
ids in two stores; the **name key** hashes tag and run names into object names; the
**file key** keys the whole-file digests of directory snapshots (:meth:`StoreCrypto.file_hasher`);
the **seal key** encrypts objects.

A **sealed object** (:meth:`StoreCrypto.seal`) is::

    header   b"CKSEAL01" + salt (32 random bytes) + u64 plaintext length + u32 segment size
    segment  AES-256-GCM ciphertext of up to SEGMENT plaintext bytes + 16-byte tag, repeated

Each object is encrypted under its own key, BLAKE3(salt) keyed with the seal key, with
segment ``i`` under nonce ``i``: a random 256-bit salt per object, so no (key, nonce)
pair is ever used twice. Every segment authenticates the object's key (its name on
the location), the whole header and its index, so an object renamed or swapped for
another, a header edited, a segment moved, dropped or cut short, all fail to open:
:class:`~casckpt.errors.SealedObjectError`, never wrong bytes. Fixed segments let a
range of a pack be read and checked without reading the whole object.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

from blake3 import blake3

from casckpt.errors import (
    InvalidArgumentError,
    KeyRequiredError,
    SealedObjectError,
    StoreKeyError,
    WrongKeyError,
)
from casckpt.format.chunks import chunk_id

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

# cryptography is imported where it is used: opening a plain store (and the catalog-only CLI)
# never pays for it


def _aesgcm(key: bytes) -> AESGCM:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key)


def _invalid_tag() -> type[Exception]:
    from cryptography.exceptions import InvalidTag

    return InvalidTag

KEY_BYTES = 32
KEY_FILE_PREFIX = "casckpt-key-v1:"
SCHEME = "aes-256-gcm/blake3-keyed/v1"
SEGMENT = 256 << 10
SEAL_MAGIC = b"CKSEAL01"
_HEAD = struct.Struct("<8s32sQI")
HEADER_SIZE = _HEAD.size
TAG_SIZE = 16
_ID_CONTEXT = "casckpt 2026-12-02 keyed chunk id v1"
_NAME_CONTEXT = "casckpt 2026-12-02 keyed object name v1"
_SEAL_CONTEXT = "casckpt 2026-12-02 seal key v1"
_WRAP_CONTEXT = "casckpt 2026-12-02 key wrapping v1"
_KEY_ID_CONTEXT = "casckpt 2026-12-02 master key id v1"
_FILE_CONTEXT = "casckpt 2026-12-02 keyed file digest v1"
_STATE_CONTEXT = "casckpt 2026-12-06 data key fingerprint v1"
_AAD = b"casckpt sealed object v1\0"
_WRAP_AAD = b"casckpt data key v1\0"


def _derive(context: str, key: bytes) -> bytes:
    return blake3(key, derive_key_context=context).digest()


STATE_PLAIN = "plain"
STATE_SEALED = "sealed"


def encryption_state(data_key: bytes | None) -> str:
    """What the catalog records of a store's encryption (its ``encryption`` row):
    :data:`STATE_PLAIN`, or :data:`STATE_SEALED`, a colon and a one-way fingerprint of the data
    key, so a writer's data key and its store's compare without either being revealed."""
    if data_key is None:
        return STATE_PLAIN
    return f"{STATE_SEALED}:{_derive(_STATE_CONTEXT, data_key).hex()[:32]}"


# -- master keys -------------------------------------------------------------------------


def new_master_key() -> bytes:
    """32 random bytes from the operating system's CSPRNG."""
    return os.urandom(KEY_BYTES)


def key_file_text(key: bytes) -> str:
    """What a key file holds: a versioned prefix and the key in base64, one line."""
    return KEY_FILE_PREFIX + base64.b64encode(key).decode("ascii") + "\n"


def parse_key_file(text: str, where: str) -> bytes:
    """The master key a key file's text holds.

    Raises:
        StoreKeyError: not a casckpt key file (names ``where``).
    """
    line = text.strip()
    if not line.startswith(KEY_FILE_PREFIX):
        raise StoreKeyError(f"{where} is not a casckpt key file (it must start with "
                            f"{KEY_FILE_PREFIX!r}); make one with `casckpt key generate FILE`")
    try:
        key = base64.b64decode(line[len(KEY_FILE_PREFIX):], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise StoreKeyError(f"{where} is damaged: its key is not base64 ({exc})") from exc
    if len(key) != KEY_BYTES:
        raise StoreKeyError(f"{where} is damaged: it holds {len(key)} key bytes, not {KEY_BYTES}")
    return key


def key_id(master: bytes) -> str:
    """A master key's public name (16 hex digits): it identifies the key, reveals nothing of it."""
    return _derive(_KEY_ID_CONTEXT, master).hex()[:16]


# -- the key record -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeySlot:
    """The data key wrapped under one master key."""

    id: str
    wrapped: bytes
    created_at: float
    created_by: str

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "wrapped": base64.b64encode(self.wrapped).decode("ascii"),
                "created_at": self.created_at, "created_by": self.created_by}


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """An encrypted store's key slots (kept in the catalog and on every location)."""

    store_id: str
    slots: tuple[KeySlot, ...]
    scheme: str = SCHEME

    def to_json(self) -> dict[str, Any]:
        return {"format": "casckpt-keys", "version": 1, "scheme": self.scheme,
                "store": self.store_id, "slots": [s.to_json() for s in self.slots]}

    @classmethod
    def from_json(cls, doc: object, where: str) -> KeyRecord:
        """Parse a key record, every field checked.

        Raises:
            StoreKeyError: malformed, or a scheme this casckpt does not know.
        """
        try:
            if not isinstance(doc, dict) or doc.get("format") != "casckpt-keys" or doc.get("version") != 1:
                raise ValueError("not a casckpt key record")
            if doc.get("scheme") != SCHEME:
                raise ValueError(f"encryption scheme {doc.get('scheme')!r} is not one this casckpt "
                                 f"knows ({SCHEME}); upgrade casckpt")
            store, raw_slots = doc["store"], doc["slots"]
            if not isinstance(store, str) or not isinstance(raw_slots, list) or not raw_slots:
                raise ValueError("no store id or no key slots")
            slots = []
            for s in raw_slots:
                if not isinstance(s, dict) or not isinstance(s.get("id"), str) or not isinstance(
                        s.get("created_by"), str) or not isinstance(s.get("created_at"), (int, float)):
                    raise ValueError("a malformed key slot")
                slots.append(KeySlot(s["id"], base64.b64decode(s["wrapped"], validate=True),
                                     float(s["created_at"]), s["created_by"]))
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise StoreKeyError(f"the key record {where} is damaged or foreign: {exc}") from exc
        return cls(store, tuple(slots))

    def slot(self, kid: str) -> KeySlot | None:
        return next((s for s in self.slots if s.id == kid), None)


def _wrap_aad(store_id: str, kid: str) -> bytes:
    return _WRAP_AAD + store_id.encode() + b"\0" + kid.encode()


def wrap(data_key: bytes, master: bytes, store_id: str, created_by: str) -> KeySlot:
    """A slot holding ``data_key`` wrapped under ``master`` (bound to the store and the key id)."""
    kid = key_id(master)
    nonce = os.urandom(12)
    cipher = _aesgcm(_derive(_WRAP_CONTEXT, master))
    wrapped = nonce + cipher.encrypt(nonce, data_key, _wrap_aad(store_id, kid))
    return KeySlot(kid, wrapped, time.time(), created_by)


def unwrap(record: KeyRecord, master: bytes) -> bytes:
    """The data key, unwrapped with ``master``.

    Raises:
        WrongKeyError: ``master`` opens none of the record's slots.
    """
    kid = key_id(master)
    slot = record.slot(kid)
    if slot is not None and len(slot.wrapped) == 12 + KEY_BYTES + TAG_SIZE:
        try:
            return _aesgcm(_derive(_WRAP_CONTEXT, master)).decrypt(
                slot.wrapped[:12], slot.wrapped[12:], _wrap_aad(record.store_id, kid))
        except _invalid_tag():
            pass
    raise WrongKeyError(
        f"the key given (id {kid}) is not one of this store's keys (its keys: "
        f"{', '.join(s.id for s in record.slots)}); pass a key file that was added to it "
        "(`casckpt key list` shows the ids)")


# -- keyed ids and sealed objects ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SealedHead:
    """What a sealed object's header says: its salt and plaintext length."""

    salt: bytes
    length: int
    raw: bytes

    @property
    def segments(self) -> int:
        return max(1, -(-self.length // SEGMENT))


def sealed_size(length: int) -> int:
    """Bytes a sealed object of ``length`` plaintext bytes takes."""
    return HEADER_SIZE + length + TAG_SIZE * max(1, -(-length // SEGMENT))


def plain_size(stored: int) -> int:
    """The plaintext length of a sealed object of ``stored`` bytes (-1: no sealed object is)."""
    body = stored - HEADER_SIZE
    if body < TAG_SIZE:
        return -1
    n = -(-body // (SEGMENT + TAG_SIZE))
    length = body - TAG_SIZE * n
    return length if sealed_size(length) == stored else -1


class StoreCrypto:
    """One store's encryption: keyed ids and sealed objects; :data:`PLAIN` for a store without.

    Thread-safe (immutable; AESGCM objects are made per object).
    """

    def __init__(self, data_key: bytes | None, opened_with: str | None = None) -> None:
        if data_key is not None and len(data_key) != KEY_BYTES:
            raise InvalidArgumentError(f"a data key is {KEY_BYTES} bytes, got {len(data_key)}")
        self.encrypted = data_key is not None
        self.opened_with = opened_with  # the id of the master key that unlocked it
        self._data_key = data_key
        self._id_key = _derive(_ID_CONTEXT, data_key) if data_key else b""
        self._name_key = _derive(_NAME_CONTEXT, data_key) if data_key else b""
        self._seal_key = _derive(_SEAL_CONTEXT, data_key) if data_key else b""
        self._file_key = _derive(_FILE_CONTEXT, data_key) if data_key else b""
        self.state = encryption_state(data_key)

    def __repr__(self) -> str:
        return "StoreCrypto(encrypted)" if self.encrypted else "StoreCrypto(plain)"

    def wrap_for(self, master: bytes, store_id: str, created_by: str) -> KeySlot:
        """A key slot letting ``master`` unlock this store too."""
        if self._data_key is None:
            raise InvalidArgumentError("a store without encryption has no data key to wrap")
        return wrap(self._data_key, master, store_id, created_by)

    # -- ids --

    def chunk_id(self, data: bytes | memoryview) -> bytes:
        """The 32-byte id of a chunk's raw bytes: keyed BLAKE3 when encrypted, else
        :func:`casckpt.format.chunks.chunk_id`."""
        if not self.encrypted:
            return chunk_id(data)
        return blake3(data, key=self._id_key).digest()

    def name_hash(self, name: bytes) -> str | None:
        """A keyed hash (hex) naming ``name`` in object names; None for a plain store."""
        return blake3(name, key=self._name_key).hexdigest() if self.encrypted else None

    def file_hasher(self, size: int = 0) -> blake3:
        """A hasher of a whole file of ``size`` bytes for a directory snapshot's digest: keyed
        when encrypted (the digests sit in the catalog, which must not let anyone test whether
        the store holds a file they know), plain BLAKE3 otherwise. Threads for 8 MiB and up."""
        threads = blake3.AUTO if size >= 8 << 20 else 1
        if self.encrypted:
            return blake3(key=self._file_key, max_threads=threads)
        return blake3(max_threads=threads)

    # -- sealing --

    def _cipher(self, salt: bytes) -> AESGCM:
        return _aesgcm(blake3(salt, key=self._seal_key).digest())

    @staticmethod
    def _aad(key: str, head: bytes, index: int) -> bytes:
        return _AAD + key.encode() + b"\0" + head + index.to_bytes(8, "little")

    def seal(self, key: str, data: bytes | memoryview) -> bytearray:
        """``data`` sealed as the object ``key`` (see the module docstring)."""
        view = memoryview(data).cast("B")
        salt = os.urandom(32)
        head = _HEAD.pack(SEAL_MAGIC, salt, len(view), SEGMENT)
        out = bytearray(sealed_size(len(view)))
        out[:HEADER_SIZE] = head
        cipher, target = self._cipher(salt), memoryview(out)
        at = HEADER_SIZE
        for i in range(max(1, -(-len(view) // SEGMENT))):
            part = view[i * SEGMENT : (i + 1) * SEGMENT]
            cipher.encrypt_into(i.to_bytes(12, "little"), part, self._aad(key, head, i),
                                target[at : at + len(part) + TAG_SIZE])
            at += len(part) + TAG_SIZE
        return out

    def seal_file(self, key: str, src: io.BufferedIOBase, length: int, dst: BinaryIO) -> None:
        """Write the ``length`` bytes read from ``src`` to ``dst`` sealed as the object ``key``:
        the same format as :meth:`seal`, one segment at a time through two reused buffers
        (a whole pack in memory, twice, cost more than AES-GCM itself).

        Raises:
            OSError: reading or writing failed, or ``src`` ended before ``length`` bytes.
        """
        salt = os.urandom(32)
        head = _HEAD.pack(SEAL_MAGIC, salt, length, SEGMENT)
        dst.write(head)
        cipher = self._cipher(salt)
        plain, sealed = memoryview(bytearray(SEGMENT)), memoryview(bytearray(SEGMENT + TAG_SIZE))
        for i in range(max(1, -(-length // SEGMENT))):
            size = min(SEGMENT, length - i * SEGMENT)
            got = 0
            while got < size:
                n = src.readinto(plain[got:size])
                if not n:
                    raise OSError(f"the file ended after {i * SEGMENT + got} of its {length} bytes "
                                  "while it was being sealed")
                got += n
            cipher.encrypt_into(i.to_bytes(12, "little"), plain[:size], self._aad(key, head, i),
                                sealed[: size + TAG_SIZE])
            dst.write(sealed[: size + TAG_SIZE])

    def head(self, key: str, data: bytes | memoryview) -> SealedHead:
        """Parse a sealed object's header (its first :data:`HEADER_SIZE` bytes).

        Raises:
            SealedObjectError: not a sealed object (a plaintext object in an encrypted store, or damage).
        """
        raw = bytes(data[:HEADER_SIZE])
        if len(raw) < HEADER_SIZE or raw[:8] != SEAL_MAGIC:
            raise SealedObjectError(f"object {key} is not sealed with this store's encryption (damaged, "
                                   "or written without encryption): it is refused unread")
        _, salt, length, segment = _HEAD.unpack(raw)
        if segment != SEGMENT:
            raise SealedObjectError(f"object {key} is sealed in {segment}-byte segments, not {SEGMENT}: "
                                   "damaged or written by another casckpt")
        return SealedHead(salt, length, raw)

    def segment_opener(self, key: str, head: SealedHead) -> Callable[[int, memoryview, memoryview], None]:
        """``open_one(index, sealed, into)``: decrypt and check segment ``index`` of the object
        ``key`` (its sealed bytes, tag included) into ``into`` (exactly its plaintext size).

        ``into`` may hold unauthenticated bytes when ``open_one`` raises: callers discard it.

        Raises (from ``open_one``):
            SealedObjectError: the segment fails authentication.
        """
        cipher, invalid = self._cipher(head.salt), _invalid_tag()

        def open_one(index: int, sealed: memoryview, into: memoryview) -> None:
            try:
                cipher.decrypt_into(index.to_bytes(12, "little"), sealed, self._aad(key, head.raw, index),
                                    into)
            except invalid:
                raise SealedObjectError(
                    f"object {key} fails authentication (segment {index}): it was altered, swapped "
                    "or damaged, or sealed with another key; its bytes are refused. Run `casckpt "
                    "check --read-data`, then `casckpt repair`") from None

        return open_one

    def open_segments_into(self, key: str, head: SealedHead, first: int, body: bytes | memoryview,
                           buffers: Sequence[memoryview], skip: int = 0,
                           scratch: memoryview | None = None) -> int:
        """Decrypt and check the consecutive segments from index ``first`` in ``body`` (their
        sealed bytes, the last one possibly the object's short last segment), writing their
        plaintext from byte ``skip`` of the first on into ``buffers`` in order, until the
        buffers are full or ``body`` ends; returns the bytes written.

        A segment whose plaintext falls whole inside one buffer is decrypted there; the others
        are decrypted into ``scratch`` (:data:`SEGMENT` bytes, reused by a caller that reads
        many ranges) and copied out from it while it is in cache. No buffer the size of the
        range is made.

        Raises:
            SealedObjectError: a segment fails authentication or is cut short (what it was
                decrypted into is zeroed first: no unauthenticated byte reaches a buffer).
        """
        view = memoryview(body).cast("B")
        buffers = [b for b in buffers if len(b)]
        open_one = self.segment_opener(key, head)
        at, index, written, slot, filled = 0, first, 0, 0, 0  # buffers[slot][:filled] is written
        while at < len(view):  # every segment in body is authenticated, wanted or not
            if slot < len(buffers) and filled == len(buffers[slot]):
                slot, filled = slot + 1, 0
            plain = min(SEGMENT, head.length - index * SEGMENT)
            end = at + plain + TAG_SIZE
            if plain < 0 or end > len(view) or index >= head.segments:
                raise SealedObjectError(f"object {key} is truncated or longer than its header says")
            dst = buffers[slot] if slot < len(buffers) else None
            if dst is not None and skip == 0 and len(dst) - filled >= plain:
                try:
                    open_one(index, view[at:end], dst[filled : filled + plain])
                except SealedObjectError:
                    dst[filled : filled + plain] = bytes(plain)  # no unauthenticated byte is left
                    raise
                filled += plain
                written += plain
            else:
                if scratch is None:
                    scratch = memoryview(bytearray(SEGMENT))
                open_one(index, view[at:end], scratch[:plain])
                src, skip = scratch[skip:plain], 0
                while len(src) and slot < len(buffers):
                    n = min(len(src), len(buffers[slot]) - filled)
                    buffers[slot][filled : filled + n] = src[:n]
                    src, filled, written = src[n:], filled + n, written + n
                    if filled == len(buffers[slot]):
                        slot, filled = slot + 1, 0
            at, index = end, index + 1
        return written

    def open(self, key: str, data: bytes | memoryview) -> bytearray:
        """The plaintext of a whole sealed object ``key``.

        Raises:
            SealedObjectError: not sealed, altered, truncated or extended.
        """
        head = self.head(key, data)
        if len(data) != sealed_size(head.length):
            raise SealedObjectError(f"object {key} is {len(data)} bytes, its header says "
                                   f"{sealed_size(head.length)}: truncated or extended")
        out = bytearray(head.length)
        self.open_segments_into(key, head, 0, memoryview(data)[HEADER_SIZE:], [memoryview(out)])
        return out

    @staticmethod
    def segment_span(offset: int, length: int, total: int) -> tuple[int, int, int]:
        """``(first segment, sealed start, sealed end)`` of the segments holding
        ``[offset, offset + length)`` of a ``total``-byte plaintext (clipped to it)."""
        end = min(offset + length, total)
        first = offset // SEGMENT
        last = max(first, (end - 1) // SEGMENT) if end > offset else first
        start = HEADER_SIZE + first * (SEGMENT + TAG_SIZE)
        stop = min(HEADER_SIZE + (last + 1) * (SEGMENT + TAG_SIZE), sealed_size(total))
        return first, start, stop


PLAIN = StoreCrypto(None)


def unlock(record: KeyRecord | None, master: bytes | None) -> StoreCrypto:
    """The crypto of a store whose key record is ``record`` (None: not encrypted), unlocked
    with the master key ``master``.

    Raises:
        KeyRequiredError: the store is encrypted and no key was given.
        WrongKeyError: ``master`` opens none of the record's slots.
    """
    if record is None:
        return PLAIN
    if master is None:
        raise KeyRequiredError(
            "this store is encrypted: open it with its key file (casckpt.open(path, key_file=FILE), "
            "CASCKPT_KEY_FILE=FILE, or `casckpt --key-file FILE ...`)")
    return StoreCrypto(unwrap(record, master), key_id(master))
