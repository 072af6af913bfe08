"""The shard header: round trips, the documented byte layout, and damage detection.

Like ``test_pack.py``, the golden test pins the on-disk bytes twice: derived
field by field from the layout documented in ``casckpt/format/shard.py`` with
``struct``/``zlib``, and as a hard-coded hex string, so a change to the shard
format cannot pass unnoticed.
"""

from __future__ import annotations

import struct
import zlib

import pytest
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

from casckpt.errors import CorruptPackError
from casckpt.format.objectnames import shard_name
from casckpt.format.shard import (
    SHARD_HEADER_SIZE,
    SHARD_MAGIC,
    ShardHeader,
    decode_shard_header,
    encode_shard_header,
    payload_checksum,
)

PROPERTY = settings(max_examples=50, deadline=None)

# One fixed header: pack id 00 01 .. 1f, shard 5 of ec:4+2 (a parity shard),
# algorithm isa_l_rs_cauchy (15 bytes: one NUL of padding), a pack length not
# divisible by k, and checksum 64 65 .. 83. The hex below pins, in order: the
# magic "CKSHRD01"; the raw 32-byte pack id; index, k, m as u16 LE (05 00 04 00
# 02 00); the algorithm NUL-padded to 16 bytes; pack length and payload length
# as u64 LE (43 42 0f .. = 1_000_003, e1 d0 03 .. = 250_081); data offset as
# u32 LE (50 00 00 00 = 80); the raw 32-byte checksum; 10 reserved zero bytes;
# and the CRC32 (LE) of the 124 bytes before it.
GOLDEN = ShardHeader(
    pack_id=bytes(range(32)).hex(), index=5, k=4, m=2, algorithm="isa_l_rs_cauchy",
    pack_len=1_000_003, payload_len=250_081, data_offset=80,
    checksum=bytes(range(100, 132)).hex(),
)
GOLDEN_HEX = (
    "434b534852443031000102030405060708090a0b0c0d0e0f1011121314151617"
    "18191a1b1c1d1e1f0500040002006973615f6c5f72735f636175636879004342"
    "0f0000000000e1d0030000000000500000006465666768696a6b6c6d6e6f7071"
    "72737475767778797a7b7c7d7e7f80818283000000000000000000006218e3e3"
)


def _forge(*, pack_id: bytes = bytes(32), index: int = 0, k: int = 4, m: int = 2,
           algorithm: bytes = b"isa_l_rs_cauchy", pack_len: int = 1000, payload_len: int = 330,
           data_offset: int = 80, checksum: bytes = bytes(32), magic: bytes = SHARD_MAGIC) -> bytes:
    """A header built from the documented layout with a *valid* CRC, whatever the fields say."""
    head = struct.pack("<8s32sHHH16sQQI32s", magic, pack_id, index, k, m, algorithm.ljust(16, b"\0"),
                       pack_len, payload_len, data_offset, checksum)
    head += bytes(SHARD_HEADER_SIZE - 4 - len(head))
    return head + struct.pack("<I", zlib.crc32(head))


headers = st.integers(1, 64).flatmap(
    lambda k: st.integers(0, 64).flatmap(
        lambda m: st.builds(
            ShardHeader,
            pack_id=st.binary(min_size=32, max_size=32).map(bytes.hex),
            index=st.integers(0, k + m - 1),
            k=st.just(k),
            m=st.just(m),
            algorithm=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789", max_size=16),
            pack_len=st.integers(0, 2**64 - 1),
            payload_len=st.shared(st.integers(0, 2**64 - 1), key="payload_len"),
            data_offset=st.shared(st.integers(0, 2**64 - 1), key="payload_len").flatmap(
                lambda n: st.integers(0, min(n, 2**32 - 1))),
            checksum=st.binary(min_size=32, max_size=32).map(bytes.hex),
        )
    )
)


@PROPERTY
@given(header=headers, tail=st.binary(max_size=64))
def test_header_roundtrip(header: ShardHeader, tail: bytes) -> None:
    raw = encode_shard_header(header)
    assert len(raw) == SHARD_HEADER_SIZE
    assert raw[:8] == SHARD_MAGIC
    assert decode_shard_header(raw, "s") == header
    # the payload follows the header: decoding reads only the first 128 bytes
    assert decode_shard_header(memoryview(raw + tail), "s") == header


def test_golden_bytes() -> None:
    raw = encode_shard_header(GOLDEN)
    derived = (b"CKSHRD01" + bytes(range(32)) + struct.pack("<HHH", 5, 4, 2)
               + b"isa_l_rs_cauchy\0" + struct.pack("<QQI", 1_000_003, 250_081, 80)
               + bytes(range(100, 132)) + bytes(10))
    assert len(derived) == SHARD_HEADER_SIZE - 4
    derived += struct.pack("<I", zlib.crc32(derived))
    assert raw == derived
    assert raw.hex() == GOLDEN_HEX
    assert decode_shard_header(bytes.fromhex(GOLDEN_HEX), "s") == GOLDEN
    assert GOLDEN.stripe == 250_001  # ceil(1_000_003 / 4)


def test_stripe_rounds_up() -> None:
    def stripe(pack_len: int, k: int) -> int:
        return ShardHeader("00" * 32, 0, k, 1, "a", pack_len, 0, 0, "00" * 32).stripe

    assert [stripe(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert stripe(7, 1) == 7


def test_every_truncation_is_refused() -> None:
    raw = encode_shard_header(GOLDEN)
    for size in range(SHARD_HEADER_SIZE):
        with pytest.raises(CorruptPackError, match="shard-x"):
            decode_shard_header(raw[:size], "shard-x")
        with pytest.raises(CorruptPackError):
            decode_shard_header(memoryview(raw)[:size], "shard-x")


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_flipped_byte_is_refused(mask: int) -> None:
    raw = encode_shard_header(GOLDEN)
    payload = bytes(range(256)) * 4  # damage to the header alone, with a payload after it
    for pos in range(SHARD_HEADER_SIZE):
        damaged = bytearray(raw + payload)
        damaged[pos] ^= mask
        with pytest.raises(CorruptPackError) as info:
            decode_shard_header(bytes(damaged), "shard-x")
        assert ("CRC" in str(info.value)) == (pos >= len(SHARD_MAGIC)), pos


@pytest.mark.parametrize("blob", [b"", SHARD_MAGIC, b"x" * SHARD_HEADER_SIZE,
                                  b"CKPACK02" + bytes(SHARD_HEADER_SIZE - 8),
                                  SHARD_MAGIC + bytes(SHARD_HEADER_SIZE - 8)])
def test_not_a_shard(blob: bytes) -> None:
    with pytest.raises(CorruptPackError):
        decode_shard_header(blob, "s")


def test_forged_header_sanity() -> None:
    """The forger builds what the encoder does, so the refusals below are about the fields."""
    forged = _forge(pack_id=bytes(range(32)), index=5, k=4, m=2, pack_len=1_000_003,
                    payload_len=250_081, data_offset=80, checksum=bytes(range(100, 132)))
    assert forged.hex() == GOLDEN_HEX
    assert decode_shard_header(_forge(index=5, k=4, m=2), "s").index == 5  # the last shard
    assert decode_shard_header(_forge(data_offset=330, payload_len=330), "s").data_offset == 330


@pytest.mark.parametrize(
    "fields",
    [
        {"index": 6, "k": 4, "m": 2},  # index == k + m
        {"index": 7, "k": 4, "m": 2},
        {"index": 65535, "k": 4, "m": 2},
        {"index": 1, "k": 1, "m": 0},
        {"index": 0, "k": 0, "m": 2},  # no data shards
        {"index": 0, "k": 0, "m": 0},
        {"data_offset": 331, "payload_len": 330},  # payload starts past its end
        {"data_offset": 1, "payload_len": 0},
        {"data_offset": 2**32 - 1, "payload_len": 100},
    ],
)
def test_inconsistent_fields_with_a_valid_crc_are_refused(fields: dict[str, int]) -> None:
    with pytest.raises(CorruptPackError, match="inconsistent"):
        decode_shard_header(_forge(**fields), "s")  # type: ignore[arg-type]


def test_encoder_refuses_an_algorithm_name_over_16_bytes() -> None:
    def header(algorithm: str) -> ShardHeader:
        return ShardHeader("ab" * 32, 0, 4, 2, algorithm, 10, 10, 0, "cd" * 32)

    assert decode_shard_header(encode_shard_header(header("a" * 16)), "s").algorithm == "a" * 16
    with pytest.raises(ValueError, match="longer than 16 bytes"):
        encode_shard_header(header("a" * 17))
    with pytest.raises(ValueError):
        encode_shard_header(header("é"))  # not ASCII: not a name pyeclib knows either


@pytest.mark.parametrize(
    "fields",
    [
        {"pack_id": "ab" * 31},  # 31 bytes: would be silently zero-padded to another id
        {"pack_id": "ab" * 33},
        {"checksum": "cd" * 16},
        {"index": 6},  # index == k + m
        {"k": 0},
        {"data_offset": 11},  # past payload_len
    ],
)
def test_encoder_refuses_fields_the_decoder_would_refuse_or_misread(fields: dict[str, object]) -> None:
    base = {"pack_id": "ab" * 32, "index": 0, "k": 4, "m": 2, "algorithm": "isa_l_rs_cauchy",
            "pack_len": 40, "payload_len": 10, "data_offset": 0, "checksum": "cd" * 32}
    with pytest.raises(ValueError):
        encode_shard_header(ShardHeader(**{**base, **fields}))  # type: ignore[arg-type]


def test_payload_checksum_is_plain_blake3() -> None:
    payload = bytes(range(256)) * 3
    assert payload_checksum(payload) == blake3(payload).hexdigest()
    assert payload_checksum(memoryview(payload)) == payload_checksum(payload)
    assert len(payload_checksum(b"")) == 64


def test_shard_name_format() -> None:
    pack_id = "e015e152cdbec2e54b5ec07bc482fef90f38ae23082f6a34efc0f2b5ac7b3392"
    assert shard_name(pack_id, 0) == f"packs/e0/{pack_id}.s0"
    assert shard_name(pack_id, 31) == f"packs/e0/{pack_id}.s31"
    # a shard sits next to the whole-pack key (packs/<2 hex>/<id>), distinct from it
    assert shard_name(pack_id, 1).startswith(f"packs/{pack_id[:2]}/{pack_id}.")
    assert len({shard_name(pack_id, i) for i in range(32)}) == 32


def test_shard_names_are_valid_object_names() -> None:
    from casckpt.storage.base import check_object_name

    pack_id = "00ff" * 16
    for index in (0, 9, 10, 31):
        assert check_object_name(shard_name(pack_id, index)) == shard_name(pack_id, index)
