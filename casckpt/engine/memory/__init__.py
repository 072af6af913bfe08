"""What one store keeps in memory between operations, owned by its engine context.

Owns ``deltabase`` (delta coding on commit: the base each new chunk is coded against, and
:class:`~casckpt.engine.memory.deltabase.BaseCache`, recent commits' raw chunks, bounded by
``delta_memory``) and ``staging`` (device-to-host staging through a reused pair of pinned
buffers, bounded by ``staging_memory``).

May import: the layers below the engine only; no other room.

Call order: built once by the store into its context; thread-safe; bounded; dropped at close.
"""
