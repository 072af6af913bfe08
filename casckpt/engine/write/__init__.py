"""Write: the commit pipeline, from a state to a published version.

Owns the pipeline a version is written through -- ``commit`` (request, snapshot, publish),
``commitchunks`` (chunk, hash, dedup, delta-code, encode), ``packer`` (fill packs, store
them on the pack layer or hold them on the fast tier) -- with ``hint`` (tensors a caller
vouches unchanged), ``background`` (the committer that orders every commit of a store, in
the foreground or the background; ``commithandle``, what a background commit's caller
holds), ``group`` and ``distributed`` (a version written by many
ranks).

May import: ``read`` (a commit reads its parent's manifest and tree), ``context`` and every
room below them. Only ``maintenance`` imports this room.

Call order: ``commit.prepare`` -> ``commitchunks`` writes chunks through a ``Packer``
(``add``... ``finish``) -> ``commit.publish`` stores the manifest and publishes the
version in one catalog transaction; ``background.BackgroundCommitter`` runs that sequence
for every commit of a store, in order.
"""
