"""One version in detail (``Store.show``): its tensors, plain values, delta chains, health.

Served from the catalog: the manifest copy it keeps (a tree version's nodes when the
tensors are listed), its delta rows, and the packs below their redundancy. A tree
version whose document keeps a summary answers ``tensors=False`` from the document alone.
"""

from __future__ import annotations

from casckpt.catalog import deltas as deltas_sql
from casckpt.catalog.rows import VersionRow
from casckpt.engine.context import StoreView
from casckpt.engine.read import degraded, treeviews
from casckpt.engine.versions.refs import bind
from casckpt.format.dtypes import element_size
from casckpt.format.manifest import Manifest, TreeHead, sharding
from casckpt.format.state import iter_values, rank_path
from casckpt.format.treemanifest import head_values
from casckpt.types import TensorInfo, Version, VersionDetail, group_tensors, natural_key, sorted_groups


def version_detail(ctx: StoreView, row: VersionRow, version: Version, *, tensors: bool) -> VersionDetail:
    """The :class:`~casckpt.types.VersionDetail` of ``row`` (``version``: the row with its
    tags); ``tensors=False`` leaves the per-tensor list out and fills only the summary."""
    views = treeviews.Trees(ctx.catalog)
    head = bind(row, treeviews.head(ctx.catalog, row.id))  # a tree's head, an older document whole
    quick = None if tensors else _summary(ctx, version, head.tree)
    if quick is not None:
        return quick
    manifest = views.whole(row, head)
    pieces = sharding(manifest)
    if tensors:
        found = views.rows_of(row, manifest)[0]
        listed = tuple(sorted((
            TensorInfo(t.path, t.dtype, tuple(t.shape), t.nbytes, t.chunks, t.digest,
                       *pieces.get(t.path, (1, ())))
            for t in found), key=lambda t: natural_key(t.path)))
        groups = group_tensors((t.path, t.nbytes) for t in listed)
    else:
        listed = ()
        groups = group_tensors(_tensor_sizes(manifest))
    world = manifest.world
    ids = list(dict.fromkeys(c.hex() for c in manifest.chunk_ids()))
    delta_chunks, longest = deltas_sql.version_deltas(ctx.catalog, ids)
    below = degraded.of_chunks(ctx, ids)
    return VersionDetail(version, listed, dict(iter_values(manifest.root)),
                         world.size if world else None, world.api if world else None,
                         delta_chunks, longest, degraded=bool(below), degraded_packs=len(below),
                         degraded_detail=degraded.summary(below) if below else None,
                         tensor_count=sum(g.tensors for g in groups),
                         tensor_bytes=sum(g.nbytes for g in groups), tensor_groups=groups)


def _summary(ctx: StoreView, version: Version, tree: TreeHead | None) -> VersionDetail | None:
    """``tensors=False`` of a tree version from its document alone (None: the document keeps
    no summary -- a document of format 1 or 2 never does --, or the store has degraded packs
    or delta chunks: read the tree)."""
    values = None if tree is None else head_values(tree)
    if tree is None or tree.groups is None or values is None or \
            deltas_sql.any_deltas(ctx.catalog) or degraded.anywhere(ctx):
        return None
    return VersionDetail(version, (), values, None, None, 0, 0, degraded=False,
                         tensor_count=tree.tensors, tensor_bytes=tree.nbytes,
                         tensor_groups=sorted_groups(tree.groups))


def _tensor_sizes(manifest: Manifest) -> list[tuple[str, int]]:
    """``(path, logical bytes)`` of every tensor (a sharded one once, whole; a rank's own
    tensors under ``rankN/``), as show's rows count them."""
    sizes: dict[str, int] = {}
    for t in manifest.tensors:
        path = rank_path(t.rank, t.path) if t.rank is not None and not t.is_shard else t.path
        sizes[path] = sizes.get(path, 0) + t.numel * element_size(t.kind, t.dtype)
    return list(sizes.items())
