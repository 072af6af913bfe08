"""The pack layer: packs stored as shards on the store's locations, read, verified, repaired.

Owns :class:`~casckpt.engine.packlayer.packs.Packs` (immutable; built by ``Packs.open``) and
its pieces, each usable alone: ``packlayouts`` (where each pack's shards are, cached, and
their health), ``packcoding`` (erasure coding, in worker processes), ``packplacement`` (the
redundancy policy and which location gets which shard), ``packwrite`` (a new pack written
to quorum), ``packread`` (ranged, striped and whole reads; reconstruction), ``packverify``,
``packrepair``; and ``tierreads``, this host's fast tier wrapped around the reader.

May import: ``tiering``, ``versions`` and the layers below the engine (catalog, storage,
format); never ``context`` or any room above it (the context is built from this room).

Call order: ``Packs.open(catalog, locations, io, ..., tier=)`` builds the pieces in the order
above, then wraps the reader with the tier; ``prepare`` before the first erasure-coded pack
is filled; ``close`` once no pack is being written.
"""
