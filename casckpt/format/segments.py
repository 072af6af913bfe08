"""How a file's bytes are cut into segments for a directory snapshot (no I/O: pure functions
over a buffer; see :mod:`casckpt.format.dirsnap` for the snapshot itself).

Each segment becomes a tensor leaf of the snapshot's state, chunked from its own byte 0,
so a segment that recurs (an unchanged tensor in a rewritten checkpoint) dedups like any
tensor. :func:`plan_segments` picks the cut: safetensors files tensor by tensor
(:func:`safetensors_segments`), DCP ``.distcp`` files by their write items
(:func:`item_segments`), zip archives such as ``torch.save`` output entry by entry
(:func:`zip_segments`), anything else by content-defined chunking (:func:`cdc_segments`,
FastCDC). Nothing is unpickled.
"""

from __future__ import annotations

import io
import json
import math
import struct
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CDC_MIN = 256 << 10
CDC_AVG = 768 << 10  # FastCDC's average is avg + min: about 1 MiB, the default chunk size
CDC_MAX = 4 << 20
"""Content-defined chunking bounds (bytes). A file of at most ``CDC_MIN * 2`` bytes is one
segment; longer ones are cut where their content says, so an insertion moves only the cuts
near it and the other segments dedup."""

SMALL_SEGMENT = 64 << 10
SMALL_RUN = 128 << 10
"""Segments under ``SMALL_SEGMENT`` bytes are merged with their small neighbours into runs of
at most ``SMALL_RUN`` bytes (see :func:`_coalesce`)."""

# safetensors dtype -> numpy dtype of its segment. bfloat16 and the float8 formats, which
# numpy lacks, keep their element width (uint16 / uint8), which is all chunking and the
# byte-grouped codecs look at.
_SAFETENSORS_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "|i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "|u1", "BOOL": "|u1",
    "F8_E4M3": "|u1", "F8_E5M2": "|u1", "F8_E4M3FN": "|u1", "F8_E5M2FNUZ": "|u1",
    "F8_E4M3FNUZ": "|u1", "F8_E8M0": "|u1",
    "C64": "<c8", "C128": "<c16",
}
_ITEMSIZE = {"<f8": 8, "<f4": 4, "<f2": 2, "<u2": 2, "<i8": 8, "<i4": 4, "<i2": 2, "|i1": 1,
             "<u8": 8, "<u4": 4, "|u1": 1, "<c8": 8, "<c16": 16}
_MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors library's own limit
_MAX_NDIM = 32
"""A tensor of more dimensions (valid safetensors) is kept flat: numpy arrays hold at most 64
(32 before numpy 2), and reshaping to more raised ValueError out of ``add_dir``."""


@dataclass(frozen=True, slots=True)
class Segment:
    """Bytes ``[start, end)`` of a file, stored as an array of ``dtype`` (numpy ``str``) and
    ``shape`` (None: flat)."""

    start: int
    end: int
    dtype: str = "|u1"
    shape: tuple[int, ...] | None = None


def plan_segments(name: str, data: memoryview, items: Sequence[tuple[int, int]] | None = None,
                  cdc: Callable[[memoryview], list[tuple[int, int]]] | None = None) -> list[Segment]:
    """The segments of a file named ``name`` holding ``data``: format-aware where the bytes
    validate as safetensors, as a DCP ``.distcp`` file whose write ``items`` (``(offset,
    length)``, from its checkpoint's metadata) are given, or as a zip archive with stored
    entries; else content-defined.

    ``cdc`` cuts a buffer into ``(offset, length)`` pieces (default: :func:`fastcdc_cuts`).
    The segments are sorted, contiguous and cover ``data`` exactly; none is empty.
    """
    size = len(data)
    if size == 0:
        return []
    planned: list[Segment] | None = None
    lowered = name.lower()
    if lowered.endswith(".safetensors"):
        planned = safetensors_segments(data)
    if planned is None and items is not None:
        planned = item_segments(data, items)
    if planned is None and bytes(data[:4]) == b"PK\x03\x04":
        planned = zip_segments(data)
    if planned is None:
        return cdc_segments(data, cdc)
    return _coalesce(_cut_gaps(planned, data, cdc))


def item_segments(data: memoryview, items: Sequence[tuple[int, int]]) -> list[Segment] | None:
    """A file made of items at known ``(offset, length)`` (DCP's ``.distcp``): each item its own
    segment, or entry by entry when it is a ``torch.save`` archive; the bytes between items
    segments of their own. None when the items overlap or run past the end."""
    out: list[Segment] = []
    position = 0
    for offset, length in sorted(items):
        if offset < position or length < 0 or offset + length > len(data):
            return None
        if offset > position:
            out.append(Segment(position, offset))
        piece = data[offset : offset + length]
        inner = zip_segments(piece) if bytes(piece[:4]) == b"PK\x03\x04" else None
        out += [Segment(offset + s.start, offset + s.end, s.dtype, s.shape)
                for s in inner or [Segment(0, length)] if s.end > s.start]
        position = offset + length
    if position < len(data):
        out.append(Segment(position, len(data)))
    return out


def _cut_gaps(planned: list[Segment], data: memoryview,
              cdc: Callable[[memoryview], list[tuple[int, int]]] | None) -> list[Segment]:
    """Long untyped stretches between a format's items (a zip's compressed entries, bytes
    before an archive) cut by content, so they dedup too."""
    out: list[Segment] = []
    for seg in planned:
        if seg.shape is None and seg.dtype == "|u1" and seg.end - seg.start > 2 * CDC_MIN:
            out += [Segment(seg.start + s.start, seg.start + s.end)
                    for s in cdc_segments(data[seg.start : seg.end], cdc)]
        else:
            out.append(seg)
    return out


def _coalesce(planned: list[Segment]) -> list[Segment]:
    """Neighbouring segments under :data:`SMALL_SEGMENT` bytes merged (as bytes) into runs of at
    most :data:`SMALL_RUN`: a checkpoint's many tiny pieces (zip headers, biases, scalars) cost
    one chunk per run instead of one each, and a changed one rewrites only its run."""
    out: list[Segment] = []
    run_start = -1
    for seg in planned:
        small = seg.end - seg.start < SMALL_SEGMENT
        if small and run_start >= 0 and seg.end - run_start <= SMALL_RUN:
            out[-1] = Segment(run_start, seg.end)
            continue
        out.append(seg)
        run_start = seg.start if small else -1
    return out


def cdc_segments(data: memoryview,
                 cdc: Callable[[memoryview], list[tuple[int, int]]] | None = None) -> list[Segment]:
    """Content-defined segments of ``data`` (one segment for a file of at most ``2 * CDC_MIN``)."""
    if len(data) <= 2 * CDC_MIN:
        return [Segment(0, len(data))] if len(data) else []
    cuts = (cdc or fastcdc_cuts)(data)
    return [Segment(offset, offset + length) for offset, length in cuts if length]


def fastcdc_cuts(data: memoryview) -> list[tuple[int, int]]:
    """FastCDC 2020 (pyfastcdc, imported here only) cut points of ``data``."""
    from pyfastcdc import FastCDC  # lazily: `import casckpt` never loads it

    return [(c.offset, c.length) for c in FastCDC(CDC_AVG, min_size=CDC_MIN, max_size=CDC_MAX).cut_buf(data)]


def safetensors_segments(data: memoryview) -> list[Segment] | None:
    """The header (length prefix and JSON) as one segment, then each tensor's bytes as its own
    segment of its dtype and shape; None when ``data`` is not a valid safetensors file
    (header out of range, not JSON, offsets unsorted, overlapping, leaving holes, or not
    matching dtype and shape)."""
    if len(data) < 8:
        return None
    (length,) = struct.unpack("<Q", data[:8])
    start = 8 + length
    if length < 2 or length > _MAX_SAFETENSORS_HEADER or start > len(data):
        return None
    try:
        header = json.loads(bytes(data[8:start]))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(header, dict):
        return None
    tensors = _safetensors_tensors(header, len(data) - start)
    if tensors is None:
        return None
    out = [Segment(0, start)]
    for begin, end, dtype, shape in tensors:
        if end == begin:
            continue
        aligned = (start + begin) % _ITEMSIZE[dtype] == 0
        out.append(Segment(start + begin, start + end, dtype if aligned else "|u1",
                           shape if aligned and len(shape) <= _MAX_NDIM else None))
    return out


def _safetensors_tensors(header: Mapping[str, Any], data_len: int
                         ) -> list[tuple[int, int, str, tuple[int, ...]]] | None:
    found: list[tuple[int, int, str, tuple[int, ...]]] = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in _SAFETENSORS_DTYPES:
            return None
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not isinstance(offsets, list) or not _ints(shape) \
                or not _ints(offsets) or len(offsets) != 2:
            return None
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        begin, end = offsets
        if end < begin or end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
            return None
        found.append((begin, end, dtype, tuple(shape)))
    found.sort()
    position = 0
    for begin, end, _, _ in found:
        if begin != position:
            return None
        position = end
    return found if position == data_len else None


def _ints(value: object) -> bool:
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


class _ViewFile(io.RawIOBase):
    """A read-only, seekable file over a buffer, for :mod:`zipfile` (no copy of the bytes)."""

    def __init__(self, data: memoryview) -> None:
        self._data = data
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._data)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        piece = self._data[self._pos : self._pos + len(buffer)]
        memoryview(buffer).cast("B")[: len(piece)] = piece
        self._pos += len(piece)
        return len(piece)


def zip_segments(data: memoryview) -> list[Segment] | None:
    """A zip archive (``torch.save`` writes one) entry by entry: each stored entry's data its
    own segment, the bytes between them (local headers, the central directory) segments of
    their own; compressed entries stay inside those. None when ``data`` is not a zip archive
    whose central directory agrees with its local headers. Nothing is unpickled."""
    try:
        with zipfile.ZipFile(_ViewFile(data)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error, NotImplementedError):
        return None
    spans: list[tuple[int, int]] = []
    for info in infos:
        span = _stored_span(data, info)
        if span is None:
            return None
        if span[1] > span[0]:
            spans.append(span)
    spans.sort()
    out: list[Segment] = []
    position = 0
    for begin, end in spans:
        if begin < position:
            return None
        if begin > position:
            out.append(Segment(position, begin))
        out.append(Segment(begin, end))
        position = end
    if position < len(data):
        out.append(Segment(position, len(data)))
    return out


def _stored_span(data: memoryview, info: zipfile.ZipInfo) -> tuple[int, int] | None:
    """Where a stored entry's data lies (an empty span for a compressed one); None when its
    local header is not where the central directory says."""
    at = info.header_offset
    if at < 0 or at + 30 > len(data) or bytes(data[at : at + 4]) != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", data[at + 26 : at + 30])
    begin = at + 30 + name_len + extra_len
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
        return (begin, begin)
    end = begin + info.compress_size
    return (begin, end) if end <= len(data) else None
