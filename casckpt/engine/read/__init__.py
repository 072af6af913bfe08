"""Read: versions read back, and the queries over what they hold.

Owns the verified chunk reader (``reader``: every chunk checked against its id,
reconstructed when damaged; its plain reads in ``chunkreads``, its delta chains in
``deltachains``, which decodes each node with ``deltadecode``), restores (``restore``: a
state rebuilt in memory, into given targets (``targets``) or on a device; ``checkout``,
``checkoutwork``, ``dircompare``: a directory snapshot written to disk), tree versions
(``trees``: nodes from the catalog, then the packs; ``treeviews``: queries over them),
``history`` (where a tensor changed along a lineage) and ``degraded`` (packs and versions
stored with less redundancy than promised).

May import: ``context`` and every room below it. ``write`` and ``maintenance`` import this
room; it imports neither.

Call order: resolve a ref (``versions.refs``), load its verified manifest, then read its
chunks (``reader.read_chunks``); nothing here writes a version.
"""
