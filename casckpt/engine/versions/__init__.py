"""Versions as the catalog names and describes them, without reading a pack.

Owns refs (``refs``: ``run@step``, ``tag:NAME``, id prefixes; a manifest bound to its row),
input checks (``validate``, ``logfilter``), what can be read from this host
(``durability``), tree nodes from the catalog and a row's tree root (``nodes``), what a
version references (``references``), how tensors map to extents (``extents``), a
version's tensor rows (``tensorrows``) and the catalog's mutable state mirrored on the
locations (``records``).

May import: the layers below the engine only (catalog, storage, format); no other room.
Every room above may import it.

Call order: pure functions over the catalog's values and manifests; no state is held.
"""
