"""Checks on catalog values before they become Python values the engine computes with.

The catalog is authoritative but can be damaged (a bad restore, a hand edit,
a bug); a value of the wrong type or range must surface as a typed error
naming what is damaged, never as a TypeError deep in the engine, an absurd
allocation, or wrong data.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Row

from casckpt.errors import CatalogError, CorruptManifestError

_ID_BYTES = 32


def damaged(what: str) -> CatalogError:
    return CatalogError(
        f"the catalog is damaged: {what}. Run `casckpt check` to see what else is; a damaged "
        "catalog is rebuilt from the manifests and records on the blob locations (`casckpt "
        "catalog rebuild` into a new, empty catalog; docs/RUNBOOKS.md, the catalog is lost)")


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def manifest_bytes(value: object, version_id: str) -> bytes:
    """A version's manifest column as bytes.

    Raises:
        CorruptManifestError: it does not hold bytes.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise CorruptManifestError(
        f"the catalog's manifest of version {version_id[:12]} is not bytes ({type(value).__name__}); "
        "the catalog is damaged: `casckpt repair` restores it from a copy on a blob location")


def shape(value: object, where: str) -> list[int]:
    """A tensor row's shape (a JSON list of non-negative ints, or its text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise damaged(f"the shape of {where} is not JSON") from None
    if not isinstance(value, list) or not all(_count(n) for n in value):
        raise damaged(f"the shape of {where} is {value!r}")
    return value


def tensor_row(row: Row[Any]) -> Row[Any]:
    """``row`` (a ``tensors`` row) once its values are of their types."""
    where = f"tensor {row.path!r} of version {str(row.version_id)[:12]}"
    shape(row.shape, where)
    if not (isinstance(row.dtype, str) and _count(row.nbytes) and _count(row.chunks)
            and isinstance(row.digest, str)):
        raise damaged(f"the row of {where} holds values of the wrong type")
    return row


def content_row(row: Row[Any]) -> Row[Any]:
    """``row`` (a ``contents`` row) once its values are of their types."""
    ids = row.chunk_ids
    if not (isinstance(ids, (bytes, bytearray, memoryview)) and len(ids) % _ID_BYTES == 0
            and _count(row.nbytes) and _count(row.chunk_size) and row.chunk_size > 0):
        raise damaged(f"the content row {str(row.digest)[:12]} holds values of the wrong type")
    return row
