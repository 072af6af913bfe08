"""Read a safetensors file for import: its header validated in full before any tensor is read.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON, then
the data section. :func:`read_header` checks what a forged or truncated file could get wrong:
``N`` within the file (and at most safetensors' own 100 MB limit), a JSON object without
duplicate keys, each entry with a known dtype, a shape of non-negative ints and
``data_offsets`` ``[begin, end)`` with ``end - begin == numel * itemsize``, and the ranges
tiling the data section exactly (no overlap, no gap, nothing after the last tensor).
``__metadata__``, when present, maps str to str. Only then does :func:`read_safetensors`
hand the file to safetensors' own loader, whose errors are turned into the same typed error.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from casckpt.errors import UnreadableCheckpointError

if TYPE_CHECKING:
    import torch

MAX_HEADER = 100_000_000
"""The largest header safetensors itself accepts (bytes)."""

ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}
"""Bytes per element of each safetensors dtype torch can hold."""


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    """One tensor of a safetensors header, validated."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """A validated safetensors header: tensors in file order, and ``__metadata__``."""

    tensors: dict[str, HeaderEntry]
    metadata: dict[str, str]


def _refuse(path: Path, reason: str) -> UnreadableCheckpointError:
    return UnreadableCheckpointError(
        f"{str(path)!r} is not a valid safetensors file: {reason}. Nothing was imported; the file "
        "is forged, truncated or damaged: export it again from its source",
        path=str(path),
    )


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry(path: Path, name: str, raw: object, data_len: int) -> HeaderEntry:
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
        raise _refuse(path, f"entry {name!r} must be an object with dtype, shape and data_offsets")
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if dtype not in ITEMSIZE:
        raise _refuse(path, f"tensor {name!r} has unknown dtype {dtype!r} (known: {', '.join(ITEMSIZE)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _refuse(path, f"tensor {name!r} has shape {shape!r}, not a list of non-negative ints")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_len):
        raise _refuse(path, f"tensor {name!r} has data_offsets {offsets!r} outside the "
                            f"{data_len}-byte data section")
    expected = math.prod(shape) * ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != expected:
        raise _refuse(path, f"tensor {name!r} spans {offsets[1] - offsets[0]} bytes, but dtype "
                            f"{dtype} and shape {shape} need {expected}")
    return HeaderEntry(dtype, tuple(shape), offsets[0], offsets[1])


def _parse(path: Path, text: bytes, data_len: int) -> SafetensorsHeader:
    try:
        doc = json.loads(text.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _refuse(path, f"its header is not JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise _refuse(path, "its header is not a JSON object")
    metadata = doc.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _refuse(path, "its __metadata__ is not an object of strings")
    tensors = {name: _entry(path, name, raw, data_len) for name, raw in doc.items()}
    at = 0
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != at:
            what = "overlaps the tensor before it" if entry.begin < at else f"leaves a gap at byte {at}"
            raise _refuse(path, f"tensor {name!r} at [{entry.begin}, {entry.end}) {what}")
        at = entry.end
    if at != data_len:
        raise _refuse(path, f"its tensors end at byte {at} of a {data_len}-byte data section")
    return SafetensorsHeader(tensors, metadata)


def read_header(path: Path) -> SafetensorsHeader:
    """Read and validate the header of the safetensors file at ``path`` (no tensor is read).

    Raises:
        UnreadableCheckpointError: any check of the module doc fails, naming the file.
    """
    try:
        with path.open("rb") as f:
            size = path.stat().st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _refuse(path, f"it is {size} bytes, too short for the 8-byte header length")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(MAX_HEADER, size - 8):
                raise _refuse(path, f"its header length {length} runs past the end of the "
                                    f"{size}-byte file (or over {MAX_HEADER} bytes)")
            text = f.read(length)
    except OSError as exc:
        raise UnreadableCheckpointError(f"cannot read {str(path)!r}: {exc.strerror or exc}",
                                        path=str(path)) from exc
    return _parse(path, text, size - 8 - length)


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (in file order) and ``__metadata__`` of the safetensors file at ``path``.

    Raises:
        UnreadableCheckpointError: the header fails :func:`read_header`, or safetensors'
            loader refuses the file.
    """
    from safetensors import SafetensorError, safe_open

    header = read_header(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name) for name in header.tensors}
    except (SafetensorError, OSError, ValueError, TypeError) as exc:
        raise _refuse(path, f"safetensors refused it ({exc})") from exc
    return tensors, header.metadata
