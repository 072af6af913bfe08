"""A thin view of one store's internals, for tests and tools. Unstable.

Tests (and tools such as the benchmarks) need to see what a store did below
its public API: the catalog rows a commit wrote, the locations a pack landed
on, the bytes a background commit copied. Reaching into ``Store``'s private
attributes for that makes every refactor of the engine touch dozens of
tests; this module is the one place that knows where those parts live.

The view holds only the store and looks each part up when asked, so it
always sees the store's current components (a location set swapped after
``add_location``, say). Nothing here is part of casckpt's stable API: names
and types follow the engine and change with it, without deprecation.

It needs neither pytest nor any test extra::

    from casckpt.testing.internals import internals

    with internals(store).catalog.read() as conn:
        ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from casckpt.cache import IndexCache
from casckpt.catalog import Catalog
from casckpt.engine.context import EngineContext
from casckpt.engine.memory.staging import StagingBuffers
from casckpt.engine.packlayer.packs import Packs
from casckpt.format.manifest import Manifest
from casckpt.storage.locations import LocationSet
from casckpt.storage.scratch import ScratchDir
from casckpt.store import Store
from casckpt.store_core import StoreCore
from casckpt.types import Version

if TYPE_CHECKING:
    from casckpt.dcp import StoreWriter


@dataclass(frozen=True, slots=True)
class CommitterStats:
    """What a store's background committer holds, at the moment it was asked.

    Attributes:
        staged: bytes pending commits hold (their staging sets, and copies of new chunks
            of states over the budget), not yet written (0 once every commit finished).
        peak_staged: the most the budget has held (``staged`` plus staging kept for
            reuse) since the store opened.
        memory: the bound on ``staged`` plus ``kept`` (``commit_memory``).
        max_pending: the bound on commits in flight (``max_pending_commits``).
        kept: bytes of host staging sets, held by a pending commit or kept for reuse.
        copied: bytes copied into host staging since the store opened.
    """

    staged: int
    peak_staged: int
    memory: int
    max_pending: int
    kept: int = 0
    copied: int = 0


class StoreInternals:
    """Read access to the components of one open store (see the module docstring).

    Every property is looked up on the store when read, never cached. Not
    thread-safe beyond what each component promises itself.
    """

    __slots__ = ("_store",)

    def __init__(self, store: Store) -> None:
        self._store = store

    @property
    def context(self) -> EngineContext:
        """The engine context, for calling engine functions directly (``write_shards``, ``read_ranges``)."""
        return self._store._core.ctx

    @property
    def core(self) -> StoreCore:
        """The state the store's parts share (context, committer, DCP writers, lifecycle)."""
        return self._store._core

    @property
    def closed(self) -> bool:
        """Whether the store has been closed."""
        return self._store._core.closed

    @property
    def dcp_writers(self) -> list[StoreWriter]:
        """The DCP writers of this store still alive."""
        return list(self._store._core.dcp_writers)

    def manifest(self, ref: str | Version) -> Manifest:
        """The whole manifest of the version ``ref`` names."""
        return self._store._core.manifest(ref)

    @property
    def catalog(self) -> Catalog:
        return self._store._core.catalog

    @property
    def locations(self) -> LocationSet:
        return self._store._core.locations

    @property
    def packs(self) -> Packs:
        return self.context.packs

    @property
    def cache(self) -> IndexCache:
        return self._store._core.cache

    @property
    def staging(self) -> ScratchDir:
        return self.context.staging

    @property
    def device_buffers(self) -> StagingBuffers:
        return self.context.device_buffers

    @property
    def committer(self) -> CommitterStats:
        """A snapshot of the background committer's byte and commit accounting."""
        committer = self._store._core.committer
        return CommitterStats(staged=committer.staged, peak_staged=committer.peak_staged,
                              memory=committer.memory, max_pending=committer.max_pending,
                              kept=committer.kept, copied=committer.copied)

    # -- test-only changes --------------------------------------------------------

    def replace_locations(self, locations: LocationSet) -> None:
        """Swap the store's location set (to wrap its blob stores in fault injectors)."""
        self._store._core.current_locations.swap(locations)


def internals(store: Store) -> StoreInternals:
    """The internals of ``store``, for tests and tools (unstable; see the module docstring)."""
    return StoreInternals(store)
