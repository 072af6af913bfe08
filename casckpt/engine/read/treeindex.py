"""The ``tree_changes`` rows of a tree version against any version, read from their trees:
what tensor history records for a version committed without them, or whose rows are against
a version no longer listed before it (a deleted or purged one; :mod:`casckpt.catalog.treechanges`).

The rows are what a commit records (:mod:`casckpt.engine.write.treeindex`), told from the
trees instead of the encoder: every tensor whose digest differs from the base's at its path
(with the changed bytes of :func:`casckpt.catalog.tensorchanges.changed_bytes`), and every
path the base has and the version lacks. Reading a tree verifies its nodes (the store's key
in an encrypted store), so this runs where the store is open: tensor history (recording what
it computed when the handle may write), ``casckpt migrate-trees`` and catalog rebuilds.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from casckpt.catalog import Catalog, tensorchanges, treechanges
from casckpt.catalog.rows import StoredContent
from casckpt.engine.read import treeviews
from casckpt.engine.versions.refs import bind
from casckpt.errors import CatalogError, RefNotFoundError

log = logging.getLogger(__name__)

Rows = dict[str, tuple[str | None, list[treechanges.Change]]]
"""Version id -> (base id, its rows against the base)."""


def _row(path: str, before: Any, now: Any, contents: Mapping[str, StoredContent]) -> treechanges.Change:
    if now is None:
        return (path, None, None, 0, None, None)
    changed = None
    if before is not None:
        same = before.dtype == now.dtype and tuple(before.shape) == tuple(now.shape)
        was, content = contents.get(before.digest), contents.get(now.digest)
        changed = tensorchanges.changed_bytes(
            same, (was.chunk_size, was.nbytes, was.chunk_ids) if was is not None else None,
            (content.chunk_size, content.nbytes, content.chunk_ids) if content is not None else None,
            now.nbytes)
    return (path, now.dtype, json.dumps(list(now.shape)), now.nbytes, bytes.fromhex(now.digest), changed)


def rows_against(views: treeviews.Trees, version_id: str, base_id: str | None) -> list[treechanges.Change]:
    """Version ``version_id``'s rows against version ``base_id`` (None: against no tensor).

    Raises:
        RefNotFoundError: either version is gone from the catalog.
    """
    catalog = views.catalog
    rows = {}
    for vid in (version_id, base_id):
        if vid is not None:
            found = catalog.version(vid)
            if found is None:
                raise RefNotFoundError(vid[:12], "the version was purged while its history was read")
            rows[vid] = (found, bind(found, treeviews.head(catalog, vid)))
    row, head = rows[version_id]
    if base_id is None:
        now, contents = views.rows_of(row, head)
        return [_row(t.path, None, t, contents) for t in now]
    base_row, base_head = rows[base_id]
    if views.comparable(base_head, head):
        tensors, contents, _, _ = views.differences(base_head, head)
        return [_row(p, x, y, contents) for p, x, y in tensors]
    old, old_contents = views.rows_of(base_row, base_head)
    new, new_contents = views.rows_of(row, head)
    before, after = {t.path: t for t in old}, {t.path: t for t in new}
    contents = {**catalog_contents(catalog, old, new, old_contents, new_contents)}
    return [_row(p, before.get(p), after.get(p), contents) for p in sorted(before.keys() | after.keys())
            if p not in before or p not in after or before[p].digest != after[p].digest]


def catalog_contents(catalog: Catalog, old: Sequence[Any], new: Sequence[Any],
                     old_contents: Mapping[str, StoredContent], new_contents: Mapping[str, StoredContent]
                     ) -> dict[str, StoredContent]:
    """The contents of both sides' tensors: a tree's derived, a format-1 version's from the catalog."""
    from casckpt.catalog import history as sql

    wanted = [t.digest for t in (*old, *new) if t.digest not in old_contents and t.digest not in new_contents]
    return {**sql.contents(catalog, wanted), **old_contents, **new_contents}


def index(catalog: Catalog, wanted: Sequence[tuple[str, str | None]]) -> Rows:
    """The rows of each ``(version, base)`` in ``wanted``, recorded in the catalog when this
    handle may write it (replacing what the version had).

    Recording is a cache of what the trees say: where it fails -- a PostgreSQL writer role may
    delete no rows but its leases, another handle indexed the same version first (a unique
    key), the catalog is briefly unreachable -- the rows are still returned and answer this
    call, and a later writer with the rights (``casckpt migrate-trees``) records them."""
    views = treeviews.Trees(catalog)
    computed: Rows = {vid: (base, rows_against(views, vid, base)) for vid, base in wanted}
    if computed and not catalog.read_only:
        try:
            with catalog.write() as conn:
                new = treechanges.replace(conn, computed, catalog.path_ids)
        except CatalogError as exc:
            log.info("tensor history: the rows of %d version(s) were computed from their trees but "
                     "not recorded (%s); `casckpt migrate-trees` records them", len(computed), exc)
        else:
            catalog.path_ids.update(new)
    return computed


def state_of(rows: Sequence[treechanges.Change], path: str) -> tuple[Any, ...] | None:
    """The state ``tree_changes.states`` reads for ``path`` from a version's rows (None: no row)."""
    for p, dtype, shape, nbytes, digest, changed in rows:
        if p == path:
            return (dtype, shape, nbytes, digest.hex() if digest is not None else None, changed)
    return None


BACKFILL_BATCH = 50
"""Versions indexed per catalog transaction by :func:`backfill`."""


def backfill(catalog: Catalog) -> int:
    """Record the rows of every visible tree version that has none against the version listed
    before it in its run's lineage (versions committed before ``tree_changes``, by a process
    group, or restored by a rebuild; or whose base was deleted); returns how many.
    Idempotent: a second run finds nothing to do."""
    from casckpt.catalog import history as sql

    done: set[str] = set()
    for run in sql.lineage_rows(catalog):
        segments = sql.lineage(catalog, run.name)
        if not segments:
            continue
        _, _, stale = sql.tensor_changes(catalog, segments, "")  # no tensor has an empty path
        todo = [(vid, base) for vid, base in stale if vid not in done]
        for start in range(0, len(todo), BACKFILL_BATCH):
            index(catalog, todo[start : start + BACKFILL_BATCH])
        done.update(vid for vid, _ in todo)
    return len(done)
