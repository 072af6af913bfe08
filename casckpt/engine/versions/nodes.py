"""Tree nodes from the catalog, and a version row's tree root.

The catalog side of :mod:`casckpt.engine.read.trees`: it reads no pack, so what only needs the
catalog (refs, the fast tier's eviction, tree views) does not depend on the engine context.
A reader that may fall back on the packs passes the function that reads them
(:func:`casckpt.engine.read.trees.store_nodes`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from casckpt.catalog import Catalog
from casckpt.catalog import nodes as node_sql
from casckpt.errors import CorruptManifestError
from casckpt.format.merkle import NodeSource, node_json

ReadNodes = Callable[[Sequence[bytes]], Mapping[bytes, bytes]]


class StoreNodes(NodeSource):
    """Nodes from the catalog, else from ``read_missing`` (None: the catalog only), which
    returns the nodes it found among the ids it is given."""

    def __init__(self, catalog: Catalog, read_missing: ReadNodes | None = None) -> None:
        self.catalog, self.read_missing = catalog, read_missing
        self.chunk_ids = catalog.crypto.chunk_id

    def get_many(self, ids: Sequence[bytes]) -> Mapping[bytes, bytes]:
        rows = node_sql.tree_nodes(self.catalog, [i.hex() for i in ids])
        found = {bytes.fromhex(k): node_json(v) for k, v in rows.items()}
        missing = [i for i in ids if i not in found]
        if missing and self.read_missing is not None:
            found.update(self.read_missing(missing))
        return found


def parse_root(tree_root: str | None) -> bytes | None:
    """A tree root as a version row names it (None: no tree).

    Raises:
        CorruptManifestError: it is not a node id.
    """
    if tree_root is None:
        return None
    try:
        root = bytes.fromhex(tree_root)
    except ValueError:
        root = b""
    if len(root) != 32:
        raise CorruptManifestError(f"the catalog names a malformed tree root {tree_root[:16]!r}")
    return root
