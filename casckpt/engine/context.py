"""What the engine works with: the catalog, the index cache, the blob store and its knobs."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from casckpt.errors import refuse_forked

if TYPE_CHECKING:  # the engine's parts load with the engine (StoreCore builds it on first use)
    from concurrent.futures import ThreadPoolExecutor

    from casckpt.cache import IndexCache
    from casckpt.catalog import Catalog
    from casckpt.config import Settings
    from casckpt.engine.memory.deltabase import BaseCache
    from casckpt.engine.memory.staging import StagingBuffers
    from casckpt.engine.packlayer.packs import Packs
    from casckpt.format.crypto import StoreCrypto
    from casckpt.storage.locations import CurrentLocations, LocationSet
    from casckpt.storage.scratch import ScratchDir


class StoreView(Protocol):
    """What an engine call that only reads the catalog and surveys the locations needs: an
    :class:`EngineContext`, or the open store's :class:`~casckpt.store_core.StoreCore`,
    which answers without building the engine (no pools, pack layer or caches)."""

    @property
    def catalog(self) -> Catalog: ...

    @property
    def locations(self) -> LocationSet: ...

    @property
    def crypto(self) -> StoreCrypto: ...


@dataclass(frozen=True, slots=True)
class EngineContext:
    """The components one store's engine operations share. Owned by ``Store``. Immutable:
    what changes while the store is open (its locations) sits behind a holder.

    ``pool`` runs CPU work and reads (hashing, encoding, ranged reads);
    ``uploads`` stores finished packs, so they upload while the next fills.
    ``device_buffers`` stream GPU tensors to the host (pinned, reused).
    ``bases`` holds recent commits' raw chunks, the bases of delta coding.
    ``staging`` is this store's own directory for packs being filled.
    ``packs`` writes and reads packs on the locations; manifests and refs
    are replicated to every location. ``current_locations`` holds the store's
    locations; ``locations`` is the set in force now (see :class:`CurrentLocations`:
    an operation that needs one consistent set reads it once and keeps it).
    """

    catalog: Catalog
    cache: IndexCache
    current_locations: CurrentLocations
    packs: Packs
    staging: ScratchDir
    config: Settings
    pool: ThreadPoolExecutor
    uploads: ThreadPoolExecutor
    device_buffers: StagingBuffers
    bases: BaseCache
    memos: Memos = field(default_factory=lambda: Memos())
    owner: int = field(default_factory=os.getpid)  # the process its pools and connections belong to

    def refuse_forked(self) -> None:
        """Refuse a forked child's use of this engine (see :func:`casckpt.errors.refuse_forked`).

        Raises:
            ForkedStoreError: this process is a fork of the one that built it.
        """
        refuse_forked(self.owner)

    @property
    def crypto(self) -> StoreCrypto:
        """The store's encryption (keyed chunk ids; :data:`~casckpt.format.crypto.PLAIN` when
        the store is not encrypted): the catalog's, set once when the store is opened."""
        return self.catalog.crypto

    @property
    def locations(self) -> LocationSet:
        """The store's locations now (a snapshot; a later swap does not change it)."""
        return self.current_locations.get()


class Memos:
    """What each run's last commit in this process derived from its state (pack groups,
    tree nodes), for the run's next commit to reuse where its state did not change. Each
    memo is keyed by content, so a stale one costs misses, never a wrong version."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, Any] = {}

    def take(self, run: str) -> Any:
        """The run's memo (None: none yet, or another commit of the run holds it)."""
        with self._lock:
            return self._runs.pop(run, None)

    def keep(self, run: str, memo: Any) -> None:
        with self._lock:
            self._runs[run] = memo
