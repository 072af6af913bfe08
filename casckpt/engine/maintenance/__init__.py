"""Maintenance: what keeps a store correct and small after it was written.

Owns garbage collection (``gc``: retention applied, mark, condemn, sweep, repack; ``gcguard``:
what gc must prove before deleting; ``deleterights``: the rights it needs; ``retention``: the
rules, pure), integrity (``check``, ``checkmeta`` without data, ``scrub`` streamed pack reads,
``repair``, ``rebuild`` of the catalog from the locations), restore drills and the interval
advisor (``drill``, ``advise``), the store's encryption keys (``keyring``) and the tree
migration of old versions (``treemigrate``).

May import: ``write`` (gc repacks through the packer; the migration commits through the
commit pipeline), ``read``, ``context`` and every room below them. Nothing in the engine
imports this room; the store facade and the CLI call it.

Call order: every operation takes an :class:`~casckpt.engine.context.EngineContext` built
by the store and runs to completion in the calling thread (gc under the store-wide gc lock,
a drill or a check without writing anything but their records).
"""
