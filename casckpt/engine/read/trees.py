"""Tree manifests in the engine: where their nodes are read from, and what a commit adds.

A node is read from the catalog (``tree_nodes``, :class:`~casckpt.engine.versions.nodes.StoreNodes`);
a node the catalog lacks (a catalog being rebuilt, a row lost) is read from the packs like
any chunk (:func:`read_nodes`), verified against its id either way
(:func:`casckpt.format.merkle.decode_node`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from casckpt.catalog import Catalog
from casckpt.catalog import nodes as node_sql
from casckpt.engine.context import EngineContext
from casckpt.engine.versions.nodes import StoreNodes, parse_root
from casckpt.engine.versions.tensorrows import tensor_rows
from casckpt.errors import CorruptManifestError
from casckpt.format.chunks import ChunkIds
from casckpt.format.manifest import Manifest, decode_manifest
from casckpt.format.merkle import Nodes, NodeSource, compress_node, decode_node, node_json
from casckpt.format.treeencode import Tree
from casckpt.format.treemanifest import head_of, with_tree
from casckpt.format.treeread import TreeReader


def read_nodes(ctx: EngineContext, ids: Sequence[bytes], *, heal: bool = True) -> dict[bytes, bytes]:
    """Nodes read from the packs, as chunks (the ones the catalog has no chunk row for are left out)."""
    located = ctx.catalog.find_chunks([i.hex() for i in ids], live_only=False)
    buffers = {bytes.fromhex(h): bytearray(loc.raw_len) for h, loc in located.items()}
    if buffers:
        from casckpt.engine.read.reader import read_chunks  # the pack reader: nodes missing from the catalog

        read_chunks(ctx, {cid: [memoryview(buf)] for cid, buf in buffers.items()},
                    lambda cid: f"tree node {cid.hex()[:12]}", heal=heal)
    return {cid: bytes(buf) for cid, buf in buffers.items()}


def store_nodes(ctx: EngineContext, *, heal: bool = True) -> StoreNodes:
    """Nodes from the catalog, then the packs (``heal``: see :func:`read_nodes`)."""
    return StoreNodes(ctx.catalog, partial(read_nodes, ctx, heal=heal))


def nodes_of(ctx: EngineContext) -> Nodes:
    """A node cache reading through the catalog, then the packs."""
    return Nodes(store_nodes(ctx))


def reader(ctx: EngineContext) -> TreeReader:
    """A :class:`TreeReader` over this store's nodes."""
    return TreeReader(nodes_of(ctx))


def decode(ctx: EngineContext | None, catalog: Catalog, data: bytes, version_id: str, *,
           heal: bool = True) -> Manifest:
    """A manifest of any version, a tree manifest read whole (nodes from the catalog, then the
    packs when ``ctx`` is given)."""
    read_missing = None if ctx is None else partial(read_nodes, ctx, heal=heal)
    return decode_manifest(data, version_id, StoreNodes(catalog, read_missing))


class _PackNodes(NodeSource):
    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx
        self.chunk_ids = ctx.crypto.chunk_id

    def get_many(self, ids: Sequence[bytes]) -> Mapping[bytes, bytes]:
        return read_nodes(self.ctx, ids)


def restore_node_rows(ctx: EngineContext, data: bytes, version_id: str, tree_root: str | None = None) -> int:
    """Put back the catalog rows of a tree version's nodes that are missing or do not verify,
    from the nodes' copies in the packs (verified); returns how many rows were written.
    ``tree_root``: the root the version's row names (a migrated version's document has none).

    Raises:
        CorruptManifestError: a node is in neither place intact (check reports it).
    """
    if tree_root is None:  # a document of format 1 or 2 not migrated: no tree
        return 0
    head = decode_manifest(data, version_id)
    root = head.tree.root if head.tree is not None else parse_root(tree_root)
    if root is None:
        return 0
    try:
        TreeReader(Nodes(StoreNodes(ctx.catalog))).expand(root)
        return 0  # every row is there and verifies
    except CorruptManifestError:
        pass
    reader = TreeReader(Nodes(_PackNodes(ctx)))
    try:
        reader.expand(root)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as exc:
        raise CorruptManifestError(f"a tree node in the packs is malformed: {exc}") from exc
    have = node_sql.tree_nodes(ctx.catalog, [i.hex() for i in reader.visited])
    bad = []
    for node_id in reader.visited:
        body = have.get(node_id.hex())
        try:
            if body is None:
                raise CorruptManifestError("no row")
            decode_node(node_json(body), node_id, ctx.crypto.chunk_id)
        except CorruptManifestError:
            bad.append(node_id)
    found = read_nodes(ctx, bad)
    rows = []
    for node_id in bad:
        decode_node(found[node_id], node_id, ctx.crypto.chunk_id)  # verified again: this copy is written
        rows.append({"id": node_id.hex(), "body": compress_node(found[node_id])})
    node_sql.replace_tree_nodes(ctx.catalog, rows)
    return len(rows)


def node_rows(tree: Tree, ids: Sequence[bytes]) -> list[dict[str, Any]]:
    """Catalog rows of the nodes ``ids`` of ``tree``."""
    return [{"id": i.hex(), "body": compress_node(tree.nodes[i])} for i in ids]


def root_of(manifest: Manifest) -> str | None:
    """The tree root a version's row names (None: a document of format 1 or 2 not migrated)."""
    return manifest.tree.root.hex() if manifest.tree is not None else None


def catalog_rows(version_id: str, manifest: Manifest) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The per-tensor catalog rows a version has: one per tensor and per content for a
    document of format 1 or 2 not migrated, none for a tree (its nodes are its rows)."""
    if manifest.tree is not None:
        return [], []
    return tensor_rows(version_id, manifest.tensors, manifest.extents)


def recovered(ctx: EngineContext, manifest: Manifest, data: bytes, version_id: str
              ) -> tuple[Manifest, list[dict[str, Any]]]:
    """A manifest found in a location, as a catalog rebuild records it, and its node rows:
    a tree with its nodes read from the recovered packs (only read: damaged shards are left
    to repair); a document of format 1 or 2 migrated to a tree when the packs hold every
    node of its derived tree (a migrated version's), as it was."""
    if manifest.tree is not None:
        manifest = decode(ctx, ctx.catalog, data, version_id, heal=False)
        found = read_nodes(ctx, manifest.nodes, heal=False)
        return manifest, [{"id": i.hex(), "body": compress_node(raw)} for i, raw in found.items()]
    derived, tree = with_tree(manifest, ctx.crypto.chunk_id)
    if len(ctx.catalog.find_chunks([i.hex() for i in tree.nodes], live_only=False)) == len(tree.nodes):
        return derived, node_rows(tree, list(tree.nodes))
    return manifest, []


def adopted(manifest: Manifest, tree_root: str | None) -> Manifest:
    """A version's manifest as queries read it: a document of version 1 or 2 whose row names a
    tree (migrated, :mod:`.treemigrate`) gets that tree's head, so history, diff and show
    read its nodes (its ``tensors`` rows are gone). Nothing is hashed: ``casckpt check``
    verifies that the root is the tree of the document (:func:`migrated`)."""
    root = parse_root(tree_root) if manifest.tree is None else None
    return manifest if root is None else replace(manifest, tree=head_of(manifest, root))


def migrated(manifest: Manifest, tree_root: str | None, ids: ChunkIds) -> Manifest:
    """:func:`adopted`, the tree derived from the document and verified to be the one the row
    names, with its nodes (so ``chunk_ids`` names them: check reads them, undelete revives
    them). ``ids`` hashes chunks as the store does (``ctx.crypto.chunk_id``: keyed in an
    encrypted store, whose trees migrate-trees derived with keyed ids).

    Raises:
        CorruptManifestError: the row names another tree than the document's (the catalog
            is damaged; neither `casckpt repair` nor migrate-trees fixes it: rebuild the catalog
            from the locations, which derives the tree again).
    """
    if parse_root(tree_root) is None or manifest.tree is not None:
        return manifest
    derived, _ = with_tree(manifest, ids)
    if derived.tree is None or derived.tree.root.hex() != tree_root:
        raise CorruptManifestError(
            "the catalog names another tree root than the tree of the version's manifest: the "
            "catalog is damaged. Rebuild it from the locations (`casckpt catalog rebuild`)")
    return derived
