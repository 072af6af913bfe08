"""Chunk codecs: how a chunk's raw bytes are encoded inside a pack.

Each codec is a registered :class:`Codec` whose properties are data: its one-byte id
(recorded in the chunk's pack header and catalog row, so a pack is decodable on its own),
whether its payload is a zstd frame, the byte grouping it applies, and the base it needs.
Byte grouping (all first bytes of each element, then all second bytes, ...) puts the
slowly varying sign/exponent bytes of floats next to each other, which zstd then
compresses well. Encoding picks a codec by those properties, decoding follows them;
adding a codec is one entry in :data:`CODECS` (plus its code, if it needs a new kind of
payload). An id this casckpt does not know is refused (:func:`lookup`), never guessed.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import zstandard

from casckpt.errors import CorruptChunkError

_SAMPLE_BYTES = 64 * 1024


class Delta(enum.Enum):
    """The base a codec needs, and how its payload applies to it."""

    NONE = "none"  # decodes on its own
    XOR = "xor"  # the XOR with a base chunk of the same length, in the codec's grouped order
    SPARSE = "sparse"  # the XOR of the 64-byte blocks that changed against a same-length base (sparse_delta)


@dataclass(frozen=True, slots=True)
class Codec:
    """One chunk encoding, described by data.

    Attributes:
        id: the byte packs and the catalog record; never renumbered or reused.
        name: a stable name for messages and docs.
        zstd: the payload is one zstd frame (else the bytes themselves).
        group: bytes per element grouped before compression (1: none; a sparse
            delta's payload header says its own).
        delta: the base it needs (:class:`Delta`); a delta needs the base chunk's raw bytes.
        lossless: decodes to exactly the bytes encoded. Every registered codec must be:
            a chunk's id is the hash of its raw bytes, checked on every read.
    """

    id: int
    name: str
    zstd: bool = True
    group: int = 1
    delta: Delta = Delta.NONE
    lossless: bool = True

    @property
    def is_delta(self) -> bool:
        """Whether decoding needs the base chunk's raw bytes."""
        return self.delta is not Delta.NONE

    @property
    def stored_as_is(self) -> bool:
        """Whether the payload is the chunk's raw bytes (a read may land straight in place)."""
        return not self.zstd and not self.is_delta

    def __int__(self) -> int:
        return self.id


def _registry(*codecs: Codec) -> Mapping[int, Codec]:
    """The codecs by id, refusing a declaration that no pack could hold or no read could trust."""
    by_id: dict[int, Codec] = {}
    for codec in codecs:
        if not 0 <= codec.id <= 255 or codec.id in by_id or codec.name in {c.name for c in by_id.values()}:
            raise ValueError(f"codec {codec} needs a one-byte id and a name no other codec has")
        if not codec.lossless or codec.group not in (1, 2, 4, 8):
            raise ValueError(f"codec {codec.name} must be lossless and group 1, 2, 4 or 8 bytes")
        if codec.delta is Delta.SPARSE and (not codec.zstd or codec.group != 1):
            raise ValueError(f"codec {codec.name}: a sparse delta is a zstd frame with its own grouping")
        by_id[codec.id] = codec
    return MappingProxyType(by_id)


CODECS: Mapping[int, Codec] = _registry(
    Codec(0, "raw", zstd=False),
    Codec(1, "zstd"),
    Codec(2, "group2-zstd", group=2),
    Codec(3, "group4-zstd", group=4),
    Codec(4, "group8-zstd", group=8),
    Codec(5, "xor-zstd", delta=Delta.XOR),
    Codec(6, "xor-group2-zstd", group=2, delta=Delta.XOR),
    Codec(7, "xor-group4-zstd", group=4, delta=Delta.XOR),
    Codec(8, "xor-group8-zstd", group=8, delta=Delta.XOR),
    Codec(9, "xor-sparse-zstd", delta=Delta.SPARSE),
)
"""Every codec this casckpt reads and writes, by the id packs record."""

_ZSTD_CODECS = {(c.delta, c.group): c for c in CODECS.values() if c.zstd}
_RAW = next(c for c in CODECS.values() if c.stored_as_is)


def lookup(codec_id: int) -> Codec:
    """The registered codec recorded as ``codec_id``.

    Raises:
        CorruptChunkError: no codec has that id (a newer casckpt wrote it, or it is damaged).
    """
    codec = CODECS.get(codec_id)
    if codec is None:
        raise CorruptChunkError(
            f"unknown chunk codec {codec_id}; the pack was written by a newer casckpt or is damaged")
    return codec


def _zstd_codec(delta: Delta, element_size: int, size: int) -> Codec:
    """The zstd codec of ``delta`` grouping ``element_size``-byte elements, ungrouped when
    no codec groups that width or ``size`` is not whole elements."""
    grouped = _ZSTD_CODECS.get((delta, element_size))
    return grouped if grouped is not None and size % grouped.group == 0 else _ZSTD_CODECS[(delta, 1)]


@dataclass(frozen=True, slots=True)
class CompressionPolicy:
    """When to compress a chunk.

    Attributes:
        level: zstd level (1 is fast and already near the ratio of higher levels on weights).
        min_saving: store raw unless the encoding saves at least this fraction.
        enabled: False stores every chunk raw.
    """

    level: int = 1
    min_saving: float = 0.20  # docs/DEFAULTS.md: fp32 state saves 15-17% at best, costing restores 14-90%
    enabled: bool = True


def _group(data: memoryview | bytes, width: int) -> bytes:
    array = np.frombuffer(data, dtype=np.uint8).reshape(-1, width)
    planes = np.empty((width, len(array)), dtype=np.uint8)
    for i in range(width):  # a column at a time: ~3x faster than numpy's strided transpose
        planes[i] = array[:, i]
    return planes.tobytes()


def ungroup_into(data: bytes | memoryview | np.ndarray, width: int, out: np.ndarray) -> np.ndarray:
    """Write the bytes of grouped ``data`` back in element order into ``out`` (uint8, same size)."""
    planes = np.frombuffer(data, dtype=np.uint8).reshape(width, -1)
    columns = out.reshape(-1, width)
    for i in range(width):  # a column at a time: ~3x faster than numpy's strided transpose
        columns[:, i] = planes[i]
    return out


def _ungroup(data: bytes | memoryview, width: int) -> bytes | memoryview:
    out = ungroup_into(data, width, np.empty(len(data), dtype=np.uint8))
    return memoryview(out)  # type: ignore[arg-type]  # numpy exports the buffer


def _compress(data: memoryview | bytes, codec: Codec, level: int) -> bytes:
    payload = _group(data, codec.group) if codec.group > 1 else data
    return zstandard.ZstdCompressor(level=level).compress(payload)


def encode_chunk(
    data: memoryview | bytes, element_size: int, policy: CompressionPolicy
) -> tuple[Codec, memoryview | bytes]:
    """Encode one chunk, choosing the codec that pays.

    A 64 KiB sample is compressed first so incompressible data (trained float
    weights, random bytes) costs one small probe instead of a full compression.

    Returns:
        ``(codec, payload)``; ``payload`` is ``data`` itself when stored raw.
    """
    size = len(data)
    if not policy.enabled or size < 64:
        return _RAW, data
    codec = _zstd_codec(Delta.NONE, element_size, size)
    threshold = 1.0 - policy.min_saving
    if size > _SAMPLE_BYTES:
        sample_len = _SAMPLE_BYTES - _SAMPLE_BYTES % codec.group
        sample = memoryview(data)[:sample_len]
        if len(_compress(sample, codec, policy.level)) > threshold * sample_len:
            return _RAW, data
    payload = _compress(data, codec, policy.level)
    if len(payload) > threshold * size:
        return _RAW, data
    return codec, payload


def _xor(data: memoryview | bytes, base: memoryview | bytes) -> np.ndarray:
    return np.bitwise_xor(np.frombuffer(data, dtype=np.uint8), np.frombuffer(base, dtype=np.uint8))


def delta_ratio_probe(data: memoryview | bytes, base: memoryview | bytes, element_size: int,
                      level: int) -> float:
    """The size a delta of the first 64 KiB would have, as a fraction of those bytes (a cheap
    guess at the whole chunk's, as for plain encoding)."""
    size = min(len(data), _SAMPLE_BYTES)
    size -= size % max(element_size, 1)
    if size <= 0:
        return 0.0
    _, payload = encode_delta(memoryview(data)[:size], memoryview(base)[:size], element_size, level)
    return len(payload) / size


def encode_delta(data: memoryview | bytes, base: memoryview | bytes, element_size: int,
                 level: int) -> tuple[Codec, bytes]:
    """Encode ``data`` as the compressed XOR against ``base`` (same length).

    After an optimizer step most bits of most elements are unchanged, so the
    XOR is mostly zero bytes; grouping by byte position puts the zero
    high-order planes together for zstd.
    """
    if len(data) != len(base):
        raise ValueError("a delta needs a base of the same length")
    codec = _zstd_codec(Delta.XOR, element_size, len(data))
    return codec, _compress(_xor(data, base).data, codec, level)


SPARSE_BLOCK = 64  # bytes: the unit a sparse delta records as changed or not
_SPARSE_HEAD = struct.Struct("<BBHI")  # element width, log2 of the block, reserved, blocks changed
_SPARSE_WIDTHS = (1, 2, 4, 8)  # element widths a sparse delta's header may name (each divides a block)


def sparse_delta(data: memoryview | bytes, base: memoryview | bytes, element_size: int, level: int,
                 max_fraction: float) -> tuple[Codec, bytes] | None:
    """Encode ``data`` against ``base`` (same length) as a sparse delta ``(codec, payload)``, or
    None when more than ``max_fraction`` of its 64-byte blocks changed (or its length is not
    whole blocks).

    The payload is one zstd frame of: a header (element width, block size, blocks changed),
    the changed blocks' indices (the first, then the gaps: mostly small numbers), and those
    blocks' XOR against the base, byte-grouped by element width. Applying it touches only
    the changed blocks (:func:`apply_sparse`), so a long chain of sparse deltas costs a
    restore in proportion to what changed, not to the chunk's size per delta.
    """
    if len(data) != len(base):
        raise ValueError("a delta needs a base of the same length")
    width = element_size if element_size in _SPARSE_WIDTHS else 1
    if not data or len(data) % SPARSE_BLOCK:
        return None
    xor = _xor(data, base).reshape(-1, SPARSE_BLOCK)
    changed = np.flatnonzero(xor.view(np.uint64).any(axis=1))
    if len(changed) > max_fraction * len(xor):
        return None
    gaps = np.diff(changed, prepend=0).astype("<u4")
    blocks = xor[changed].tobytes()
    body = _group(blocks, width) if width > 1 and blocks else blocks
    head = _SPARSE_HEAD.pack(width, SPARSE_BLOCK.bit_length() - 1, 0, len(changed))
    return _ZSTD_CODECS[(Delta.SPARSE, 1)], zstandard.ZstdCompressor(level=level).compress(
        head + gaps.tobytes() + body)


def sparse_planes(payload: bytes | memoryview, raw_len: int) -> tuple[np.ndarray, np.ndarray]:
    """A sparse delta decompressed: ``(indices of the changed blocks, their XOR bytes (n, block))``.

    Raises:
        CorruptChunkError: the payload is not a sparse delta of a ``raw_len``-byte chunk.
    """
    if raw_len % SPARSE_BLOCK:
        raise CorruptChunkError(f"a sparse delta cannot hold {raw_len} bytes")
    blocks = raw_len // SPARSE_BLOCK
    bound = _SPARSE_HEAD.size + blocks * (4 + SPARSE_BLOCK)
    try:
        declared = zstandard.frame_content_size(payload)
        if declared < _SPARSE_HEAD.size or declared > bound:
            raise CorruptChunkError(f"sparse delta frame declares {declared} bytes, at most {bound} fit")
        out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=declared)
    except zstandard.ZstdError as exc:
        raise CorruptChunkError(f"chunk payload does not decompress: {exc}") from exc
    width, log2, _, count = _SPARSE_HEAD.unpack_from(out)
    if width not in _SPARSE_WIDTHS or 1 << log2 != SPARSE_BLOCK or len(out) != declared \
            or declared != _SPARSE_HEAD.size + count * (4 + SPARSE_BLOCK):
        raise CorruptChunkError(f"sparse delta of {raw_len} bytes has a malformed header")
    at = _SPARSE_HEAD.size + 4 * count
    index = np.cumsum(np.frombuffer(out, dtype="<u4", count=count, offset=_SPARSE_HEAD.size), dtype=np.int64)
    if count and (index[-1] >= blocks or (count > 1 and int(np.diff(index).min()) < 1)):
        raise CorruptChunkError(f"sparse delta of {raw_len} bytes names blocks out of order or range")
    body = memoryview(out)[at:]
    plain = _ungroup(body, width) if width > 1 and count else body
    return index, np.frombuffer(plain, dtype=np.uint8).reshape(count, SPARSE_BLOCK)


def apply_sparse(out: np.ndarray, index: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """XOR a sparse delta's blocks into ``out`` (a chunk's bytes in element order, writable) in place."""
    if len(index):
        view = out.reshape(-1, SPARSE_BLOCK)
        view[index] ^= blocks
    return out


def _decompress(payload: bytes | memoryview, raw_len: int) -> bytes:
    """A zstd frame's ``raw_len`` bytes, refusing any other size before allocating."""
    try:
        # the frame header says how much to allocate: check it before trusting it
        declared = zstandard.frame_content_size(payload)
        if declared != raw_len:
            raise CorruptChunkError(f"chunk frame declares {declared} bytes, expected {raw_len}")
        out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=raw_len)
    except zstandard.ZstdError as exc:
        raise CorruptChunkError(f"chunk payload does not decompress: {exc}") from exc
    if len(out) != raw_len:
        raise CorruptChunkError(f"chunk decoded to {len(out)} bytes, expected {raw_len}")
    return out


def _grouped_bytes(codec: Codec, payload: bytes | memoryview, raw_len: int) -> bytes | memoryview:
    """A (non-sparse) payload's ``raw_len`` bytes in ``codec``'s grouped order, sizes checked first."""
    if not codec.zstd:
        if len(payload) != raw_len:
            raise CorruptChunkError(f"{codec.name} chunk holds {len(payload)} bytes, expected {raw_len}")
        return payload
    if raw_len % codec.group:
        raise CorruptChunkError(f"a {codec.name} chunk cannot hold {raw_len} bytes")
    return _decompress(payload, raw_len)


def delta_planes(codec_id: int, payload: bytes | memoryview, raw_len: int) -> tuple[int, np.ndarray]:
    """A delta payload decompressed but not applied: ``(group width, XOR bytes in grouped order)``.

    XOR commutes with byte grouping (a permutation), so a chain of deltas can be
    applied in grouped order and ungrouped once at its end.

    Raises:
        CorruptChunkError: not an XOR delta codec, or the payload does not decode to ``raw_len``.
    """
    codec = CODECS.get(codec_id)
    if codec is None or codec.delta is not Delta.XOR or raw_len % codec.group:
        raise CorruptChunkError(f"codec {codec_id} cannot hold a delta of {raw_len} bytes")
    return codec.group, np.frombuffer(_grouped_bytes(codec, payload, raw_len), dtype=np.uint8)


def regroup(data: np.ndarray, width: int, to: int) -> np.ndarray:
    """Bytes in ``width``-grouped order (1: plain) rearranged into ``to``-grouped order."""
    if width == to:
        return data
    plain = data if width == 1 else ungroup_into(data, width, np.empty(data.nbytes, dtype=np.uint8))
    return plain if to == 1 else np.frombuffer(_group(plain.data, to), dtype=np.uint8)


def decode_chunk(codec_id: int, payload: bytes | memoryview, raw_len: int,
                 base: bytes | memoryview | None = None) -> bytes | memoryview:
    """Decode a chunk payload back to its ``raw_len`` raw bytes (delta codecs need ``base``).

    Raises:
        CorruptChunkError: unknown codec, the payload does not decode to ``raw_len``
            bytes, or a delta's base is missing or of another length.
    """
    codec = lookup(codec_id)
    if codec.is_delta and (base is None or len(base) != raw_len):
        raise CorruptChunkError(f"a delta chunk of {raw_len} bytes needs its base chunk of the same size")
    if codec.delta is Delta.SPARSE and base is not None:
        index, blocks = sparse_planes(payload, raw_len)
        return memoryview(apply_sparse(np.frombuffer(base, dtype=np.uint8).copy(), index, blocks))  # type: ignore[arg-type]
    out = _grouped_bytes(codec, payload, raw_len)
    plain = _ungroup(out, codec.group) if codec.group > 1 else out
    if codec.delta is Delta.XOR and base is not None:
        return memoryview(_xor(plain, base))  # type: ignore[arg-type]  # numpy exports the buffer
    return plain
