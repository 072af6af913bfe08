"""What a version references: the chunks and tree nodes gc marks live and the fast tier keeps
resident for the newest versions. Reads the catalog only (the manifest on the row, the nodes
through a :class:`~casckpt.engine.versions.nodes.StoreNodes`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from casckpt.catalog.rows import manifest_bytes
from casckpt.engine.versions.nodes import StoreNodes, parse_root
from casckpt.engine.versions.refs import bind
from casckpt.format import treeread
from casckpt.format.manifest import decode_manifest


def references(row: Any, nodes: StoreNodes, seen: set[bytes]) -> Iterator[bytes]:
    """The chunk and node ids a version references. A tree is walked from its root, skipping
    the nodes in ``seen``; other versions' manifests are read whole -- a document of version
    1 migrated to a tree (its row names the root) too: the root is the catalog's word alone,
    so the version's data is marked from its document, and a damaged root can cost the
    nodes of its tree (check reports it; migrate-trees or a rebuild restores them), never
    the data (a document of version 2 alike)."""
    data = manifest_bytes(row.manifest, row.id)
    manifest = bind(row, decode_manifest(data, row.id))  # a tree manifest's head; others whole
    if manifest.tree is None:
        yield from manifest.chunk_ids()
        root = parse_root(row.tree_root)
    else:
        yield from (c for b in manifest.tree.shared for c in b.chunks)
        root = manifest.tree.root
    if root is not None:
        yield from treeread.referenced(nodes, root, seen)
