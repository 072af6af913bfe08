"""The SQL catalog: the authoritative record of runs, versions, tags, tensors, chunks, packs and shards."""

from casckpt.catalog.catalog import Catalog
from casckpt.catalog.packs import ChunkLocation, PackLayout, ShardRow, StoredPack
from casckpt.catalog.publish import MissingChunksError

__all__ = ["Catalog", "ChunkLocation", "MissingChunksError", "PackLayout", "StoredPack", "ShardRow"]
