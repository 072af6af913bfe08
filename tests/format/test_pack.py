"""The pack format: round trips, the documented byte layout, and damage detection.

The golden test derives every expected byte from the layout documented in
``casckpt/format/pack.py`` with ``struct`` and ``blake3`` directly, so a change
to the on-disk format cannot pass unnoticed.
"""

from __future__ import annotations

import io
import random
import struct
import zlib

import pytest
import zstandard
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

from casckpt.errors import CasckptError, CorruptChunkError, CorruptPackError, IntegrityError
from casckpt.format.chunks import chunk_id
from casckpt.format.codecs import CompressionPolicy, encode_chunk
from casckpt.format.pack import (
    ENTRY_HEADER_SIZE,
    PACK_HEADER_SIZE,
    PACK_MAGIC,
    TRAILER_SIZE,
    PackEntry,
    PackWriter,
    decode_entry,
    read_index,
    scan_entries,
)

# Format constants pinned here on purpose: packs on disk depend on them.
OBJECT_CONTEXT = "casckpt 2026-11-29 object id v1"
CHUNK_CONTEXT = "casckpt 2026-11-29 chunk id v1"
PROPERTY = settings(max_examples=60, deadline=None)
RAW, GROUP4_ZSTD = 0, 3  # codec ids (pinned in tests/format/test_codecs.py)


def _build(chunks: list[tuple[bytes, int, bytes | None]]) -> tuple[bytes, str, list[PackEntry]]:
    """Write ``(raw, element_size, base_id)`` chunks into a pack; returns (bytes, id, entries)."""
    sink = io.BytesIO()
    writer = PackWriter(sink)
    entries = []
    for raw, element_size, base in chunks:
        codec, payload = encode_chunk(raw, element_size, CompressionPolicy())
        entries.append(writer.add(chunk_id(raw), codec.id, len(raw), payload, base))
    pack_id = writer.finish()
    data = sink.getvalue()
    assert writer.size == len(data)
    return data, pack_id, entries


def _decode_all(pack: bytes, entries: list[PackEntry]) -> list[bytes]:
    return [bytes(decode_entry(pack[e.offset : e.offset + e.span], e, "p")) for e in entries]


def _object_id(data: bytes) -> str:
    return blake3(data, derive_key_context=OBJECT_CONTEXT).hexdigest()


chunk_lists = st.lists(
    st.tuples(
        st.one_of(st.binary(max_size=300), st.integers(0, 600).map(bytes)),  # noise or zeros
        st.sampled_from([1, 2, 4, 8]),
        st.one_of(st.none(), st.binary(min_size=32, max_size=32).filter(any)),
    ),
    max_size=8,
)


@PROPERTY
@given(chunks=chunk_lists)
def test_pack_roundtrip(chunks: list[tuple[bytes, int, bytes | None]]) -> None:
    pack, pack_id, written = _build(chunks)
    assert pack_id == _object_id(pack)
    index = read_index(pack)
    assert index == written
    assert list(scan_entries(pack)) == index
    assert _decode_all(pack, index) == [raw for raw, _, _ in chunks]
    for entry, (raw, _, base) in zip(index, chunks, strict=True):
        assert entry.chunk_id == chunk_id(raw)
        assert entry.raw_len == len(raw)
        assert entry.base_id == base
    # entries tile the pack from byte 24 (magic + nonce) up to the footer, in order
    offset = 24
    for entry in index:
        assert entry.offset == offset
        offset += entry.span


def test_golden_bytes() -> None:
    """Two fixed RAW chunks, every byte derived from the documented layout."""
    raw_a, raw_b = bytes(range(40)), b"casckpt golden chunk B" * 3
    base_b = bytes(range(100, 132))
    sink = io.BytesIO()
    nonce = bytes(range(200, 216))
    writer = PackWriter(sink, nonce=nonce)
    writer.add(chunk_id(raw_a), RAW, len(raw_a), raw_a)
    writer.add(chunk_id(raw_b), RAW, len(raw_b), raw_b, base_id=base_b)
    pack_id = writer.finish()
    pack = sink.getvalue()

    def cid(raw: bytes) -> bytes:
        return blake3(raw, derive_key_context=CHUNK_CONTEXT).digest()

    def header(raw: bytes, flags: int, base: bytes) -> bytes:
        # magic, codec u8, flags u8, reserved u16, id, raw_len u64, stored_len u64, base id
        head = b"CCHK" + bytes([0, flags]) + b"\0\0" + cid(raw)
        head += struct.pack("<QQ", len(raw), len(raw)) + base
        assert len(head) == 88
        return head + struct.pack("<I", zlib.crc32(head))

    def record(raw: bytes, offset: int, flags: int, base: bytes) -> bytes:
        # id, offset u64, stored_len u64, raw_len u64, codec u8, flags u8, base id
        return cid(raw) + struct.pack("<QQQ", offset, len(raw), len(raw)) + bytes([0, flags]) + base

    off_a, off_b = 24, 24 + 92 + len(raw_a)
    entries = header(raw_a, 0, bytes(32)) + raw_a + header(raw_b, 1, base_b) + raw_b
    footer = b"CIDX" + struct.pack("<Q", 2) + record(raw_a, off_a, 0, bytes(32))
    footer += record(raw_b, off_b, 1, base_b)
    assert len(footer) == 12 + 2 * 90
    trailer = struct.pack("<Q", len(footer)) + blake3(footer).digest()[:16] + b"CKPEND01"
    expected = b"CKPACK02" + nonce + entries + footer + trailer

    assert len(pack) == 24 + 2 * 92 + len(raw_a) + len(raw_b) + 12 + 2 * 90 + 32
    assert pack[:24] == b"CKPACK02" + nonce
    assert pack[off_a : off_a + 92] == header(raw_a, 0, bytes(32))
    assert pack[off_b : off_b + 92] == header(raw_b, 1, base_b)
    assert pack[-32:] == trailer
    assert pack[-32 - len(footer) : -32] == footer
    assert pack == expected
    assert (ENTRY_HEADER_SIZE, TRAILER_SIZE) == (92, 32)
    assert pack_id == _object_id(expected)
    index = read_index(pack)
    assert [(e.offset, e.base_id) for e in index] == [(off_a, None), (off_b, base_b)]


def _small_pack(compressed: bool = True) -> tuple[bytes, list[PackEntry], list[bytes]]:
    """Three chunks, the middle one with a delta base id and (if ``compressed``) zstd-encoded."""
    middle = bytes(1000) if compressed else random.Random(7).randbytes(170)
    raws = [bytes(range(48)), middle, b"third chunk, raw"]
    pack, _, _ = _build([(raws[0], 1, None), (raws[1], 4, bytes(range(32))), (raws[2], 1, None)])
    index = read_index(pack)
    codecs = {RAW, GROUP4_ZSTD} if compressed else {RAW}
    assert {e.codec for e in index} == codecs
    return pack, index, raws


def test_decode_entry_verifies_the_chunk_id() -> None:
    raw = bytes(range(64))
    sink = io.BytesIO()
    writer = PackWriter(sink)
    writer.add(chunk_id(b"some other chunk"), RAW, len(raw), raw)  # id does not match bytes
    writer.finish()
    pack = sink.getvalue()
    (entry,) = read_index(pack)
    with pytest.raises(CorruptChunkError, match="does not match its id") as info:
        decode_entry(pack[entry.offset : entry.offset + entry.span], entry, "pk")
    assert info.value.chunk_id == entry.chunk_id.hex()
    assert info.value.pack_id == "pk"


def test_decode_entry_refuses_an_index_that_names_another_chunk() -> None:
    pack, index, _ = _small_pack()
    first, second = index[0], index[1]
    lying = PackEntry(second.chunk_id, first.offset, first.stored_len, first.raw_len, first.codec)
    with pytest.raises(CorruptChunkError):
        decode_entry(pack[first.offset : first.offset + first.span], lying, "p")
    with pytest.raises(CorruptChunkError):  # right id, wrong place
        decode_entry(pack[first.offset : first.offset + second.span], second, "p")


def test_every_truncation_is_refused_with_a_pack_or_chunk_error() -> None:
    pack, index, raws = _small_pack()
    for size in range(len(pack)):
        cut = pack[:size]
        with pytest.raises(CorruptPackError):
            read_index(cut)
        # the footer is gone: rebuild the index by scanning, as repair would
        try:
            scanned = list(scan_entries(cut))
        except CorruptPackError:
            continue
        assert scanned == index[: len(scanned)]
        for entry, raw in zip(scanned, raws, strict=False):
            try:
                got = decode_entry(cut[entry.offset : entry.offset + entry.span], entry, "p")
            except CorruptChunkError:
                assert entry.offset + entry.span > size
                continue
            assert bytes(got) == raw


@pytest.mark.parametrize(
    "mask", [0x01, 0x80, 0xFF, 0x10]
)
def test_every_flipped_byte_is_detected(mask: int) -> None:
    """Every flip is reported, except in bytes that carry no data.

    Those are the pack nonce, and the few bits zstd ignores in its own frames
    ("unused" header bit, bitstream padding): such a flip still decodes to the
    right bytes, verified against the chunk id, so it can never be returned as
    wrong data (the scrub's pack-id hash reports it); anywhere else it must raise.
    """
    pack, index, raws = _small_pack()
    zstd_payloads = [
        range(e.offset + ENTRY_HEADER_SIZE, e.offset + e.span) for e in index if e.codec != RAW
    ] + [range(len(PACK_MAGIC), PACK_HEADER_SIZE)]
    for pos in range(len(pack)):
        damaged = bytearray(pack)
        damaged[pos] ^= mask
        try:
            out = _decode_all(bytes(damaged), read_index(bytes(damaged)))
        except IntegrityError:
            continue
        assert any(pos in payload for payload in zstd_payloads), f"flip at {pos} not detected"
        assert out == raws


@PROPERTY
@given(data=st.data())
def test_random_damage_never_escapes_as_another_exception(data: st.DataObject) -> None:
    # RAW chunks only: damage inside a zstd frame is covered, position by position, by
    # test_every_flipped_byte_is_detected.
    pack, _, raws = _small_pack(compressed=False)
    damaged = bytearray(pack)
    for _ in range(data.draw(st.integers(1, 6))):
        pos = data.draw(st.integers(0, len(pack) - 1))
        damaged[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(pack)))
    blob = bytes(damaged[:cut]) + data.draw(st.binary(max_size=40))
    try:
        out = _decode_all(blob, read_index(blob))
    except IntegrityError:
        pass
    else:
        assert out == raws  # only a no-op "damage" can pass
    try:
        for entry in scan_entries(blob):
            decode_entry(blob[entry.offset : entry.offset + entry.span], entry, "p")
    except IntegrityError:
        pass


@pytest.mark.parametrize("blob", [b"", b"CKPACK02", b"CKPACK0", b"x" * 100, b"CKPACK02" + bytes(64)])
def test_not_a_pack(blob: bytes) -> None:
    with pytest.raises(CorruptPackError):
        read_index(blob)


def _forge(pack: bytes, footer: bytes, footer_len: int | None = None) -> bytes:
    """Replace the footer of ``pack`` with ``footer`` and a trailer whose checksum matches."""
    old_len = struct.unpack_from("<Q", pack, len(pack) - 32)[0]
    body = pack[: len(pack) - 32 - old_len]
    trailer = struct.pack("<Q", len(footer) if footer_len is None else footer_len)
    trailer += blake3(footer).digest()[:16] + b"CKPEND01"
    return body + footer + trailer


def _footer(records: list[tuple[bytes, int, int, int, int, int, bytes]], count: int | None = None) -> bytes:
    out = b"CIDX" + struct.pack("<Q", len(records) if count is None else count)
    for cid, off, stored, raw, codec, flags, base in records:
        out += struct.pack("<32sQQQBB32s", cid, off, stored, raw, codec, flags, base)
    return out


def _records(index: list[PackEntry]) -> list[tuple[bytes, int, int, int, int, int, bytes]]:
    return [
        (e.chunk_id, e.offset, e.stored_len, e.raw_len, e.codec, 1 if e.base_id else 0,
         e.base_id or bytes(32))
        for e in index
    ]


def test_forged_footer_sanity() -> None:
    pack, index, _ = _small_pack()
    assert read_index(_forge(pack, _footer(_records(index)))) == index


@pytest.mark.parametrize(
    "forgery",
    ["offset_past_end", "offset_in_file_header", "stored_len_past_footer", "count_too_big",
     "count_too_small", "bad_magic", "footer_len_huge", "footer_len_tiny"],
)
def test_forged_footer_with_a_valid_checksum_is_refused(forgery: str) -> None:
    pack, index, _ = _small_pack()
    records = _records(index)
    cid, off, stored, raw, codec, flags, base = records[-1]
    footer_len = None
    if forgery == "offset_past_end":
        records[-1] = (cid, len(pack), stored, raw, codec, flags, base)
    elif forgery == "offset_in_file_header":
        records[0] = (records[0][0], 4, *records[0][2:])
    elif forgery == "stored_len_past_footer":
        records[-1] = (cid, off, stored + 100, raw, codec, flags, base)
    footer = _footer(records)
    if forgery == "count_too_big":
        footer = _footer(records, count=len(records) + 1)
    elif forgery == "count_too_small":
        footer = _footer(records, count=len(records) - 1)
    elif forgery == "bad_magic":
        footer = b"XIDX" + footer[4:]
    elif forgery == "footer_len_huge":
        footer_len = len(pack) * 2
    elif forgery == "footer_len_tiny":
        footer_len = 3
    with pytest.raises(CorruptPackError):
        read_index(_forge(pack, footer, footer_len))


def test_scan_refuses_a_damaged_entry_magic() -> None:
    pack, index, _ = _small_pack()
    damaged = bytearray(pack)
    damaged[index[1].offset] ^= 0xFF  # first byte of the second entry's "CCHK"
    with pytest.raises(CorruptPackError):
        list(scan_entries(bytes(damaged)))


def test_forged_grouped_entry_is_a_chunk_error() -> None:
    raw = bytes(range(10))
    sink = io.BytesIO()
    writer = PackWriter(sink)
    writer.add(chunk_id(raw), GROUP4_ZSTD, len(raw), zstandard.ZstdCompressor().compress(raw))
    writer.finish()
    pack = sink.getvalue()
    (entry,) = read_index(pack)
    with pytest.raises(CasckptError):
        decode_entry(pack[entry.offset : entry.offset + entry.span], entry, "p")
