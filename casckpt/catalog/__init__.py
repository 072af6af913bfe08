"""The SQL catalog: the authoritative record of runs, versions, tags, tensors, chunks and packs."""

from casckpt.catalog.catalog import Catalog, ChunkLocation, MissingChunksError, PackRecord

__all__ = ["Catalog", "ChunkLocation", "MissingChunksError", "PackRecord"]
