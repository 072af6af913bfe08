"""The fast tier: commits land on this host's disk and drain to the locations.

Owns :class:`~casckpt.engine.tiering.tier.FastTier` (its directory, budget and eviction),
the drain (``drain``, ``DrainWorker``), ``wait_durable``, the loss of a tier
(``open_tier`` declares a wiped one lost; ``tierforget`` by hand) and ``tierstatus``.

May import: ``versions`` and the layers below the engine; never the pack layer (which wraps
the tier's reads: ``packlayer.tierreads``), the context, or any room above (the drain gets
the pack layer's write as a function).

Call order: ``open_tier`` at open (the store then builds its pack layer around the tier) ->
commits hold packs on it (``room_for``, ``write``) -> ``drain`` (a ``DrainWorker``, the CLI,
``Store.close``) -> ``close``.
"""
