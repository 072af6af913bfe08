"""Bringing a soft-deleted version back (``Store.undelete``), while gc has not swept it.

A deleted version can come back only while every object it needs is still there: its
manifest on a location and every chunk row in the catalog (the catalog checks the chunks in
the transaction that revives it, so a gc sweeping meanwhile is seen). A version migrated to
a tree revives its tree nodes with its chunks.
"""

from __future__ import annotations

from casckpt.catalog import MissingChunksError
from casckpt.catalog import retention as retention_sql
from casckpt.catalog.treemigrate import tree_root
from casckpt.engine.context import EngineContext
from casckpt.engine.read import trees
from casckpt.errors import RefNotFoundError, VersionSweptError
from casckpt.format import objectnames
from casckpt.types import Version


def undelete(ctx: EngineContext, ref: str | Version) -> str:
    """Make the deleted version ``ref`` names visible again; returns its id.

    Raises:
        RefNotFoundError, AmbiguousRefError: no (single) deleted version matches.
        VersionSweptError: GC already swept some of its data; it is gone.
    """
    row = retention_sql.resolve_deleted(ctx.catalog, ref.id if isinstance(ref, Version) else ref)
    label = f"{row.run}@{row.step}"
    if not ctx.locations.exists_anywhere(objectnames.manifest_name(row.id)):
        raise VersionSweptError(label, "GC already removed its manifest; it cannot be undeleted")
    manifest = trees.migrated(  # a migrated version's nodes are revived with its chunks
        trees.decode(ctx, ctx.catalog, ctx.catalog.manifest(row.id), row.id),
        tree_root(ctx.catalog, row.id), ctx.crypto.chunk_id)
    chunk_ids = [cid.hex() for cid in manifest.chunk_ids()]
    try:
        if not retention_sql.undelete_version(ctx.catalog, row.id, chunk_ids):
            raise RefNotFoundError(label, "it is no longer deleted (undeleted or purged meanwhile)")
    except MissingChunksError as exc:
        raise VersionSweptError(
            label, f"GC already swept {len(exc.missing)} of its chunks; it cannot be undeleted"
        ) from None
    version_id: str = row.id
    return version_id
