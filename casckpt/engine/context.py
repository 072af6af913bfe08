"""What the engine works with: the catalog, the index cache, the blob store and its knobs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from casckpt.cache import IndexCache
from casckpt.catalog import Catalog
from casckpt.config import Settings
from casckpt.engine.deltabase import BaseCache
from casckpt.engine.packstore import PackStore
from casckpt.engine.staging import StagingBuffers
from casckpt.storage.locations import LocationSet
from casckpt.storage.scratch import ScratchDir


@dataclass(slots=True)
class EngineContext:
    """The components one store's engine operations share. Owned by ``Store``.

    ``pool`` runs CPU work and reads (hashing, encoding, ranged reads);
    ``uploads`` stores finished packs, so they upload while the next fills.
    ``device_buffers`` stream GPU tensors to the host (pinned, reused).
    ``bases`` holds recent commits' raw chunks, the bases of delta coding.
    ``staging`` is this store's own directory for packs being filled.
    ``packs`` stores and reads packs on the ``locations``; manifests and refs
    are replicated to every location.
    """

    catalog: Catalog
    cache: IndexCache
    locations: LocationSet
    packs: PackStore
    staging: ScratchDir
    config: Settings
    pool: ThreadPoolExecutor
    uploads: ThreadPoolExecutor
    device_buffers: StagingBuffers
    bases: BaseCache


def manifest_key(version_id: str) -> str:
    """The object key of a version's manifest."""
    return f"manifests/{version_id}"
