"""Bit-exact comparison of two values, for the tests that promise a value comes back exactly.

``exact_differences(got, want)`` lists where ``got`` is not ``want``: another type (a
subclass counts as another type, unless ``subclasses=True``), dict keys or their order, a
length, a tensor's or array's dtype, shape or any bit (NaN payloads and -0.0 included), a
float's bits, a ``BytesIO``'s bytes or position, or any other value's ``==``. An empty list:
the same. Imported by tests (with ``tests/helpers`` put on ``sys.path``, as for the other
helpers) and by the child scripts beside it; it needs torch and numpy only.
"""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np
import torch


def tensor_bits(t: torch.Tensor) -> bytes:
    """The bytes of ``t``'s elements in order (any device, layout or dtype)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def exact_differences(got: Any, want: Any, where: str = "<root>", *, subclasses: bool = False) -> list[str]:
    """Where ``got`` differs from ``want`` in type, keys, length, shape, dtype or any bit.
    ``subclasses``: a ``got`` of a subclass of ``want``'s type is of the same type (a loader
    that returns its own subclasses, as ``load_plain`` its ``OrderedDict``)."""
    if not (isinstance(got, type(want)) if subclasses else type(got) is type(want)):
        return [f"{where}: {type(got).__name__} != {type(want).__name__}"]
    if isinstance(want, torch.Tensor):
        same = got.dtype == want.dtype and got.shape == want.shape and tensor_bits(got) == tensor_bits(want)
        return [] if same else [f"{where}: tensor dtype, shape or bits differ"]
    if isinstance(want, np.ndarray):
        same = got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
        return [] if same else [f"{where}: array dtype, shape or bits differ"]
    if isinstance(want, io.BytesIO):
        same = (got.getvalue(), got.tell()) == (want.getvalue(), want.tell())
        return [] if same else [f"{where}: BytesIO bytes or position differ"]
    if isinstance(want, float):
        same = struct.pack(">d", got) == struct.pack(">d", want)
        return [] if same else [f"{where}: {got!r} != {want!r} (bits)"]
    if isinstance(want, dict):
        if list(got) != list(want):
            return [f"{where}: keys {list(got)!r} != {list(want)!r}"]
        return [d for k in want
                for d in exact_differences(got[k], want[k], f"{where}.{k}", subclasses=subclasses)]
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [f"{where}: length {len(got)} != {len(want)}"]
        pairs = enumerate(zip(got, want, strict=True))
        return [d for i, (g, w) in pairs
                for d in exact_differences(g, w, f"{where}.{i}", subclasses=subclasses)]
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]
