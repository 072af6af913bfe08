"""casckpt.format.segments and dirsnap: how a file's bytes are cut, and which listings are accepted (no I/O).

Whatever the bytes, the segments are sorted, contiguous, non-empty and cover the file; a
safetensors header or zip archive that does not validate falls back to content-defined
chunking instead of failing; names that could leave the target are refused.
"""

from __future__ import annotations

import io
import json
import struct
import zipfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from casckpt.errors import CorruptManifestError
from casckpt.format.dirsnap import check_path, read_listing
from casckpt.format.segments import (
    CDC_MIN,
    Segment,
    item_segments,
    plan_segments,
    safetensors_segments,
    zip_segments,
)


def assert_covers(segments: list[Segment], size: int) -> None:
    position = 0
    for seg in segments:
        assert seg.start == position and seg.end > seg.start
        if seg.shape is not None:
            assert int(np.prod(seg.shape)) * np.dtype(seg.dtype).itemsize == seg.end - seg.start
        position = seg.end
    assert position == size


def safetensors_bytes(tensors: dict[str, tuple[str, list[int], bytes]], align: int = 8) -> bytes:
    header: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % align + (1 if align == 1 and (8 + len(text)) % 2 == 0 else 0))
    return struct.pack("<Q", len(text)) + text + b"".join(d for _, _, d in tensors.values())


def test_safetensors_tensors_get_their_dtype_and_shape() -> None:
    big = np.arange(70_000, dtype="<f4").tobytes()
    tensors = {"w": ("F32", [700, 100], big), "b": ("BF16", [40_000], bytes(80_000))}
    data = safetensors_bytes(tensors)
    segments = safetensors_segments(memoryview(data))
    assert segments is not None
    assert [(s.dtype, s.shape) for s in segments] == [("|u1", None), ("<f4", (700, 100)), ("<u2", (40_000,))]
    assert_covers(segments, len(data))
    odd = safetensors_bytes(tensors, align=1)  # data not on an element boundary: kept as bytes
    segments = safetensors_segments(memoryview(odd))
    assert segments is not None and [s.shape for s in segments] == [None, None, None]
    assert_covers(segments, len(odd))


@pytest.mark.parametrize("header", [
    {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 15]}},  # size disagrees with shape
    {"a": {"dtype": "F32", "shape": [4], "data_offsets": [4, 20]}},  # a hole at the start
    {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
     "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}},  # overlapping
    {"a": {"dtype": "F32", "shape": [400], "data_offsets": [0, 1600]}},  # past the end
    {"a": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}},  # unknown dtype
    {"a": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}},
    {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16.0]}},
    ["not", "a", "dict"],
])
def test_forged_safetensors_headers_fall_back_to_bytes(header: object) -> None:
    text = json.dumps(header).encode()
    data = struct.pack("<Q", len(text)) + text + bytes(32)
    assert safetensors_segments(memoryview(data)) is None
    assert_covers(plan_segments("m.safetensors", memoryview(data)), len(data))


def test_a_huge_header_length_is_not_trusted() -> None:
    data = struct.pack("<Q", 1 << 60) + b"{}"
    assert safetensors_segments(memoryview(data)) is None


def test_zip_stored_entries_are_segments_and_compressed_ones_are_not() -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("a/data.pkl", b"p" * 100, compress_type=zipfile.ZIP_STORED)
        archive.writestr("a/data/0", bytes(range(256)) * 400, compress_type=zipfile.ZIP_STORED)
        archive.writestr("a/log.txt", b"x" * 5000, compress_type=zipfile.ZIP_DEFLATED)
    data = buffer.getvalue()
    segments = zip_segments(memoryview(data))
    assert segments is not None
    assert_covers(segments, len(data))
    payload = bytes(range(256)) * 400
    start = data.index(payload)
    assert Segment(start, start + len(payload)) in segments


def test_a_truncated_zip_falls_back() -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("x", b"y" * 1000)
    data = buffer.getvalue()[:-30]
    assert zip_segments(memoryview(data)) is None
    assert_covers(plan_segments("x.pt", memoryview(data)), len(data))


def test_items_that_overlap_or_overrun_are_refused() -> None:
    data = memoryview(bytes(100))
    assert item_segments(data, [(0, 60), (50, 10)]) is None
    assert item_segments(data, [(90, 20)]) is None
    assert_covers(item_segments(data, [(10, 20), (40, 10)]) or [], 100)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=4096), name=st.sampled_from(["a.safetensors", "b.pt", "c.distcp", "d"]),
       prefix=st.sampled_from([b"", b"PK\x03\x04", struct.pack("<Q", 30)]))
def test_any_bytes_are_covered_exactly(data: bytes, name: str, prefix: bytes) -> None:
    blob = prefix + data
    assert_covers(plan_segments(name, memoryview(blob), [(0, len(blob) // 2)] if data else None), len(blob))


def test_content_defined_cuts_cover_a_large_file() -> None:
    blob = np.random.default_rng(0).bytes(6 * CDC_MIN * 4)
    segments = plan_segments("blob", memoryview(blob))
    assert len(segments) > 2
    assert_covers(segments, len(blob))


@pytest.mark.parametrize("path", ["", "/abs", "a/../b", "..", ".", "a//b", "a/", "a\0b", "./a"])
def test_unsafe_paths_are_refused(path: str) -> None:
    with pytest.raises(CorruptManifestError):
        check_path(path)


@pytest.mark.parametrize("path", ["a", "a/b", ".hidden", "ü ñ/x y", "..a", "a..", "a\\b"])
def test_plain_relative_paths_pass(path: str) -> None:
    assert check_path(path) == path


def test_a_listing_of_another_format_is_refused() -> None:
    with pytest.raises(CorruptManifestError, match="format"):
        read_listing({"casckpt.dir": 2, "files": []}, len)
    with pytest.raises(CorruptManifestError):
        read_listing({"casckpt.dir": 1, "files": [], "extra": 1}, len)
