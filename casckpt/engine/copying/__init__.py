"""Copying: versions moved from one store to another, as git moves commits.

Owns ``copyplan`` (which versions a copy publishes -- the ones asked for and their missing
ancestors -- and which chunks and tree nodes the destination lacks), ``copynodes`` (the
nodes a plan keeps as ids and sizes, read again from the source when sent), ``copychunks`` (those
chunks read from the source and verified), ``copypipe`` (every chunk of a copy read ahead
and packed through one packer of the destination's own write path, across versions) and
``copy`` (leases on both stores, each version published in one catalog
transaction, tags and forks carried over); and ``rekey``, copies between stores whose chunk
ids are keyed differently, each version committed again through the destination's commit
pipeline.

May import: ``write`` (chunks are packed by the destination's packer through
``commitchunks.pack_chunks``), ``read`` (chunks and tree nodes read from the source,
verified), ``context`` and every room below them. Nothing in the engine imports this room;
the store facade calls it.

Call order: ``copyplan.plan`` (reads both catalogs and the source's tree nodes; writes
nothing) -> ``copy.execute`` (versions in order, ancestors first: lease, chunks into the
pipeline, manifest object; each published once its packs are recorded, while the next
versions' chunks flow). A dry run stops after the plan.
"""
