"""Byte planes: a chunk's elements regrouped byte by byte, and back.

Plane ``i`` of ``width``-byte elements is byte ``i`` of each element in memory order; a
chunk *grouped* by ``width`` is its planes one after the other (all first bytes, then all
second bytes, ...), the order :mod:`casckpt.format.codecs` compresses floats in. Pure numpy
on buffers the caller owns: no I/O, no codec, no zstd. Thread-safe (each thread has its own
temporaries, at most a block of lanes each).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

import numpy as np

# Byte planes <-> elements, by integer arithmetic on the elements rather than one strided byte
# column at a time (numpy's strided byte copy runs at ~3.3 GiB/s; these at 4-17 GiB/s, docs/perf/planes.md).
# An element is viewed as lanes of up to 4 bytes (an 8-byte element as two 4-byte lanes: numpy's
# 64-bit shifts are slower than a strided 32-bit copy). Plane i is byte i of the element in memory,
# which is bits 8i of its lane on a little-endian host and the lane's top byte first on a big-endian
# one: the lane dtypes and shifts follow _ORDER, so the same code is right on either (tests run it
# with the foreign order, which numpy byte-swaps).
_ORDER = "<" if sys.byteorder == "little" else ">"
_LANE_BLOCK = 1 << 18  # elements handled at a time: each temporary is at most this many lanes
_lanes = threading.local()  # each thread's temporaries: (bytes, slot) -> an array of _LANE_BLOCK lanes


def _lane_shape(width: int) -> tuple[np.dtype[np.unsignedinteger], int, list[int]]:
    """The lane dtype, the bytes in a lane and each lane byte's shift for ``width``-byte elements."""
    size = min(width, 4)
    order = _ORDER
    shifts = [8 * k if order == "<" else 8 * (size - 1 - k) for k in range(size)]
    return np.dtype(f"{order}u{size}"), size, shifts


def _lane_temp(size: int, slot: int, count: int) -> np.ndarray:
    """This thread's temporary ``slot`` of ``count`` lanes of ``size`` bytes (at most a block)."""
    temps: dict[tuple[str, int, int], np.ndarray] | None = getattr(_lanes, "temps", None)
    if temps is None:
        temps = _lanes.temps = {}
    key = (_ORDER, size, slot)
    temp = temps.get(key)
    if temp is None:
        temp = temps[key] = np.empty(_LANE_BLOCK, dtype=f"{_ORDER}u{size}")
    return temp[:count]


def interleave(planes: Sequence[np.ndarray], out: np.ndarray) -> None:
    """Write ``planes`` (``width`` uint8 arrays of ``n``) into ``out`` (uint8, ``width * n``) as
    byte i of each element from ``planes[i]``, a block of elements at a time.

    Raises:
        ValueError: ``out`` does not hold ``width`` bytes for each of the planes' bytes.
    """
    width = len(planes)
    _check_planes(planes, out)
    dtype, size, _ = _lane_shape(width)
    lanes = out.view(dtype).reshape(-1, width // size)
    for start in range(0, len(lanes), _LANE_BLOCK):
        stop = min(start + _LANE_BLOCK, len(lanes))
        for lane in range(width // size):
            block = [p[start:stop] for p in planes[lane * size : (lane + 1) * size]]
            if width == size:
                _build_lane(block, lanes[start:stop, 0])
            else:  # 4-byte halves of 8-byte elements: built whole, then one strided 32-bit copy
                temp = _lane_temp(4, 0, stop - start)
                _build_lane(block, temp)
                lanes[start:stop, lane] = temp


def _check_planes(planes: Sequence[np.ndarray], elements: np.ndarray) -> None:
    """Every plane as long as the first, and ``elements`` exactly their bytes side by side (a
    shorter buffer would be filled, or read, only in part without a word)."""
    n = len(planes[0]) if planes else 0
    if any(len(p) != n for p in planes) or elements.nbytes != len(planes) * n:
        raise ValueError(f"{len(planes)} planes of {[len(p) for p in planes]} bytes do not make "
                         f"{elements.nbytes} bytes of elements")


def _build_lane(planes: Sequence[np.ndarray], lane: np.ndarray) -> None:
    """``lane`` (``len(planes)`` bytes each) from its bytes' planes in memory order: the two
    halves built (a byte plane is its own half), then the high one shifted over the low one.
    Two 2-byte halves cost fewer passes than four byte shift-ors over a 4-byte lane."""
    half = len(planes) // 2
    if half == 2:
        parts: list[np.ndarray] = []
        for slot, pair in enumerate((planes[:2], planes[2:])):
            parts.append(_lane_temp(2, slot + 1, len(lane)))
            _build_lane(pair, parts[-1])
    else:
        parts = list(planes)
    if not half:
        np.copyto(lane, parts[0], casting="unsafe")
        return
    low, high = parts if _ORDER == "<" else parts[::-1]
    np.copyto(lane, high, casting="unsafe")
    np.left_shift(lane, 8 * half, out=lane)
    np.bitwise_or(lane, low, out=lane)


def split(data: np.ndarray, planes: Sequence[np.ndarray]) -> None:
    """Write byte i of each element of ``data`` (uint8, ``width * n``) into ``planes[i]`` (uint8,
    ``n`` each; ``width = len(planes)``): each plane is its lane shifted down, cast to a byte.

    Raises:
        ValueError: ``data`` does not hold ``width`` bytes for each of the planes' bytes.
    """
    width = len(planes)
    _check_planes(planes, data)
    dtype, size, shifts = _lane_shape(width)
    if width == size:
        _split_lane(data.view(dtype), planes, shifts)
        return
    lanes = data.view(dtype).reshape(-1, width // size)
    for start in range(0, len(lanes), _LANE_BLOCK):
        stop = min(start + _LANE_BLOCK, len(lanes))
        temp = _lane_temp(size, 0, stop - start)
        for lane in range(width // size):
            temp[:] = lanes[start:stop, lane]
            _split_lane(temp, [p[start:stop] for p in planes[lane * size : (lane + 1) * size]], shifts)


def _split_lane(lane: np.ndarray, planes: Sequence[np.ndarray], shifts: list[int]) -> None:
    for plane, shift in zip(planes, shifts, strict=True):
        if shift:
            np.right_shift(lane, shift, out=plane, casting="unsafe")  # the cast keeps the low byte
        else:
            np.copyto(plane, lane, casting="unsafe")


def group(data: memoryview | bytes, width: int) -> bytes:
    """``data`` grouped by ``width``: its planes one after the other."""
    planes = np.empty((width, len(data) // width), dtype=np.uint8)
    split(np.frombuffer(data, dtype=np.uint8), list(planes))
    return planes.tobytes()


def ungroup_into(data: bytes | memoryview | np.ndarray, width: int, out: np.ndarray) -> np.ndarray:
    """Write the bytes of grouped ``data`` back in element order into ``out`` (uint8, same size)."""
    interleave(list(np.frombuffer(data, dtype=np.uint8).reshape(width, -1)), out)
    return out


def ungroup(data: bytes | memoryview, width: int) -> bytes | memoryview:
    """Grouped ``data`` back in element order, in a new buffer."""
    out = ungroup_into(data, width, np.empty(len(data), dtype=np.uint8))
    return memoryview(out)  # type: ignore[arg-type]  # numpy exports the buffer


def regroup(data: np.ndarray, width: int, to: int) -> np.ndarray:
    """Bytes in ``width``-grouped order (1: plain) rearranged into ``to``-grouped order."""
    if width == to:
        return data
    plain = data if width == 1 else ungroup_into(data, width, np.empty(data.nbytes, dtype=np.uint8))
    return plain if to == 1 else np.frombuffer(group(plain.data, to), dtype=np.uint8)
