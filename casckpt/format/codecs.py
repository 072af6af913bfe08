"""Chunk codecs: how a chunk's raw bytes are encoded inside a pack.

Each codec has a one-byte id recorded in the chunk's pack header and catalog
row, so a pack is decodable on its own. Byte grouping (all first bytes of each
element, then all second bytes, ...) puts the slowly varying sign/exponent
bytes of floats next to each other, which zstd then compresses well.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np
import zstandard

from casckpt.errors import CorruptChunkError

_SAMPLE_BYTES = 64 * 1024


class Codec(enum.IntEnum):
    """Chunk encodings; the value is what packs and the catalog record."""

    RAW = 0
    ZSTD = 1
    GROUP2_ZSTD = 2
    GROUP4_ZSTD = 3
    GROUP8_ZSTD = 4
    XOR_ZSTD = 5  # delta codecs: the XOR of the chunk and its base chunk, (grouped and) compressed
    XOR_GROUP2_ZSTD = 6
    XOR_GROUP4_ZSTD = 7
    XOR_GROUP8_ZSTD = 8
    XOR_SPARSE_ZSTD = 9  # the changed 64-byte blocks' XOR and their indices, compressed (see sparse_delta)

    @property
    def group(self) -> int:
        """Bytes per element grouped before compression (1: no grouping)."""
        return {Codec.GROUP2_ZSTD: 2, Codec.GROUP4_ZSTD: 4, Codec.GROUP8_ZSTD: 8,
                Codec.XOR_GROUP2_ZSTD: 2, Codec.XOR_GROUP4_ZSTD: 4, Codec.XOR_GROUP8_ZSTD: 8}.get(self, 1)

    @property
    def is_delta(self) -> bool:
        """Whether decoding needs the base chunk's raw bytes."""
        return self >= Codec.XOR_ZSTD


_GROUPED = {2: Codec.GROUP2_ZSTD, 4: Codec.GROUP4_ZSTD, 8: Codec.GROUP8_ZSTD}
_XOR_GROUPED = {2: Codec.XOR_GROUP2_ZSTD, 4: Codec.XOR_GROUP4_ZSTD, 8: Codec.XOR_GROUP8_ZSTD}


def is_delta(codec: int) -> bool:
    """Whether a chunk stored with ``codec`` needs its base to decode."""
    return codec >= Codec.XOR_ZSTD


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
        return Codec.RAW, data
    codec = _GROUPED.get(element_size, Codec.ZSTD)
    if size % codec.group:
        codec = Codec.ZSTD
    threshold = 1.0 - policy.min_saving
    if size > _SAMPLE_BYTES:
        sample_len = _SAMPLE_BYTES - _SAMPLE_BYTES % codec.group
        sample = memoryview(data)[:sample_len]
        if len(_compress(sample, codec, policy.level)) > threshold * sample_len:
            return Codec.RAW, data
    payload = _compress(data, codec, policy.level)
    if len(payload) > threshold * size:
        return Codec.RAW, data
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
    codec = _XOR_GROUPED.get(element_size, Codec.XOR_ZSTD)
    if len(data) % codec.group:
        codec = Codec.XOR_ZSTD
    return codec, _compress(_xor(data, base).data, codec, level)


SPARSE_BLOCK = 64  # bytes: the unit a sparse delta records as changed or not
_SPARSE_HEAD = struct.Struct("<BBHI")  # element width, log2 of the block, reserved, blocks changed


def sparse_delta(data: memoryview | bytes, base: memoryview | bytes, element_size: int, level: int,
                 max_fraction: float) -> bytes | None:
    """Encode ``data`` against ``base`` (same length) as a sparse delta, or None when more than
    ``max_fraction`` of its 64-byte blocks changed (or its length is not whole blocks).

    The payload is one zstd frame of: a header (element width, block size, blocks changed),
    the changed blocks' indices (the first, then the gaps: mostly small numbers), and those
    blocks' XOR against the base, byte-grouped by element width. Applying it touches only
    the changed blocks (:func:`apply_sparse`), so a long chain of sparse deltas costs a
    restore in proportion to what changed, not to the chunk's size per delta.
    """
    if len(data) != len(base):
        raise ValueError("a delta needs a base of the same length")
    width = element_size if element_size in _XOR_GROUPED and SPARSE_BLOCK % element_size == 0 else 1
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
    return zstandard.ZstdCompressor(level=level).compress(head + gaps.tobytes() + body)


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
    if width not in (1, 2, 4, 8) or 1 << log2 != SPARSE_BLOCK or len(out) != declared \
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


def delta_planes(codec: int, payload: bytes | memoryview, raw_len: int) -> tuple[int, np.ndarray]:
    """A delta payload decompressed but not applied: ``(group width, XOR bytes in grouped order)``.

    XOR commutes with byte grouping (a permutation), so a chain of deltas can be
    applied in grouped order and ungrouped once at its end.

    Raises:
        CorruptChunkError: not a delta codec, or the payload does not decompress to ``raw_len``.
    """
    try:
        kind: Codec | None = Codec(codec)
    except ValueError:
        kind = None
    if kind is None or not kind.is_delta or kind is Codec.XOR_SPARSE_ZSTD or raw_len % kind.group:
        raise CorruptChunkError(f"codec {codec} cannot hold a delta of {raw_len} bytes")
    return kind.group, np.frombuffer(_decompress(payload, raw_len), dtype=np.uint8)


def regroup(data: np.ndarray, width: int, to: int) -> np.ndarray:
    """Bytes in ``width``-grouped order (1: plain) rearranged into ``to``-grouped order."""
    if width == to:
        return data
    plain = data if width == 1 else ungroup_into(data, width, np.empty(data.nbytes, dtype=np.uint8))
    return plain if to == 1 else np.frombuffer(_group(plain.data, to), dtype=np.uint8)


def decode_chunk(codec: int, payload: bytes | memoryview, raw_len: int,
                 base: bytes | memoryview | None = None) -> bytes | memoryview:
    """Decode a chunk payload back to its ``raw_len`` raw bytes (delta codecs need ``base``).

    Raises:
        CorruptChunkError: unknown codec, the payload does not decode to ``raw_len``
            bytes, or a delta's base is missing or of another length.
    """
    try:
        kind = Codec(codec)
    except ValueError:
        raise CorruptChunkError(
            f"unknown chunk codec {codec}; the pack was written by a newer casckpt or is damaged"
        ) from None
    if kind.is_delta and (base is None or len(base) != raw_len):
        raise CorruptChunkError(f"a delta chunk of {raw_len} bytes needs its base chunk of the same size")
    if kind is Codec.XOR_SPARSE_ZSTD and base is not None:
        index, blocks = sparse_planes(payload, raw_len)
        return memoryview(apply_sparse(np.frombuffer(base, dtype=np.uint8).copy(), index, blocks))  # type: ignore[arg-type]
    if kind is Codec.RAW:
        if len(payload) != raw_len:
            raise CorruptChunkError(f"raw chunk holds {len(payload)} bytes, expected {raw_len}")
        return payload
    if raw_len % kind.group:
        raise CorruptChunkError(f"a {kind.name} chunk cannot hold {raw_len} bytes")
    out = _decompress(payload, raw_len)
    plain = _ungroup(out, kind.group) if kind.group > 1 else out
    if kind.is_delta and base is not None:
        return memoryview(_xor(plain, base))  # type: ignore[arg-type]  # numpy exports the buffer
    return plain
