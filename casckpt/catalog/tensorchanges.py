"""``tensors.changed_bytes``: a tensor row's changed bytes against its version's parent.

History counts, for each version in which a tensor changed, the bytes of its
chunks that differ from its state before (``engine/read/history.py``).
Comparing chunk lists needs both ``contents`` rows: for a tensor that changes
in every version, 10,000 random reads of ``contents``, most of a history's
time (docs/perf/history3.md). So a ``tensors`` row (versions of formats 1 and
2) records that count against the tensor at the same path in its version's
parent (``versions.parent_id``), computed by :func:`changed_bytes` -- the rule
history applies -- when the row is written:

- ``Catalog.add_version`` (catalog rebuilds are the writers of such rows now):
  :func:`with_changed_bytes`, in the publishing transaction, before the insert;
- migration 0014 (existing rows) and rows written without it: :func:`fill`.

The value is a fact about two tensor states (dtype, shape, digest; a digest's
``contents`` row never changes while a tensor row uses it), so nothing that
deletes, hides or purges versions makes it wrong. History uses it only where
the state before the entry is exactly the parent's, and compares chunk lists
otherwise. NULL: unknown (no parent, no row at the path in the parent, or a
``contents`` row missing).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, and_, bindparam, select, update

from casckpt.catalog import schema as s
from casckpt.catalog.database import batches
from casckpt.format.chunks import ID_BYTES, differing_bytes

Content = Sequence[Any]
"""``(chunk_size, nbytes, chunk_ids)`` of a ``contents`` row, unchecked."""


def _valid(content: Content | None) -> bool:
    if content is None:
        return False
    size, _, ids = content
    return isinstance(ids, (bytes, memoryview)) and len(ids) % ID_BYTES == 0 and \
        isinstance(size, int) and size > 0


def changed_bytes(same_layout: bool, before: Content | None, now: Content | None, nbytes: int) -> int:
    """Bytes of a tensor of ``nbytes`` whose chunks differ from its state before: all of them
    unless both have the same dtype and shape (``same_layout``) and well-formed chunk lists of
    one chunk size, else those of the chunks whose id differs (at most ``nbytes``)."""
    if before is None or now is None or not (same_layout and _valid(before) and _valid(now)) \
            or before[0] != now[0]:
        return nbytes
    return min(nbytes, differing_bytes(now[0], now[1], before[2], now[2]))


def _shape(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _counted(row: Any) -> int | None:
    """``changed_bytes`` of a row of :func:`_pairs` (None when a ``contents`` row is missing)."""
    (_, _, dtype, shape, nbytes, size, content_nbytes, ids,
     parent_dtype, parent_shape, parent_size, parent_nbytes, parent_ids) = row
    if ids is None or parent_ids is None or not isinstance(nbytes, int):
        return None
    same = dtype == parent_dtype and _shape(shape) == _shape(parent_shape)
    return changed_bytes(same, (parent_size, parent_nbytes, parent_ids), (size, content_nbytes, ids), nbytes)


def _pairs(version_ids: Sequence[str]) -> Any:
    """Rows of versions ``version_ids`` lacking ``changed_bytes`` whose version's parent has a
    row at their path, with both rows' layouts and contents."""
    t, p, v = s.tensors, s.tensors.alias("p"), s.versions
    c, pc = s.contents, s.contents.alias("pc")
    query = (
        select(t.c.version_id, t.c.path, t.c.dtype, t.c.shape, t.c.nbytes,
               c.c.chunk_size, c.c.nbytes, c.c.chunk_ids,
               p.c.dtype, p.c.shape, pc.c.chunk_size, pc.c.nbytes, pc.c.chunk_ids)
        .select_from(t.join(v, v.c.id == t.c.version_id)
                     .join(p, and_(p.c.version_id == v.c.parent_id, p.c.path == t.c.path))
                     .outerjoin(c, c.c.digest == t.c.digest).outerjoin(pc, pc.c.digest == p.c.digest))
        .where(t.c.version_id.in_(version_ids), t.c.changed_bytes.is_(None))
    )
    return query


def fill(conn: Connection, version_ids: Sequence[str] | None = None) -> int:
    """Write ``changed_bytes`` where it is NULL and can be known (of ``version_ids`` only, when
    given), within the caller's transaction, a batch of versions at a time; returns the rows
    written. Idempotent."""
    t = s.tensors
    if version_ids is None:
        version_ids = list(conn.execute(
            select(t.c.version_id).where(t.c.changed_bytes.is_(None)).distinct()).scalars())
    statement = (update(t).where(t.c.version_id == bindparam("v"), t.c.path == bindparam("p"))
                 .values(changed_bytes=bindparam("n")))
    written = 0
    for ids in batches(version_ids):
        values = [{"v": r[0], "p": r[1], "n": n} for r in conn.execute(_pairs(ids))
                  if (n := _counted(r)) is not None]
        if values:
            conn.execute(statement, values)
        written += len(values)
    return written


def with_changed_bytes(conn: Connection, parent_id: str | None, rows: Sequence[dict[str, Any]],
                       contents: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` (a new version's ``tensors`` rows) with ``changed_bytes`` against parent
    ``parent_id``'s rows, read within the caller's transaction; ``contents``: the version's
    ``contents`` rows (a row the catalog already holds for a digest wins: it is the one kept)."""
    if not rows:
        return []
    parent: dict[str, Any] = {}
    if parent_id is not None:
        t, c = s.tensors, s.contents
        parent = {r[0]: r[1:] for r in conn.execute(
            select(t.c.path, t.c.dtype, t.c.shape, c.c.chunk_size, c.c.nbytes, c.c.chunk_ids)
            .select_from(t.outerjoin(c, c.c.digest == t.c.digest)).where(t.c.version_id == parent_id))}
    if not parent:
        return [{**r, "changed_bytes": None} for r in rows]
    found: dict[str, Content] = {d["digest"]: (d["chunk_size"], d["nbytes"], d["chunk_ids"])
                                 for d in contents}
    found.update(_stored(conn, list(found)))
    out = []
    for r in rows:
        old = parent.get(r["path"])
        n = None
        if old is not None and old[4] is not None and r["digest"] in found:
            same = r["dtype"] == old[0] and _shape(r["shape"]) == _shape(old[1])
            n = changed_bytes(same, old[2:], found[r["digest"]], r["nbytes"])
        out.append({**r, "changed_bytes": n})
    return out


def _stored(conn: Connection, digests: Sequence[str]) -> dict[str, Content]:
    c = s.contents.c
    return {r[0]: (r[1], r[2], r[3]) for batch in batches(digests) for r in conn.execute(
        select(c.digest, c.chunk_size, c.nbytes, c.chunk_ids).where(c.digest.in_(batch)))}
