"""Dtype names as manifests record them, and the mapping back, by lookup only."""

from __future__ import annotations

import numpy as np
import torch

from casckpt.errors import CorruptManifestError

_QUANTIZED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}


def _torch_dtypes() -> dict[str, torch.dtype]:
    found: dict[str, torch.dtype] = {}
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype) and name not in _QUANTIZED:
            canonical = str(value).removeprefix("torch.")
            found.setdefault(canonical, value)
    return found


TORCH_DTYPES: dict[str, torch.dtype] = _torch_dtypes()


def torch_dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a manifest names; never evaluates the name."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise CorruptManifestError(
            f"manifest names torch dtype {name!r}, which this torch ({torch.__version__}) lacks; "
            "upgrade torch or restore with a matching version"
        ) from None


def numpy_dtype_name(dtype: np.dtype) -> str:
    """``float32`` little-endian -> ``"<f4"`` (byte order kept)."""
    return str(dtype.str)


def _numpy_dtypes() -> dict[str, np.dtype]:
    found: dict[str, np.dtype] = {}
    for code in "?bBhHiIlLqQefdgFDG":
        for order in ("<", ">"):
            dtype = np.dtype(code).newbyteorder(order)  # type: ignore[arg-type]
            found[str(dtype.str)] = dtype
    return found


NUMPY_DTYPES: dict[str, np.dtype] = _numpy_dtypes()


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype a manifest names (bool/int/uint/float/complex), by table lookup."""
    try:
        return NUMPY_DTYPES[name]
    except (KeyError, TypeError):
        raise CorruptManifestError(f"manifest names a numpy dtype casckpt does not store: {name!r}") from None


def element_size(kind: str, name: str) -> int:
    """Bytes per element of a dtype named in a manifest."""
    size = _SIZES.get((kind, name))
    if size is None:
        if kind == "torch":
            size = torch.empty((), dtype=torch_dtype(name)).element_size()
        else:
            size = numpy_dtype(name).itemsize
        _SIZES[(kind, name)] = size  # only names the tables know get here (others raised)
    return size


_SIZES: dict[tuple[str, str], int] = {}
