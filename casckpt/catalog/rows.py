"""Catalog rows become the values the engine computes with: checked, then mapped, here only.

A version row becomes a :class:`~casckpt.types.Version` in one place
(:func:`versions`); the engine receives :class:`VersionRow` values, never
SQLAlchemy rows.

The catalog is authoritative but can be damaged (a bad restore, a hand edit,
a bug); a value of the wrong type or range must surface as a typed error
naming what is damaged, never as a TypeError deep in the engine, an absurd
allocation, or wrong data.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, NamedTuple

from sqlalchemy import Connection, Row, Select, Text, cast, select

from casckpt.catalog import schema as s
from casckpt.errors import CatalogError, CorruptManifestError
from casckpt.types import Version

_ID_BYTES = 32

VERSION_COLUMNS = (
    s.versions.c.id, s.runs.c.name.label("run"), s.versions.c.step, s.versions.c.parent_id,
    s.versions.c.created_at, s.versions.c.logical_bytes, s.versions.c.new_bytes,
    s.versions.c.stored_bytes, s.versions.c.duration_s,
    cast(s.versions.c.meta, Text).label("meta"), cast(s.versions.c.metrics, Text).label("metrics"),
    s.versions.c.message, s.versions.c.durability, s.versions.c.stall_s,
)
"""The columns of a version row (:class:`VersionRow`), ``meta`` and ``metrics`` as JSON
text: long listings decode them in one call instead of one per value."""


def version_query() -> Select[Any]:
    """Visible versions with the columns of :data:`VERSION_COLUMNS`."""
    return select(*VERSION_COLUMNS).join(s.runs, s.runs.c.id == s.versions.c.run_id).where(
        s.versions.c.state == "visible"
    )


class VersionRow(NamedTuple):
    """A version as the catalog holds it (:data:`VERSION_COLUMNS`, in order): what refs
    resolve to and manifests are bound to. :func:`version` makes the public value of it."""

    id: str
    run: str
    step: int
    parent_id: str | None
    created_at: float
    logical_bytes: int
    new_bytes: int
    stored_bytes: int
    duration_s: float
    meta: Any  # JSON text (or a decoded dict)
    metrics: Any
    message: str | None
    durability: str = "durable"  # see Version.durability
    stall_s: float | None = None  # see Version.stall_s


def version_row(row: Sequence[Any] | None) -> VersionRow | None:
    """The :class:`VersionRow` of a row whose first columns are :data:`VERSION_COLUMNS`."""
    return None if row is None else VersionRow(*row[:_VERSION_WIDTH])


_VERSION_WIDTH = len(VersionRow._fields)


def _decoded(values: list[Any]) -> list[dict[str, Any]]:
    """JSON object texts (a version's metadata or metrics) -> dicts; one ``json.loads`` for all
    of them when all are text (3x faster).

    Raises:
        CatalogError: one is not a JSON object (a damaged catalog row).
    """
    if all(isinstance(v, str) for v in values):
        try:
            decoded: list[Any] = json.loads("[" + ",".join(values) + "]")
        except ValueError:
            decoded = []
        if len(decoded) == len(values) and all(isinstance(d, dict) for d in decoded):
            return decoded
    return [_object(v) for v in values]  # find the damaged one


def _object(value: Any) -> dict[str, Any]:
    try:
        decoded = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        decoded = None
    if not isinstance(decoded, dict):
        raise damaged(f"a version's metadata or metrics hold {str(value)[:60]!r}, not a JSON object")
    return decoded


def versions(rows: Sequence[Sequence[Any]], tags: Mapping[str, tuple[str, ...]]) -> list[Version]:
    """:class:`Version` values of rows whose first items are :data:`VERSION_COLUMNS`: the one
    place a version row becomes a Version.

    ``meta`` / ``metrics`` may be JSON text or already decoded. Rows are read by
    position: at 10,000 versions, attribute access alone would cost ~100 ms.

    Raises:
        CatalogError: a row's metadata or metrics are not a JSON object (a damaged catalog).
    """
    metas = _decoded([r[9] for r in rows])
    metrics = _decoded([r[10] for r in rows])
    utc, moment, make, get = timezone.utc, datetime.fromtimestamp, Version, tags.get  # hot loop
    # positional, in Version's field order (keywords cost 10% of the loop); degraded is False
    return [make(r[0], r[1], r[2], moment(r[4], utc), r[5], r[6], r[7], r[8], r[3], get(r[0], ()),
                 meta, metric, r[11], False, r[12], None if r[13] is None else _stall(r[13]))
            for r, meta, metric in zip(rows, metas, metrics, strict=True)]


def _stall(value: object) -> float | None:
    """A version's ``stall_s`` (NULL: unknown, before migration 0011 or after a rebuild)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise damaged(f"a version's stall_s is {value!r}, not a non-negative number")
    return float(value)


def version(row: Sequence[Any], tags: tuple[str, ...] = ()) -> Version:
    """The :class:`Version` of one version row (see :func:`versions`)."""
    return versions([row], {row[0]: tags})[0]


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


class StoredContent(NamedTuple):
    """A ``contents`` row: one distinct tensor content's chunk list (ids concatenated)."""

    nbytes: int
    chunk_size: int
    chunk_ids: bytes


def content_row(row: Row[Any]) -> StoredContent:
    """A ``contents`` row as a :class:`StoredContent`, once its values are of their types."""
    ids = row.chunk_ids
    if not (isinstance(ids, (bytes, bytearray, memoryview)) and len(ids) % _ID_BYTES == 0
            and _count(row.nbytes) and _count(row.chunk_size) and row.chunk_size > 0):
        raise damaged(f"the content row {str(row.digest)[:12]} holds values of the wrong type")
    return StoredContent(row.nbytes, row.chunk_size, row.chunk_ids)


def grouped(pairs: Iterable[Any]) -> dict[str, tuple[str, ...]]:
    """``(version id, name)`` pairs -> each version id's names, in the pairs' order."""
    found: dict[str, list[str]] = {}
    for version_id, name in pairs:
        found.setdefault(version_id, []).append(name)
    return {k: tuple(v) for k, v in found.items()}


def tags_of(conn: Connection, ids: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """The tag names, sorted, of each version among ``ids`` that has any."""
    query = select(s.tags.c.version_id, s.tags.c.name).order_by(s.tags.c.name)
    if len(ids) <= 500:
        query = query.where(s.tags.c.version_id.in_(ids))
    # else: a long listing; a store has far fewer tags than versions, so read them all
    wanted = set(ids)
    return grouped(row for row in conn.execute(query) if row[0] in wanted)
