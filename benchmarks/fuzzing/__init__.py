"""A fuzz campaign over every parser and reader casckpt has (issue 13).

Each target starts from real, valid inputs the code itself produced (packs
written by PackWriter, erasure-coded shards, manifests of both versions, a
store's config file, refs records, catalog rows of a real store), mutates
them hostilely, hands the result to the parser or reader, and classifies
what happened: accepted and verified correct, rejected with a CasckptError,
or a bug -- another exception, a hang, a worker that died, or wrong data.

``benchmarks/fuzz.py`` runs the campaign; ``tests/benchmarks/test_fuzz.py`` runs a few
hundred cases of it in CI.
"""
