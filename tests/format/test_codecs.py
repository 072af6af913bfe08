"""Chunk codecs: every registered encoding decodes back to the exact raw bytes.

Also: the registry's ids and properties never change (packs record them),
incompressible data is stored raw, byte grouping is chosen by element size, and
damaged or unknown encodings are refused with ``CorruptChunkError``.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from casckpt.errors import CorruptChunkError
from casckpt.format import byteplanes, codecs
from casckpt.format.codecs import (
    CODECS,
    SPARSE_BLOCK,
    Codec,
    CompressionPolicy,
    Delta,
    decode_chunk,
    decode_into,
    delta_planes,
    encode_chunk,
    encode_delta,
    encode_planes,
    lookup,
    sparse_delta,
)

DEFAULT = CompressionPolicy()
PROPERTY = settings(max_examples=80, deadline=None)

NUMERIC = {1: np.int8, 2: np.float16, 4: np.float32, 8: np.float64}
NAMED = {c.name: c for c in CODECS.values()}
RAW, ZSTD, PLANES = NAMED["raw"], NAMED["zstd"], NAMED["planes-zstd"]

policies = st.builds(
    CompressionPolicy,
    level=st.integers(1, 5),
    min_saving=st.floats(0.0, 0.9),
    planes_min_saving=st.floats(0.0, 0.9),
    enabled=st.booleans(),
)


def _roundtrip(data: bytes, element_size: int, policy: CompressionPolicy) -> Codec:
    codec, payload = encode_chunk(data, element_size, policy)
    assert isinstance(codec, Codec) and CODECS[codec.id] is codec and not codec.is_delta
    assert bytes(decode_chunk(codec.id, bytes(payload), len(data))) == data
    if codec is RAW:
        assert bytes(payload) == data
    elif codec is PLANES:
        assert len(payload) <= (1.0 - policy.planes_min_saving) * len(data)
        assert element_size in (2, 4, 8) and len(data) % element_size == 0
    else:
        # a full-frame codec is only chosen when it saves at least min_saving
        assert len(payload) <= (1.0 - policy.min_saving) * len(data)
        assert codec.group in (1, element_size)
        assert len(data) % codec.group == 0
    return codec


@PROPERTY
@given(data=st.binary(max_size=4096), element_size=st.sampled_from([1, 2, 4, 8]), policy=policies)
def test_random_bytes_roundtrip(data: bytes, element_size: int, policy: CompressionPolicy) -> None:
    _roundtrip(data, element_size, policy)


@st.composite
def structured(draw: st.DrawFn) -> tuple[bytes, int]:
    """Numeric arrays: smooth (compressible) or noise-valued (barely compressible)."""
    element_size = draw(st.sampled_from(sorted(NUMERIC)))
    dtype = NUMERIC[element_size]
    count = draw(st.integers(0, 3000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["smooth", "normal", "sparse", "constant"]))
    if kind == "smooth":
        values = np.linspace(-1, 1, count) * draw(st.floats(0.01, 100))
    elif kind == "normal":
        values = rng.standard_normal(count) * 0.02
    elif kind == "sparse":
        values = np.where(rng.random(count) < 0.05, rng.standard_normal(count), 0.0)
    else:
        values = np.full(count, draw(st.floats(-10, 10)))
    if dtype == np.int8:
        values = np.clip(values * 40, -128, 127)
    return values.astype(dtype).tobytes(), element_size


@PROPERTY
@given(sample=structured(), policy=policies)
def test_structured_data_roundtrip(sample: tuple[bytes, int], policy: CompressionPolicy) -> None:
    data, element_size = sample
    _roundtrip(data, element_size, policy)


@pytest.mark.parametrize("element_size", [1, 2, 4, 8])
def test_compressible_data_uses_the_grouping_of_its_element_size(element_size: int) -> None:
    values = np.linspace(0, 1, 4096).astype(NUMERIC[element_size])
    data = values.tobytes()
    codec = _roundtrip(data, element_size, DEFAULT)
    assert codec.zstd and codec.delta is Delta.NONE and codec.group == element_size


def test_length_not_a_multiple_of_the_element_falls_back_to_plain_zstd() -> None:
    data = bytes(4097)  # zeros: very compressible, but 4097 is not a multiple of 4
    codec = _roundtrip(data, 4, DEFAULT)
    assert codec is ZSTD


@pytest.mark.parametrize("size", [64, 1000, 65536, 65537, 200_000])
@pytest.mark.parametrize("element_size", [1, 2, 4, 8])
def test_incompressible_data_is_stored_raw(size: int, element_size: int) -> None:
    data = os.urandom(size)
    codec, payload = encode_chunk(data, element_size, DEFAULT)
    assert codec is RAW
    assert bytes(payload) == data
    assert bytes(decode_chunk(codec.id, payload, size)) == data


@pytest.mark.parametrize("size", [0, 1, 63])
def test_tiny_chunks_are_stored_raw(size: int) -> None:
    data = bytes(size)
    codec, payload = encode_chunk(data, 1, DEFAULT)
    assert codec is RAW
    assert bytes(payload) == data


def test_disabled_policy_stores_raw() -> None:
    data = bytes(10_000)
    codec, payload = encode_chunk(data, 4, CompressionPolicy(enabled=False))
    assert codec is RAW
    assert bytes(payload) == data


@pytest.mark.parametrize("random_head", [True, False])
def test_large_chunks_with_mixed_halves_roundtrip(random_head: bool) -> None:
    # The 64 KiB probe only looks at the head; whatever it decides must still decode.
    noise, zeros = os.urandom(100_000), bytes(100_000)
    data = noise + zeros if random_head else zeros + noise
    codec = _roundtrip(data, 4, DEFAULT)
    if not random_head:
        assert codec is not RAW


def _compressed(element_size: int = 4) -> tuple[Codec, bytes, bytes]:
    data = np.linspace(0, 1, 2048).astype(NUMERIC[element_size]).tobytes()
    codec, payload = encode_chunk(data, element_size, DEFAULT)
    assert codec is not RAW
    return codec, bytes(payload), data


def test_truncated_payload_is_refused() -> None:
    codec, payload, data = _compressed()
    for cut in range(len(payload)):
        with pytest.raises(CorruptChunkError):
            decode_chunk(codec.id, payload[:cut], len(data))


@PROPERTY
@given(garbage=st.binary(max_size=512), codec=st.sampled_from([c for c in CODECS.values() if c.zstd]))
def test_garbage_payload_is_refused(garbage: bytes, codec: Codec) -> None:
    # Any non-zstd payload is refused; a payload that happens to be a zstd frame
    # never decodes to the wrong length.
    try:
        out = decode_chunk(codec.id, garbage, 4096, bytes(4096))
    except CorruptChunkError:
        return
    assert len(out) == 4096


@pytest.mark.parametrize("delta", [-1, 1, 4096])
def test_wrong_raw_length_is_refused(delta: int) -> None:
    codec, payload, data = _compressed()
    with pytest.raises(CorruptChunkError):
        decode_chunk(codec.id, payload, len(data) + delta)


@pytest.mark.parametrize("delta", [-1, 1])
def test_raw_payload_of_the_wrong_length_is_refused(delta: int) -> None:
    with pytest.raises(CorruptChunkError):
        decode_chunk(RAW.id, bytes(100), 100 + delta)


def test_every_flipped_byte_is_refused_or_yields_the_right_length() -> None:
    """A flip is either caught by zstd or left for the chunk id check in ``decode_entry``.

    Whatever happens, no exception other than ``CorruptChunkError`` escapes.
    """
    codec, payload, data = _compressed()
    caught = 0
    for pos in range(len(payload)):
        damaged = bytearray(payload)
        damaged[pos] ^= 0x5A
        try:
            out = decode_chunk(codec.id, bytes(damaged), len(data))
        except CorruptChunkError:
            caught += 1
            continue
        assert len(out) == len(data)
    assert caught > 0


@pytest.mark.parametrize("codec", [11, 12, 17, 127, 128, 255, -1])
def test_unknown_codec_is_refused(codec: int) -> None:
    with pytest.raises(CorruptChunkError, match="codec"):
        decode_chunk(codec, bytes(16), 16, bytes(16))
    with pytest.raises(CorruptChunkError, match="unknown chunk codec"):
        lookup(codec)
    with pytest.raises(CorruptChunkError, match="codec"):
        delta_planes(codec, bytes(16), 16)


@pytest.mark.parametrize("codec", [c for c in CODECS.values() if c.group > 1])
def test_grouped_codec_with_a_ragged_length_is_refused(codec: Codec) -> None:
    raw = bytes(range(codec.group * 5 + 1))  # not a multiple of the group
    payload = zstandard.ZstdCompressor().compress(raw)
    with pytest.raises(CorruptChunkError):
        decode_chunk(codec.id, payload, len(raw), bytes(len(raw)))


# (id, name, zstd, group, delta): recorded in packs and catalogs, so must never change
PINNED = [
    (0, "raw", False, 1, Delta.NONE),
    (1, "zstd", True, 1, Delta.NONE),
    (2, "group2-zstd", True, 2, Delta.NONE),
    (3, "group4-zstd", True, 4, Delta.NONE),
    (4, "group8-zstd", True, 8, Delta.NONE),
    (5, "xor-zstd", True, 1, Delta.XOR),
    (6, "xor-group2-zstd", True, 2, Delta.XOR),
    (7, "xor-group4-zstd", True, 4, Delta.XOR),
    (8, "xor-group8-zstd", True, 8, Delta.XOR),
    (9, "xor-sparse-zstd", True, 1, Delta.SPARSE),  # its payload header says its grouping
    (10, "planes-zstd", True, 1, Delta.NONE),  # header (width, mask), raw planes, a frame of the masked
]


def test_registered_codecs_are_pinned() -> None:
    assert [(c.id, c.name, c.zstd, c.group, c.delta) for c in CODECS.values()] == PINNED
    assert all(c.lossless and int(c) == c.id and lookup(c.id) is c for c in CODECS.values())
    assert [c.is_delta for c in CODECS.values()] == [False] * 5 + [True] * 5 + [False]
    assert [c.stored_as_is for c in CODECS.values()] == [True] + [False] * 10
    assert [c.id for c in CODECS.values() if c.planes] == [10]


@pytest.mark.parametrize("bad", [
    (Codec(0, "raw", zstd=False), Codec(0, "again")),  # an id twice
    (Codec(0, "raw", zstd=False), Codec(1, "raw")),  # a name twice
    (Codec(256, "wide"),),  # not one byte
    (Codec(10, "lossy", lossless=False),),  # a chunk id hashes the raw bytes: every read would fail
    (Codec(10, "group3", group=3),),
    (Codec(10, "sparse-raw", zstd=False, delta=Delta.SPARSE),),
    (Codec(10, "planes-raw", zstd=False, planes=True),),
    (Codec(10, "planes4", group=4, planes=True),),
    (Codec(10, "xor-planes", delta=Delta.XOR, planes=True),),
])
def test_registry_refuses_codecs_no_pack_could_hold(bad: tuple[Codec, ...]) -> None:
    with pytest.raises(ValueError, match="codec"):
        codecs._registry(*bad)


def _encoded_with(codec: Codec, data: bytes, base: bytes) -> tuple[Codec, bytes | memoryview]:
    """``data`` encoded by the public encoders so that they choose ``codec`` (data and base
    are whole 64-byte blocks, so every grouping and a sparse delta fit)."""
    if codec.delta is Delta.SPARSE:
        encoded = sparse_delta(data, base, 4, 1, 1.0)
        assert encoded is not None
        return encoded
    if codec.delta is Delta.XOR:
        return encode_delta(data, base, codec.group, 1)
    if not codec.zstd:
        return encode_chunk(data, codec.group, CompressionPolicy(enabled=False))
    if codec.planes:
        return codec, encode_planes(data, 4, 0b1010, 1)
    return encode_chunk(bytes(len(data)) + data, codec.group, CompressionPolicy(min_saving=0.0))


@PROPERTY
@given(codec=st.sampled_from(list(CODECS.values())), blocks=st.integers(2, 40),
       seed=st.integers(0, 2**32 - 1), changed=st.floats(0.0, 1.0))
def test_every_registered_codec_round_trips_bit_exact(codec: Codec, blocks: int, seed: int,
                                                     changed: float) -> None:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, blocks * SPARSE_BLOCK, dtype=np.uint8)
    data = np.where(rng.random(base.size) < changed * 0.1, rng.integers(0, 256, base.size), base)
    raw, base_bytes = data.astype(np.uint8).tobytes(), base.tobytes()
    chosen, payload = _encoded_with(codec, raw, base_bytes)
    assert chosen is codec
    if codec.is_delta:
        assert bytes(decode_chunk(codec.id, bytes(payload), len(raw), base_bytes)) == raw
        with pytest.raises(CorruptChunkError, match="needs its base"):
            decode_chunk(codec.id, bytes(payload), len(raw))
    else:
        expected = bytes(len(raw)) + raw if codec.zstd and not codec.planes else raw
        assert bytes(decode_chunk(codec.id, bytes(payload), len(expected))) == expected


def test_frame_declaring_a_huge_content_size_is_refused() -> None:
    codec, payload = encode_chunk(bytes(1000), 4, DEFAULT)
    assert codec is not RAW
    damaged = bytearray(payload)
    damaged[4] ^= 0x80  # frame header descriptor: content-size field becomes 8 bytes wide
    assert zstandard.get_frame_parameters(bytes(damaged)).content_size > 1 << 40
    with pytest.raises(CorruptChunkError):
        decode_chunk(codec.id, bytes(damaged), 1000)


@given(data=st.binary(min_size=0, max_size=5000), flips=st.lists(st.integers(0, 4999), max_size=40),
       width=st.sampled_from([1, 2, 4, 8, 16]))
@settings(max_examples=200, deadline=None)
def test_delta_round_trips_against_its_base_only(data: bytes, flips: list[int], width: int) -> None:
    size = len(data) - len(data) % width
    base = data[:size]
    changed = bytearray(base)
    for i in flips:
        if i < size:
            changed[i] ^= 0x5A
    codec, payload = encode_delta(bytes(changed), base, width, 1)
    assert codec.delta is Delta.XOR and codec.group in (1, width)
    assert bytes(decode_chunk(codec.id, payload, size, base)) == bytes(changed)
    with pytest.raises(CorruptChunkError, match="needs its base"):
        decode_chunk(codec.id, payload, size)
    if size:
        with pytest.raises(CorruptChunkError, match="needs its base"):
            decode_chunk(codec.id, payload, size, base[:-1])


def test_a_small_update_deltas_to_a_fraction_of_the_chunk() -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    w = torch.randn(65536, generator=g).bfloat16()
    nudged = (w.float() * (1 + 1e-3 * torch.randn(65536, generator=g))).bfloat16()
    raw = nudged.view(torch.uint8).numpy().tobytes()
    codec, payload = encode_delta(raw, w.view(torch.uint8).numpy().tobytes(), 2, 1)
    assert (codec.delta, codec.group) == (Delta.XOR, 2) and len(payload) < 0.25 * len(raw)


# -- the planes codec and decode_into ---------------------------------------------------------

# 16 fp32 values (0.37 * i - 2.5) as a planes payload: width 4, plane 3 (sign and exponent)
# compressed, planes 0-2 raw. Packs hold these bytes: they must decode the same forever.
GOLDEN_PLANES_RAW = (np.arange(16, dtype=np.float32) * np.float32(0.37) - np.float32(2.5)).tobytes()
GOLDEN_PLANES = bytes.fromhex(
    "040800ecae855c66280020e09ac4ec0a2034005147eb8f665c52857a99f551d785332008e1b182268fb8eb54"
    "99c8f8132b4328b52ffd2010810000c0c0bfbfbfbfbe3d3e3f3f3f3f404040")


def test_golden_planes_payload_decodes_to_its_raw_bytes() -> None:
    assert bytes(decode_chunk(PLANES.id, GOLDEN_PLANES, 64)) == GOLDEN_PLANES_RAW
    out = bytearray(64)
    decode_into(PLANES.id, GOLDEN_PLANES, 64, memoryview(out))
    assert bytes(out) == GOLDEN_PLANES_RAW
    # the layout (header, raw planes in order) is the encoder's; only the zstd frame may vary
    encoded = encode_planes(GOLDEN_PLANES_RAW, 4, 0b1000, 1)
    assert encoded[:50] == GOLDEN_PLANES[:50]


FLOATS = {"f32": (np.float32, 4), "f16": (np.float16, 2), "f64": (np.float64, 8), "i64": (np.int64, 8),
          "u8": (np.uint8, 1), "bf16": (None, 2)}


@st.composite
def tensor_bytes(draw: st.DrawFn) -> tuple[bytes, int]:
    """A tensor's bytes the way a state holds them: trained-like floats, ints, bytes, bf16."""
    name = draw(st.sampled_from(sorted(FLOATS)))
    dtype, width = FLOATS[name]
    count = draw(st.integers(0, 40_000 // width))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([1e-8, 1e-3, 0.02, 1.0, 1e4]))
    values = rng.standard_normal(count) * scale
    if name == "bf16" and count:
        import torch

        raw = torch.from_numpy(values.astype(np.float32)).bfloat16().view(torch.uint8).numpy().tobytes()
    elif dtype in (np.int64, np.uint8):
        raw = (values * 1000).astype(np.int64).astype(dtype).tobytes()
    else:
        raw = values.astype(dtype or np.float32).tobytes()[: count * width]
    return raw, width


@PROPERTY
@given(sample=tensor_bytes(), policy=policies)
def test_tensors_of_every_dtype_roundtrip_and_choose_planes_only_when_it_pays(
        sample: tuple[bytes, int], policy: CompressionPolicy) -> None:
    data, width = sample
    _roundtrip(data, width, policy)


@PROPERTY
@given(sample=tensor_bytes(), mask=st.integers(1, 255), offset=st.integers(0, 15), level=st.integers(1, 3))
def test_decode_into_writes_planes_at_any_alignment(sample: tuple[bytes, int], mask: int, offset: int,
                                                    level: int) -> None:
    data, width = sample
    width = width if width > 1 else 4
    data = data[: len(data) - len(data) % width]
    mask &= (1 << width) - 1
    if not mask:
        mask = 1 << (width - 1)
    payload = encode_planes(data, width, mask, level)
    arena = bytearray(b"\xa5" * (len(data) + 32))
    out = memoryview(arena)[offset : offset + len(data)]
    decode_into(PLANES.id, payload, len(data), out)
    assert bytes(out) == data
    assert arena[:offset] == b"\xa5" * offset and arena[offset + len(data):] == b"\xa5" * (32 - offset)


@PROPERTY
@given(codec=st.sampled_from(list(CODECS.values())), blocks=st.integers(2, 40),
       seed=st.integers(0, 2**32 - 1), changed=st.floats(0.0, 1.0), offset=st.integers(0, 7))
def test_decode_into_matches_decode_chunk_for_every_codec(codec: Codec, blocks: int, seed: int,
                                                          changed: float, offset: int) -> None:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, blocks * SPARSE_BLOCK, dtype=np.uint8)
    data = np.where(rng.random(base.size) < changed * 0.1, rng.integers(0, 256, base.size), base)
    raw, base_bytes = data.astype(np.uint8).tobytes(), base.tobytes()
    chosen, payload = _encoded_with(codec, raw, base_bytes)
    size = len(raw) if codec.is_delta or not codec.zstd or codec.planes else 2 * len(raw)
    assert chosen is codec
    arena = bytearray(size + offset)
    decode_into(codec.id, payload, size, memoryview(arena)[offset:], base_bytes if codec.is_delta else None)
    assert bytes(arena[offset:]) == bytes(decode_chunk(chosen.id, payload, size, base_bytes))


def test_decode_into_refuses_a_buffer_it_cannot_fill() -> None:
    with pytest.raises(ValueError, match="writable buffer of 64"):
        decode_into(PLANES.id, GOLDEN_PLANES, 64, memoryview(bytearray(63)))
    with pytest.raises(ValueError, match="writable"):
        decode_into(PLANES.id, GOLDEN_PLANES, 64, memoryview(bytes(64)))


def test_truncated_planes_payload_is_refused() -> None:
    for cut in range(len(GOLDEN_PLANES)):
        with pytest.raises(CorruptChunkError):
            decode_chunk(PLANES.id, GOLDEN_PLANES[:cut], 64)


@pytest.mark.parametrize("head", [b"\x01\x01", b"\x03\x01", b"\x04\x00", b"\x04\x10", b"\x02\x04",
                                  b"\x10\x01"])
def test_planes_header_no_encoder_writes_is_refused(head: bytes) -> None:
    with pytest.raises(CorruptChunkError, match="malformed header"):
        decode_chunk(PLANES.id, head + GOLDEN_PLANES[2:], 64)


@pytest.mark.parametrize("raw_len", [60, 63, 68, 128])
def test_planes_payload_of_another_length_is_refused(raw_len: int) -> None:
    with pytest.raises(CorruptChunkError):
        decode_chunk(PLANES.id, GOLDEN_PLANES, raw_len)


def test_trained_fp32_is_stored_in_planes_and_random_bytes_raw() -> None:
    rng = np.random.default_rng(1)
    weights = (rng.standard_normal(1 << 18) * 0.02).astype(np.float32).tobytes()
    codec, payload = encode_chunk(weights, 4, DEFAULT)
    assert codec is PLANES and len(payload) < 0.9 * len(weights)
    assert payload[:2] == b"\x04\x08"  # only the sign/exponent plane is compressed
    codec, _ = encode_chunk(os.urandom(1 << 18), 4, DEFAULT)
    assert codec is RAW


@pytest.mark.parametrize("width, mask", [(1, 1), (3, 1), (4, 0), (4, 16), (2, 4)])
def test_encode_planes_refuses_a_layout_no_decoder_reads(width: int, mask: int) -> None:
    with pytest.raises(ValueError, match="planes"):
        encode_planes(bytes(48), width, mask, 1)


def test_planes_encoded_on_many_threads_at_once_decode_bit_exact() -> None:
    """Each thread keeps its own planes compressor (a zstd compressor is not thread-safe):
    chunks encoded on eight threads at once still decode to their bytes, as a plain zstd
    frame after the raw planes."""
    rng = np.random.default_rng(7)
    chunks = [(rng.standard_normal(64 << 10) * 0.02).astype(np.float32).tobytes() for _ in range(32)]
    with ThreadPoolExecutor(8) as pool:
        payloads = list(pool.map(lambda data: encode_planes(data, 4, 0b1000, 1), chunks))
    for data, payload in zip(chunks, payloads, strict=True):
        assert bytes(decode_chunk(PLANES.id, payload, len(data))) == data
        raw_planes = 2 + 3 * (len(data) // 4)
        plane = zstandard.ZstdDecompressor().decompress(bytes(payload[raw_planes:]))
        assert plane == np.frombuffer(data, dtype=np.uint8)[3::4].tobytes()
        assert len(payload) < 0.9 * len(data)


def test_a_frame_that_fails_to_decode_leaves_the_threads_decompressor_usable() -> None:
    """The thread's zstd decompressor is reused from chunk to chunk: a damaged frame raises
    CorruptChunkError and the next good chunk on the same thread still decodes bit-exact."""
    data = (np.random.default_rng(3).standard_normal(16 << 10) * 0.02).astype(np.float32).tobytes()
    payload = bytearray(encode_planes(data, 4, 0b1000, 1))
    damaged = bytes(payload[:-40]) + bytes(40)  # the zstd frame's tail zeroed
    with pytest.raises(CorruptChunkError):
        decode_chunk(PLANES.id, damaged, len(data))
    assert bytes(decode_chunk(PLANES.id, bytes(payload), len(data))) == data


# -- the planes layout, against the column-by-column code that wrote the packs before ---------

def _column_planes(data: bytes, width: int) -> np.ndarray:
    """Plane i is byte i of every element: how the layout was defined (one strided column each)."""
    return np.frombuffer(data, dtype=np.uint8).reshape(-1, width).T.copy()


def _column_payload(data: bytes, width: int, mask: int) -> bytes:
    """A planes payload exactly as the column-copying encoder (7b8b525) wrote it."""
    planes = _column_planes(data, width)
    masked = b"".join(planes[i].tobytes() for i in range(width) if mask >> i & 1)
    raw = b"".join(planes[i].tobytes() for i in range(width) if not mask >> i & 1)
    frame = zstandard.ZstdCompressor(compression_params=codecs._PLANES_FAST).compress(masked)
    return bytes([width, mask]) + raw + frame


def _column_probe(data: bytes, width: int) -> codecs.Probe:
    compressor = zstandard.ZstdCompressor(compression_params=codecs._PLANES_FAST)
    mask, full, stored = 0, 0, 0
    for i, plane in enumerate(_column_planes(data, width)):
        packed = len(compressor.compress(plane.tobytes()))
        full += packed
        mask |= (packed < codecs.PLANE_PAYS * len(plane)) << i
        stored += packed if mask >> i & 1 else len(plane)
    return codecs.Probe(width, mask, full / len(data), (stored + 2) / len(data))


@PROPERTY
@given(width=st.sampled_from([2, 4, 8]), count=st.integers(0, 700), seed=st.integers(0, 2**32 - 1),
       mask=st.integers(1, 255), order=st.sampled_from(["<", ">"]), block=st.sampled_from([3, 64, 1 << 17]),
       offset=st.integers(0, 7), trained=st.booleans())
def test_planes_keep_the_column_layout_in_either_byte_order(
        width: int, count: int, seed: int, mask: int, order: str, block: int, offset: int,
        trained: bool) -> None:
    """Encode, probe, group and decode build planes from whole elements by shifts: their bytes
    are the column-by-column layout's, byte for byte, whatever the host's byte order (the foreign
    one is run through numpy's byte-swapping), lane block (tails of 8-byte elements) and the
    output's alignment. Old payloads decode with this code and this code's payloads are the old
    encoder's bytes, so an old casckpt reads them."""
    rng = np.random.default_rng(seed)
    if trained:
        floats = (rng.standard_normal(count * width // 4 + 1) * 0.02).astype(np.float32)
        data = floats.tobytes()[: count * width]
    else:
        data = rng.integers(0, 256, count * width, dtype=np.uint8).tobytes()
    mask = mask & (1 << width) - 1 or 1 << (width - 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(byteplanes, "_ORDER", order)
        patch.setattr(byteplanes, "_LANE_BLOCK", block)
        patch.setattr(byteplanes, "_lanes", threading.local())  # a temporary of this block size
        old = _column_payload(data, width, mask)
        assert bytes(encode_planes(data, width, mask, 1)) == old
        arena = bytearray(b"\xa5" * (len(data) + 16))
        out = memoryview(arena)[offset : offset + len(data)]
        decode_into(PLANES.id, old, len(data), out)
        assert bytes(out) == data and arena[:offset] == b"\xa5" * offset
        assert byteplanes.group(data, width) == _column_planes(data, width).tobytes()
        grouped = _column_planes(data, width).tobytes()
        back = byteplanes.ungroup_into(grouped, width, np.empty(len(data), dtype=np.uint8))
        assert back.tobytes() == data
        if count:
            assert codecs.probe(data, width, 1) == _column_probe(data, width)


def test_lane_temporaries_stay_a_block_per_thread_whatever_the_chunk() -> None:
    """Lanes are built a block of elements at a time in per-thread temporaries: a chunk several
    blocks long with a tail decodes bit-exact and leaves no temporary longer than a block."""
    rng = np.random.default_rng(5)
    for width, dtype in ((2, np.float16), (4, np.float32), (8, np.float64)):
        data = (rng.standard_normal(3 * byteplanes._LANE_BLOCK + 5) * 0.02).astype(dtype).tobytes()
        payload = encode_planes(data, width, 1 << (width - 1), 1)
        assert bytes(decode_chunk(PLANES.id, payload, len(data))) == data
    temps = byteplanes._lanes.temps
    assert temps and all(len(temp) == byteplanes._LANE_BLOCK for temp in temps.values())


@pytest.mark.parametrize("width", [2, 4, 8])
def test_planes_and_elements_of_different_sizes_are_refused(width: int) -> None:
    """A buffer shorter (or longer) than the planes' bytes is refused, never filled or read in
    part."""
    grouped = bytes(range(256)) * width
    with pytest.raises(ValueError, match="do not make"):
        byteplanes.ungroup_into(grouped, width, np.empty(len(grouped) - width, dtype=np.uint8))
    with pytest.raises(ValueError, match="do not make"):
        byteplanes.split(np.zeros(len(grouped) - width, dtype=np.uint8),
                         [np.empty(256, dtype=np.uint8) for _ in range(width)])
