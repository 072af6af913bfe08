"""The SQL catalog: the authoritative record of runs, versions, tags, tensors, chunks, packs and shards."""

from casckpt.catalog.catalog import Catalog, MissingChunksError
from casckpt.catalog.packs import ChunkLocation, PackLayout, PackRecord, ShardRow

__all__ = ["Catalog", "ChunkLocation", "MissingChunksError", "PackLayout", "PackRecord", "ShardRow"]
