"""What the engine works with: the catalog, the index cache, the blob store and its knobs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from casckpt.cache import IndexCache
from casckpt.catalog import Catalog
from casckpt.config import Settings
from casckpt.storage import BlobStore


@dataclass(slots=True)
class EngineContext:
    """The components one store's engine operations share. Owned by ``Store``.

    ``pool`` runs CPU work and reads (hashing, encoding, ranged reads);
    ``uploads`` stores finished packs, so they upload while the next fills.
    """

    catalog: Catalog
    cache: IndexCache
    blobs: BlobStore
    staging: Path
    config: Settings
    pool: ThreadPoolExecutor
    uploads: ThreadPoolExecutor


def pack_key(pack_id: str) -> str:
    """The object key of a pack: ``packs/<first 2 hex>/<id>``."""
    return f"packs/{pack_id[:2]}/{pack_id}"


def manifest_key(version_id: str) -> str:
    """The object key of a version's manifest."""
    return f"manifests/{version_id}"
