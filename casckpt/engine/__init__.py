"""The engine: commit, restore and check pipelines over a catalog, a cache and a blob store."""
