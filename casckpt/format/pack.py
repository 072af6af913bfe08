"""The pack format: many encoded chunks in one immutable object.

Byte format (all integers little-endian)::

    file header   24 bytes  b"CKPACK02" + 16 random bytes (a nonce)
    entry * n     ENTRY_HEADER (92 bytes) + payload (stored_len bytes)
    footer        b"CIDX" + u64 count + n * FOOTER_RECORD (90 bytes)
    trailer       u64 footer_len + 16-byte BLAKE3 of the footer + b"CKPEND01"

Each entry header carries the chunk id, codec, raw and stored lengths, the
delta base id (zeros when none) and a CRC32 of itself, so a pack can be read
by range through its footer, or its index rebuilt by scanning when the footer
is lost. A pack's id is the BLAKE3 (object context) of all its bytes; the
nonce makes every pack unique, so two writers (or a writer and a GC deleting
an old pack) never race on one object name, while a retried upload of the same
pack still writes the same bytes.

This module reads and writes bytes; it knows nothing of where packs live.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from blake3 import blake3

from casckpt.errors import CorruptChunkError, CorruptPackError, InvalidArgumentError
from casckpt.format.chunks import ChunkIds, chunk_id, object_hasher
from casckpt.format.codecs import decode_chunk

PACK_MAGIC = b"CKPACK02"
NONCE_SIZE = 16
PACK_HEADER_SIZE = len(PACK_MAGIC) + NONCE_SIZE
ENTRY_MAGIC = b"CCHK"
FOOTER_MAGIC = b"CIDX"
TRAILER_MAGIC = b"CKPEND01"
_NO_BASE = bytes(32)

_ENTRY = struct.Struct("<4sBBH32sQQ32s")
ENTRY_HEADER_SIZE = _ENTRY.size + 4  # + CRC32
_FOOTER_HEAD = struct.Struct("<4sQ")
_FOOTER_RECORD = struct.Struct("<32sQQQBB32s")
_TRAILER = struct.Struct("<Q16s8s")
TRAILER_SIZE = _TRAILER.size
_FLAG_BASE = 1
MAX_FOOTER = 64 << 20  # ~745,000 entries: far past any pack casckpt writes; a larger one is forged


@dataclass(frozen=True, slots=True)
class PackEntry:
    """Where one encoded chunk sits in a pack.

    ``offset`` is the byte offset of the entry header; the entry occupies
    ``ENTRY_HEADER_SIZE + stored_len`` bytes from there.
    """

    chunk_id: bytes
    offset: int
    stored_len: int
    raw_len: int
    codec: int
    base_id: bytes | None = None

    @property
    def span(self) -> int:
        """Bytes the entry occupies, header included."""
        return ENTRY_HEADER_SIZE + self.stored_len


def encode_entry_header(entry: PackEntry) -> bytes:
    """Return the 92-byte header that precedes a chunk payload in a pack."""
    flags = _FLAG_BASE if entry.base_id else 0
    head = _ENTRY.pack(
        ENTRY_MAGIC, entry.codec, flags, 0, entry.chunk_id,
        entry.raw_len, entry.stored_len, entry.base_id or _NO_BASE,
    )
    return head + struct.pack("<I", zlib.crc32(head))


def decode_entry_header(data: bytes | memoryview, offset: int) -> PackEntry:
    """Parse and check an entry header found at ``offset``.

    Raises:
        CorruptPackError: wrong magic, bad CRC, or truncated header.
    """
    raw = bytes(data[:ENTRY_HEADER_SIZE])
    if len(raw) < ENTRY_HEADER_SIZE:
        raise CorruptPackError(f"chunk header at offset {offset} is truncated")
    head, (crc,) = raw[: _ENTRY.size], struct.unpack("<I", raw[_ENTRY.size :])
    magic, codec, flags, _, cid, raw_len, stored_len, base = _ENTRY.unpack(head)
    if magic != ENTRY_MAGIC or zlib.crc32(head) != crc:
        raise CorruptPackError(f"chunk header at offset {offset} is damaged (magic or CRC)")
    return PackEntry(cid, offset, stored_len, raw_len, codec, base if flags & _FLAG_BASE else None)


def decode_entry(data: bytes | memoryview, expected: PackEntry, pack_id: str,
                 base: bytes | memoryview | None = None, *, ids: ChunkIds = chunk_id) -> bytes | memoryview:
    """Decode the entry ``data`` (header + payload) and verify it against ``expected``.

    Returns the chunk's raw bytes, verified to hash to ``expected.chunk_id`` (by ``ids``:
    the store's chunk ids, keyed in an encrypted store).

    Raises:
        CorruptChunkError: the header disagrees with the index, the payload does
            not decode, or the bytes do not hash to the chunk id.
    """
    view = memoryview(data)
    return decode_split_entry(
        view[:ENTRY_HEADER_SIZE], view[ENTRY_HEADER_SIZE : ENTRY_HEADER_SIZE + expected.stored_len],
        expected, pack_id, base, ids=ids,
    )


def decode_split_entry(header_bytes: bytes | memoryview, payload: bytes | memoryview,
                       expected: PackEntry, pack_id: str,
                       base: bytes | memoryview | None = None, *, verify: bool = True,
                       ids: ChunkIds = chunk_id) -> bytes | memoryview:
    """:func:`decode_entry` for a header and payload read into separate buffers.

    A RAW payload is verified where it lies and returned as is, so a reader
    that read it straight into its destination copies nothing. A delta entry
    needs its base chunk's raw bytes (``base``), and must name the base
    ``expected`` names (when it names one). ``verify=False`` skips only the
    hash of the result, for a caller that verifies what it is used for.
    """
    cid_hex = expected.chunk_id.hex()
    header = check_entry_header(header_bytes, expected, pack_id)
    try:
        if len(payload) != header.stored_len:
            raise CorruptChunkError("payload is truncated")
        raw = decode_chunk(header.codec, payload, header.raw_len, base)
    except CorruptChunkError as exc:
        raise CorruptChunkError(
            f"chunk {cid_hex} in pack {pack_id} is corrupt: {exc}", pack_id=pack_id, chunk_id=cid_hex
        ) from exc
    if verify and ids(raw) != expected.chunk_id:
        raise CorruptChunkError(
            f"chunk {cid_hex} in pack {pack_id} (offset {expected.offset}) does not match its id: "
            "the stored bytes are corrupt. Restore another version or repair the store.",
            pack_id=pack_id, chunk_id=cid_hex,
        )
    return raw


def check_entry_header(header_bytes: bytes | memoryview, expected: PackEntry, pack_id: str) -> PackEntry:
    """Parse an entry header read separately and check it describes the ``expected`` entry.

    Raises:
        CorruptChunkError: the header is damaged or describes another chunk.
    """
    cid_hex = expected.chunk_id.hex()
    try:
        header = decode_entry_header(header_bytes, expected.offset)
    except CorruptPackError as exc:
        raise CorruptChunkError(
            f"chunk {cid_hex} in pack {pack_id}: {exc}", pack_id=pack_id, chunk_id=cid_hex
        ) from exc
    if (header.chunk_id, header.stored_len, header.raw_len, header.codec) != (
        expected.chunk_id, expected.stored_len, expected.raw_len, expected.codec
    ) or (expected.base_id is not None and header.base_id != expected.base_id):
        raise CorruptChunkError(
            f"chunk {cid_hex} in pack {pack_id}: header at offset {expected.offset} describes "
            "another chunk; the pack or the catalog is damaged. Run `casckpt check --read-data`.",
            pack_id=pack_id, chunk_id=cid_hex,
        )
    return header


class PackWriter:
    """Streams encoded chunks into a pack on ``sink``, hashing as it goes.

    Call order: :meth:`add` any number of times, then :meth:`finish` once.
    Not thread-safe.
    """

    def __init__(self, sink: BinaryIO, nonce: bytes | None = None) -> None:
        """``nonce`` (16 bytes) is random unless given (golden tests)."""
        self._sink = sink
        self._hasher = object_hasher()
        self._entries: list[PackEntry] = []
        self._size = 0
        nonce = os.urandom(NONCE_SIZE) if nonce is None else nonce
        if len(nonce) != NONCE_SIZE:
            raise InvalidArgumentError(f"a pack nonce is {NONCE_SIZE} bytes, got {len(nonce)}")
        self._write(PACK_MAGIC + nonce)

    def _write(self, data: bytes | memoryview) -> None:
        self._sink.write(data)
        self._hasher.update(data)
        self._size += len(data)

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._size

    @property
    def entries(self) -> list[PackEntry]:
        """Entries added so far, in order."""
        return list(self._entries)

    def add(
        self, cid: bytes, codec: int, raw_len: int, payload: bytes | memoryview,
        base_id: bytes | None = None,
    ) -> PackEntry:
        """Append one encoded chunk; returns where it sits."""
        entry = PackEntry(cid, self._size, len(payload), raw_len, int(codec), base_id)
        self._write(encode_entry_header(entry))
        self._write(payload)
        self._entries.append(entry)
        return entry

    def finish(self) -> str:
        """Write the footer and trailer; returns the pack id (hex)."""
        footer = encode_footer(self._entries)
        self._write(footer)
        self._write(_TRAILER.pack(len(footer), blake3(footer).digest()[:16], TRAILER_MAGIC))
        return self._hasher.hexdigest()


def encode_footer(entries: list[PackEntry]) -> bytes:
    """Encode the footer index of ``entries``."""
    parts = [_FOOTER_HEAD.pack(FOOTER_MAGIC, len(entries))]
    for e in entries:
        flags = _FLAG_BASE if e.base_id else 0
        parts.append(_FOOTER_RECORD.pack(
            e.chunk_id, e.offset, e.stored_len, e.raw_len, e.codec, flags, e.base_id or _NO_BASE
        ))
    return b"".join(parts)


def parse_trailer(tail: bytes, pack_size: int) -> int:
    """Return the footer length recorded in a pack's last :data:`TRAILER_SIZE` bytes.

    Raises:
        CorruptPackError: the pack is truncated or the trailer is not a pack trailer.
    """
    if len(tail) != TRAILER_SIZE or pack_size < PACK_HEADER_SIZE + TRAILER_SIZE:
        raise CorruptPackError("pack is truncated: no trailer")
    footer_len, _, magic = _TRAILER.unpack(tail)
    if magic != TRAILER_MAGIC:
        raise CorruptPackError("pack trailer is missing or damaged (the pack is truncated?)")
    if footer_len < _FOOTER_HEAD.size or footer_len > min(pack_size - TRAILER_SIZE - PACK_HEADER_SIZE,
                                                         MAX_FOOTER):
        raise CorruptPackError(f"pack trailer records an impossible footer length {footer_len}")
    return int(footer_len)


def parse_footer(footer: bytes, tail: bytes, pack_size: int) -> list[PackEntry]:
    """Parse and bounds-check a footer index against the trailer's checksum.

    Raises:
        CorruptPackError: checksum mismatch, bad magic, or entries outside the pack.
    """
    _, digest, _ = _TRAILER.unpack(tail)
    if blake3(footer).digest()[:16] != digest:
        raise CorruptPackError("pack footer does not match its checksum")
    magic, count = _FOOTER_HEAD.unpack_from(footer)
    if magic != FOOTER_MAGIC or _FOOTER_HEAD.size + count * _FOOTER_RECORD.size != len(footer):
        raise CorruptPackError("pack footer is malformed")
    limit = pack_size - TRAILER_SIZE - len(footer)
    entries = []
    for i in range(count):
        cid, off, stored, raw, codec, flags, base = _FOOTER_RECORD.unpack_from(
            footer, _FOOTER_HEAD.size + i * _FOOTER_RECORD.size
        )
        if off < PACK_HEADER_SIZE or off + ENTRY_HEADER_SIZE + stored > limit:
            raise CorruptPackError(f"pack footer entry {i} points outside the pack")
        entries.append(PackEntry(cid, off, stored, raw, codec, base if flags & _FLAG_BASE else None))
    return entries


def read_index(pack: bytes | memoryview) -> list[PackEntry]:
    """Return the entries of a whole pack held in memory, via its footer."""
    size = len(pack)
    if bytes(pack[: len(PACK_MAGIC)]) != PACK_MAGIC:
        raise CorruptPackError("not a casckpt pack (bad magic)")
    tail = bytes(pack[size - TRAILER_SIZE :]) if size >= TRAILER_SIZE else b""
    footer_len = parse_trailer(tail, size)
    footer = bytes(pack[size - TRAILER_SIZE - footer_len : size - TRAILER_SIZE])
    return parse_footer(footer, tail, size)


def scan_entries(pack: bytes | memoryview) -> Iterator[PackEntry]:
    """Walk entry headers from the start of a pack (to rebuild a lost footer).

    Stops at the footer; raises :class:`CorruptPackError` on a damaged header
    or when what follows the last entry is not a footer.
    """
    view = memoryview(pack)
    if bytes(view[: len(PACK_MAGIC)]) != PACK_MAGIC:
        raise CorruptPackError("not a casckpt pack (bad magic)")
    offset = PACK_HEADER_SIZE
    while offset < len(view) and bytes(view[offset : offset + 4]) != FOOTER_MAGIC:
        entry = decode_entry_header(view[offset:], offset)
        yield entry
        offset += entry.span
    if offset >= len(view):
        raise CorruptPackError("pack ends without a footer (truncated?)")
