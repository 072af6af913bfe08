"""Chunk codecs: how a chunk's raw bytes are encoded inside a pack.

Each codec is a registered :class:`Codec` whose properties are data: its one-byte id
(recorded in the chunk's pack header and catalog row, so a pack is decodable on its own),
whether its payload is a zstd frame, the byte grouping it applies, and the base it needs.
Byte grouping (all first bytes of each element, then all second bytes, ...) puts the
slowly varying sign/exponent bytes of floats next to each other, which zstd then
compresses well. Most of a float's gain is in one plane: the high byte (sign and exponent)
of trained weights and optimizer moments compresses to about a third, the mantissa bytes
not at all. The ``planes-zstd`` codec keeps the incompressible planes raw and compresses
only the ones that pay, so it costs a third of a full-frame compression and decodes the
raw planes straight into place (:func:`decode_into`). Encoding picks a codec by those
properties, decoding follows them;
adding a codec is one entry in :data:`CODECS` (plus its code, if it needs a new kind of
payload). An id this casckpt does not know is refused (:func:`lookup`), never guessed.
"""

from __future__ import annotations

import enum
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import zstandard

from casckpt.errors import CorruptChunkError
from casckpt.format import byteplanes

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
        zstd: the payload is one zstd frame, or (``planes``) ends in one (else the bytes
            themselves); either way at most zstd's bound over the raw length.
        group: bytes per element grouped before compression (1: none; a sparse
            delta's and a planes payload's header says its own).
        planes: the payload is a header (element width, mask of compressed planes), the
            byte planes not in the mask as they are, then one zstd frame of the masked
            planes (see :func:`encode_planes`).
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
    planes: bool = False

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
        if codec.planes and (not codec.zstd or codec.group != 1 or codec.is_delta):
            raise ValueError(f"codec {codec.name}: a planes payload holds a zstd frame and its own grouping")
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
    Codec(10, "planes-zstd", planes=True),
)
"""Every codec this casckpt reads and writes, by the id packs record."""

_ZSTD_CODECS = {(c.delta, c.group): c for c in CODECS.values() if c.zstd and not c.planes}
_RAW = next(c for c in CODECS.values() if c.stored_as_is)
PLANES = next(c for c in CODECS.values() if c.planes)


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
        min_saving: a full-frame zstd codec must save at least this fraction (its decode is a
            pass of zstd over every byte).
        planes_min_saving: the planes codec must save at least this fraction (it decodes
            the raw planes with a copy and zstd only over the planes that pay).
        enabled: False stores every chunk raw.
    """

    level: int = 1
    min_saving: float = 0.20  # docs/DEFAULTS.md: a full-frame decode costs restores 14-90%
    planes_min_saving: float = 0.05  # docs/DEFAULTS.md: fp32 state saves 15-17% in planes at ~1 GB/s
    enabled: bool = True


PLANE_PAYS = 0.9  # a plane goes in the planes codec's mask when its probe compresses it below this ratio
_PLANES_HEAD = struct.Struct("<BB")  # element width, mask of the compressed planes (bit i: plane i)
_PLANES_WIDTHS = (2, 4, 8)
_SMALL = 16 << 10  # chunks up to this size try the full frame whatever the probe said


# The masked planes are nearly all literals (sign/exponent bytes, ~2.7 bits of entropy each,
# few repeats), so their frame is made with a match finder too small to cost much: a 64-entry
# hash table and 7-byte minimum matches leave zstd's Huffman literal coding doing the work.
# Same format as any zstd frame; at level 1 it is ~2x faster than zstd's level-1 parameters
# and a few percent smaller on trained fp32/bf16 (docs/perf/planes.md).
_PLANES_FAST = zstandard.ZstdCompressionParameters(
    strategy=zstandard.STRATEGY_FAST, window_log=14, hash_log=6, chain_log=6, min_match=7,
    search_log=1, target_length=0)
_compressors = threading.local()  # zstd (de)compressors are not safe to share between threads


def _planes_compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for planes: :data:`_PLANES_FAST` at level 1 (the default), the
    level's own parameters at any other."""
    cached: dict[int, zstandard.ZstdCompressor] | None = getattr(_compressors, "planes", None)
    if cached is None:
        cached = _compressors.planes = {}
    compressor = cached.get(level)
    if compressor is None:
        compressor = cached[level] = zstandard.ZstdCompressor(compression_params=_PLANES_FAST) \
            if level == 1 else zstandard.ZstdCompressor(level=level)
    return compressor


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor (each call resets it; one per chunk cost ~5% of a
    planes decode)."""
    decompressor: zstandard.ZstdDecompressor | None = getattr(_compressors, "decompressor", None)
    if decompressor is None:
        decompressor = _compressors.decompressor = zstandard.ZstdDecompressor()
    return decompressor


def _compress(data: memoryview | bytes, codec: Codec, level: int) -> bytes:
    payload = byteplanes.group(data, codec.group) if codec.group > 1 else data
    return zstandard.ZstdCompressor(level=level).compress(payload)


@dataclass(frozen=True, slots=True)
class Probe:
    """What compressing a sample of a chunk plane by plane found.

    Attributes:
        width: element width the planes were cut at (1: not cut, ``mask`` is 0).
        mask: the planes that compress below :data:`PLANE_PAYS` (bit i: plane i).
        full: the sample's size under full-frame zstd of its grouping, as a fraction.
        planes: its size under the planes codec with ``mask``, as a fraction.
    """

    width: int
    mask: int
    full: float
    planes: float


def probe(sample: memoryview | bytes, width: int, level: int) -> Probe:
    """Compress ``sample`` (whole elements of ``width`` bytes; 1: bytes) plane by plane: which
    planes pay and what a full-frame and a planes encoding of the chunk it stands for would
    save. One zstd call per plane, a quarter of the sample each for fp32."""
    size = len(sample)
    if width not in _PLANES_WIDTHS or size < width or size % width:
        frame = zstandard.ZstdCompressor(level=level).compress(sample)
        ratio = len(frame) / max(size, 1)
        return Probe(1, 0, ratio, 1.0)
    compressor = _planes_compressor(level)
    split = np.empty((width, size // width), dtype=np.uint8)
    byteplanes.split(np.frombuffer(sample, dtype=np.uint8), list(split))
    mask, full, planes = 0, 0, 0
    for i, plane in enumerate(split):
        packed = len(compressor.compress(plane.data))
        full += packed
        if packed < PLANE_PAYS * len(plane):
            mask |= 1 << i
            planes += packed
        else:
            planes += len(plane)
    return Probe(width, mask, full / size, (planes + _PLANES_HEAD.size) / size)


def encode_planes(data: memoryview | bytes, width: int, mask: int, level: int) -> memoryview:
    """``data`` (whole ``width``-byte elements) as a planes payload: the header, the planes not
    in ``mask`` as they are, then one zstd frame of the masked planes, concatenated in plane
    order (the layout is the column-by-column one packs hold; only the split is by shifts)."""
    if width not in _PLANES_WIDTHS or len(data) % width or not 0 < mask < 1 << width:
        raise ValueError(f"planes of width {width} with mask {mask:#x} cannot hold {len(data)} bytes")
    n = len(data) // width
    raw = [i for i in range(width) if not mask >> i & 1]
    masked = [i for i in range(width) if mask >> i & 1]
    split = np.empty((width, n), dtype=np.uint8)  # the raw planes' rows, then the masked planes'
    rows = dict(zip(raw + masked, split, strict=True))
    byteplanes.split(np.frombuffer(data, dtype=np.uint8), [rows[i] for i in range(width)])
    frame = _planes_compressor(level).compress(split[len(raw) :].data)
    at = _PLANES_HEAD.size + len(raw) * n
    out = np.empty(at + len(frame), dtype=np.uint8)
    out[: _PLANES_HEAD.size] = np.frombuffer(_PLANES_HEAD.pack(width, mask), dtype=np.uint8)
    out[_PLANES_HEAD.size : at] = split[: len(raw)].reshape(-1)
    out[at:] = np.frombuffer(frame, dtype=np.uint8)
    return memoryview(out)  # type: ignore[arg-type]  # numpy exports the buffer; no copy to bytes


def encode_chunk(
    data: memoryview | bytes, element_size: int, policy: CompressionPolicy
) -> tuple[Codec, memoryview | bytes]:
    """Encode one chunk, choosing the codec that pays.

    A 64 KiB sample is probed plane by plane first (:func:`probe`), so incompressible data
    (random bytes) costs one small probe instead of a full compression. The full-frame
    grouped zstd codec is chosen when it saves :attr:`CompressionPolicy.min_saving`, else
    the planes codec when it saves :attr:`CompressionPolicy.planes_min_saving`, else raw.

    Returns:
        ``(codec, payload)``; ``payload`` is ``data`` itself when stored raw.
    """
    size = len(data)
    if not policy.enabled or size < 64:
        return _RAW, data
    codec = _zstd_codec(Delta.NONE, element_size, size)
    sample_len = min(size, _SAMPLE_BYTES)
    sample_len -= sample_len % codec.group
    found = probe(memoryview(data)[:sample_len], codec.group, policy.level)
    return encode_probed(data, codec.group, found, policy)


def encode_probed(data: memoryview | bytes, width: int, found: Probe,
                  policy: CompressionPolicy) -> tuple[Codec, memoryview | bytes]:
    """Encode ``data`` as ``found`` (a probe of it, or of an earlier chunk of the same tensor)
    says pays: full-frame grouped zstd, the planes codec with its mask, or raw. A result that
    misses its saving is stored raw."""
    size = len(data)
    if not policy.enabled or size < 64:
        return _RAW, data
    # a small chunk's probe over-counts a frame header per plane: try the full frame anyway
    if found.full <= 1.0 - policy.min_saving or size <= _SMALL:
        codec = _zstd_codec(Delta.NONE, width, size)
        payload = _compress(data, codec, policy.level)
        if len(payload) <= (1.0 - policy.min_saving) * size:
            return codec, payload
        if not found.mask:
            return _RAW, data
    if found.mask and found.planes <= 1.0 - policy.planes_min_saving and size % found.width == 0:
        planes = encode_planes(data, found.width, found.mask, policy.level)
        if len(planes) <= (1.0 - policy.planes_min_saving) * size:
            return PLANES, planes
    return _RAW, data


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
    body = byteplanes.group(blocks, width) if width > 1 and blocks else blocks
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
    plain = byteplanes.ungroup(body, width) if width > 1 and count else body
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
        out = _decompressor().decompress(payload, max_output_size=raw_len)
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


def _planes_into(payload: bytes | memoryview, raw_len: int, out: np.ndarray) -> None:
    """Decode a planes payload into ``out``: the masked planes decompressed once, then every
    plane woven into the elements in place (:func:`~casckpt.format.byteplanes.interleave`)."""
    if len(payload) < _PLANES_HEAD.size:
        raise CorruptChunkError("planes payload is truncated")
    width, mask = _PLANES_HEAD.unpack_from(payload)
    if width not in _PLANES_WIDTHS or not 0 < mask < 1 << width or raw_len % width:
        raise CorruptChunkError(f"planes payload of {raw_len} bytes has a malformed header")
    n = raw_len // width
    raw = [i for i in range(width) if not mask >> i & 1]
    at = _PLANES_HEAD.size + len(raw) * n
    if len(payload) < at:
        raise CorruptChunkError(f"planes payload holds {len(payload)} bytes, its raw planes {at}")
    body = np.frombuffer(payload, dtype=np.uint8)
    masked = iter(np.frombuffer(_decompress(memoryview(payload)[at:], (width - len(raw)) * n),
                                dtype=np.uint8).reshape(width - len(raw), n))
    stored = iter(body[_PLANES_HEAD.size : at].reshape(len(raw), n))
    byteplanes.interleave([next(masked) if mask >> i & 1 else next(stored) for i in range(width)], out)


def decode_into(codec_id: int, payload: bytes | memoryview, raw_len: int, out: memoryview | bytearray,
                base: bytes | memoryview | None = None) -> None:
    """Decode a chunk payload into ``out``, a writable buffer of its ``raw_len`` raw bytes
    (delta codecs need ``base``, the base chunk's raw bytes; ``out`` must not overlap it).

    The planes codec decompresses only its masked planes and weaves every plane into ``out``
    in place; a grouped codec ungroups its frame into ``out``;
    an XOR delta is ungrouped into ``out`` and XORed with its base there; a sparse delta
    copies its base and patches the changed blocks. Nothing is verified against the chunk's
    id here: the caller hashes ``out``.

    Raises:
        CorruptChunkError: unknown codec, the payload does not decode to ``raw_len``
            bytes, or a delta's base is missing or of another length.
        ValueError: ``out`` is not a writable buffer of ``raw_len`` bytes.
    """
    codec = lookup(codec_id)
    target = np.frombuffer(out, dtype=np.uint8)
    if len(target) != raw_len or not target.flags.writeable:
        raise ValueError(f"decode_into needs a writable buffer of {raw_len} bytes, got {len(target)}")
    if codec.is_delta and (base is None or len(base) != raw_len):
        raise CorruptChunkError(f"a delta chunk of {raw_len} bytes needs its base chunk of the same size")
    if codec.planes:
        _planes_into(payload, raw_len, target)
        return
    if codec.delta is Delta.SPARSE:
        index, blocks = sparse_planes(payload, raw_len)
        target[:] = np.frombuffer(base, dtype=np.uint8)  # type: ignore[arg-type]  # checked above
        apply_sparse(target, index, blocks)
        return
    grouped = _grouped_bytes(codec, payload, raw_len)
    if codec.group > 1:
        byteplanes.ungroup_into(grouped, codec.group, target)
    else:
        target[:] = np.frombuffer(grouped, dtype=np.uint8)
    if codec.delta is Delta.XOR:
        np.bitwise_xor(target, np.frombuffer(base, dtype=np.uint8), out=target)  # type: ignore[arg-type]


def decode_chunk(codec_id: int, payload: bytes | memoryview, raw_len: int,
                 base: bytes | memoryview | None = None) -> bytes | memoryview:
    """Decode a chunk payload back to its ``raw_len`` raw bytes (delta codecs need ``base``): a
    raw payload as it is, any other into a new buffer (:func:`decode_into`).

    Raises:
        CorruptChunkError: unknown codec, the payload does not decode to ``raw_len``
            bytes, or a delta's base is missing or of another length.
    """
    codec = lookup(codec_id)
    if codec.stored_as_is:
        return _grouped_bytes(codec, payload, raw_len)
    out = memoryview(np.empty(raw_len, dtype=np.uint8))  # type: ignore[arg-type]  # numpy exports the buffer
    decode_into(codec_id, payload, raw_len, out, base)
    return out
