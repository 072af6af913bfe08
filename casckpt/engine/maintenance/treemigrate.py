"""Migration of versions of manifest formats 1 and 2 into trees (``casckpt catalog migrate-trees``).

Formats 1 (one-process commits) and 2 (DCP saves, group commits: pieces and ranks) are
read-only: no writer makes them any more; this migration gives their versions the trees
a writer of today would make of them (:mod:`casckpt.format.treemanifest`).

A version id is the object id of its manifest document, so the document stays
as it is (format 1, in the catalog and on every location) and restores keep
reading it, bit for bit. What changes is the catalog: the version gets the
tree a commit of its state would write (:func:`casckpt.format.treemanifest.with_tree`:
the same encoder, the same extents and chunks), its nodes are written to the
packs like any commit's (the run's redundancy; kept, repaired and checked like
native nodes) and recorded as ``tree_nodes`` rows, ``versions.tree_root``
names the root, and its ``tensors`` rows (and the ``contents`` rows no one
else uses) go. Queries then read it as a tree.

Protocol, per batch of versions of one run:

1. decode each manifest (verified, bound to its row);
2. write the nodes the store holds no live copy of, through the commit path;
3. ONE catalog transaction (:func:`casckpt.catalog.treemigrate.adopt_trees`)
   re-checks every node, reviving condemned ones as publishing a commit does,
   adds the node rows, sets the tree roots and drops the rows; nodes gc swept
   meanwhile are written again and the transaction retried.

The whole run holds a commit lease, so gc condemns none of the nodes it
writes; nodes it reuses are revived in step 3, and a gc whose mark ran before
step 3 marks the version again before sweeping (it remembers which tree root
it marked). Resumable: each batch is one transaction, and a rerun picks up the
versions still without a tree; a second run finds nothing to do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from itertools import groupby
from typing import Any

from casckpt.catalog import MissingChunksError
from casckpt.catalog import gc as gc_sql
from casckpt.catalog import nodes as node_sql
from casckpt.catalog import treemigrate as sql
from casckpt.catalog.leases import begin_lease, release_lease
from casckpt.catalog.rows import manifest_bytes
from casckpt.engine.context import EngineContext
from casckpt.engine.read import treeindex
from casckpt.engine.versions.refs import bind
from casckpt.engine.write.commit import rewrite_lost
from casckpt.engine.write.commitchunks import node_chunks, write_chunks
from casckpt.errors import CatalogError, IntegrityError
from casckpt.format.manifest import decode_manifest
from casckpt.format.merkle import compress_node
from casckpt.format.treeencode import Tree
from casckpt.format.treemanifest import with_tree
from casckpt.storage.erasure import Redundancy
from casckpt.types import MigrationReport, ProgressCallback

log = logging.getLogger(__name__)

BATCH_VERSIONS = 50
"""Versions per transaction (fewer when their trees hold many tensors)."""
BATCH_TENSORS = 200_000
_ATTEMPTS = 3


@dataclass(slots=True)
class _Tally:
    migrated: int = 0
    left: int = 0
    nodes: int = 0
    rows: int = 0


def migrate(ctx: EngineContext, progress: ProgressCallback | None = None) -> MigrationReport:
    """Give every visible version of manifest formats 1 and 2 its tree (see the module docstring).

    Safe while other processes commit, restore and collect garbage; idempotent.

    Raises:
        CatalogError: nodes kept disappearing (a gc with grace 0 in a loop); run again.
        StorageError: the nodes could not be written (nothing was published for that batch).
    """
    started = time.monotonic()
    tally = _Tally()
    todo = sql.without_tree(ctx.catalog)
    lease = begin_lease(ctx.catalog)
    try:
        done = 0
        for run, versions in groupby(todo, key=lambda pair: pair[1]):
            ids = [version_id for version_id, _ in versions]
            redundancy = ctx.packs.placement.redundancy_for(run)
            ctx.packs.placement.check_writable(redundancy)
            for batch in _batches(ctx, ids, tally):
                _migrate_batch(ctx, batch, redundancy, tally)
                done += len(batch)
                if progress is not None:
                    progress("migrate", done, len(todo))
    finally:
        release_lease(ctx.catalog, lease, "a tree migration")
    indexed = treeindex.backfill(ctx.catalog)  # the key is at hand: the trees are read and verified
    return MigrationReport(tally.migrated, tally.left, tally.nodes, tally.rows, time.monotonic() - started,
                           indexed)


def _batches(ctx: EngineContext, ids: list[str], tally: _Tally) -> Iterator[dict[str, Tree]]:
    """The trees of the versions of formats 1 and 2 among ``ids``, a batch at a time."""
    batch: dict[str, Tree] = {}
    tensors = 0
    for rows in gc_sql.manifest_batches(ctx.catalog, ids, size=BATCH_VERSIONS):
        for row in rows:
            try:
                manifest = bind(row, decode_manifest(manifest_bytes(row.manifest, row.id), row.id))
            except IntegrityError as exc:
                log.warning("not migrating %s@%s (%s): %s; run `casckpt check`", row.run, row.step,
                            row.id[:12], exc)
                tally.left += 1
                continue
            if manifest.tree is not None:
                continue
            batch[row.id] = with_tree(manifest, ctx.crypto.chunk_id)[1]
            tensors += len(manifest.tensors)
            if len(batch) >= BATCH_VERSIONS or tensors >= BATCH_TENSORS:
                yield batch
                batch, tensors = {}, 0
    if batch:
        yield batch


def _migrate_batch(ctx: EngineContext, batch: dict[str, Tree], redundancy: Redundancy,
                   tally: _Tally) -> None:
    """Write the batch's missing nodes, then publish its trees."""
    chunks = {i: c for tree in batch.values() for i, c in node_chunks(tree).items()}
    live = ctx.catalog.find_chunks([i.hex() for i in chunks])  # condemned ones: written again
    new = [i for i in chunks if i.hex() not in live]
    write_chunks(ctx, chunks, new, redundancy, None)
    tally.nodes += len(new)
    _publish_batch(ctx, batch, chunks, redundancy, tally)


def _publish_batch(ctx: EngineContext, batch: dict[str, Tree], chunks: dict[bytes, Any],
                   redundancy: Redundancy, tally: _Tally) -> None:
    """ONE transaction per try gives the batch's versions their trees; nodes gc swept since
    they were found or written are written again (as a commit's publish does)."""
    roots = {version_id: tree.root.hex() for version_id, tree in batch.items()}
    bodies = {i: raw for tree in batch.values() for i, raw in tree.nodes.items()}
    for _ in range(_ATTEMPTS):
        have = node_sql.tree_node_ids(ctx.catalog, [i.hex() for i in bodies])
        rows = [{"id": i.hex(), "body": compress_node(raw)}
                for i, raw in bodies.items() if i.hex() not in have]
        try:
            versions, deleted = ctx.catalog.retrying(partial(
                sql.adopt_trees, ctx.catalog, roots, rows, [i.hex() for i in bodies]))
        except MissingChunksError as exc:
            rewrite_lost(ctx, chunks, exc.missing, redundancy, None, next(iter(roots)))
            tally.nodes += len(set(exc.missing))
            continue
        tally.migrated += versions
        tally.rows += deleted
        return
    raise CatalogError("could not migrate versions to trees: their nodes kept disappearing (is a gc "
                       "with --grace 0 running in a loop?); run `casckpt catalog migrate-trees` again")
