"""Dtype names as manifests record them, and the mapping back, by lookup only."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from casckpt.errors import CorruptManifestError

if TYPE_CHECKING:  # imported by the functions that make dtypes: sizes need neither torch nor numpy
    import numpy as np
    import torch

_QUANTIZED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}

TORCH_SIZES: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4,
    "uint64": 8, "int64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
    **{f"{sign}int{bits}": 1 for sign in ("", "u") for bits in range(1, 8)},
}
"""Bytes per element of the torch dtypes manifests name, so sizes are known without
importing torch (``casckpt show`` and the other catalog-only commands); a test pins the
table to torch's own answers, and a name outside it asks torch."""


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """Every torch dtype by the name manifests record (quantized ones excluded); imports torch."""
    import torch

    found: dict[str, torch.dtype] = {}
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype) and name not in _QUANTIZED:
            canonical = str(value).removeprefix("torch.")
            found.setdefault(canonical, value)
    return found


def torch_dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a manifest names; never evaluates the name."""
    try:
        return torch_dtypes()[name]
    except KeyError:
        import torch

        raise CorruptManifestError(
            f"manifest names torch dtype {name!r}, which this torch ({torch.__version__}) lacks; "
            "upgrade torch or restore with a matching version"
        ) from None


def numpy_dtype_name(dtype: np.dtype) -> str:
    """``float32`` little-endian -> ``"<f4"`` (byte order kept)."""
    return str(dtype.str)


@functools.cache
def _numpy_dtypes() -> dict[str, np.dtype]:
    import numpy as np

    found: dict[str, np.dtype] = {}
    for code in "?bBhHiIlLqQefdgFDG":
        for order in ("<", ">"):
            dtype = np.dtype(code).newbyteorder(order)  # type: ignore[arg-type]
            found[str(dtype.str)] = dtype
    return found


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype a manifest names (bool/int/uint/float/complex), by table lookup."""
    try:
        return _numpy_dtypes()[name]
    except (KeyError, TypeError):
        raise CorruptManifestError(f"manifest names a numpy dtype casckpt does not store: {name!r}") from None


def element_size(kind: str, name: str) -> int:
    """Bytes per element of a dtype named in a manifest."""
    size = _SIZES.get((kind, name))
    if size is None:
        if kind == "torch":
            size = TORCH_SIZES.get(name) or _torch_element_size(name)
        else:
            size = numpy_dtype(name).itemsize
        _SIZES[(kind, name)] = size  # only names the tables know get here (others raised)
    return size


_SIZES: dict[tuple[str, str], int] = {}


def _torch_element_size(name: str) -> int:
    import torch

    return torch.empty((), dtype=torch_dtype(name)).element_size()
