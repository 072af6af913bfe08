"""The pack layer: packs on the store's locations, composed of small pieces.

Every pack is stored as shards (see ``storage/erasure.py`` for the schemes):
one copy (``none``), N copies (``replicate``) or K+M erasure-coded shards
(``ec``), on distinct failure domains, each recorded in the catalog.

The pieces, each usable on its own:

- :class:`~.packlayouts.Layouts`: where each pack's shards are (cached) and their health.
- :class:`~.packcoding.ErasureCoder`: a pack to shard objects and back (codes cached).
- :class:`~.packplacement.Placement`: the redundancy policy and which location gets which shard.
- :class:`~.packwrite.PackWriter`: a new pack written to quorum.
- :class:`~.packread.PackReader`: ranged, striped and whole reads; reconstruction.
- :class:`~.packverify.PackVerifier`: every shard read in full and checked.
- :class:`~.packrepair.PackRepairer`: heal (write shards again) and repair.

:class:`Packs` builds them over one catalog and one :class:`CurrentLocations`
and forwards the calls the rest of the engine makes. Objects are deleted only
through :meth:`LocationSet.delete`.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from casckpt.catalog import Catalog, PackLayout
from casckpt.engine.packcoding import ErasureCoder
from casckpt.engine.packlayouts import Layouts
from casckpt.engine.packplacement import Placement
from casckpt.engine.packread import PackReader
from casckpt.engine.packrepair import PackRepairer, RepairOutcome
from casckpt.engine.packverify import PackVerifier, ShardCheck
from casckpt.engine.packwrite import PackWriter
from casckpt.errors import BlobNotFoundError, CorruptPackError
from casckpt.format.chunks import object_id
from casckpt.storage.erasure import Redundancy
from casckpt.storage.locations import CurrentLocations

if TYPE_CHECKING:
    from casckpt.engine.tier import FastTier


class Packs:
    """Writes, reads, verifies and repairs packs on the store's current locations. Thread-safe.

    ``io`` runs shard writes and reads in parallel; it must not be a pool
    whose tasks call into this object (the engine's read pool may). New
    erasure-coded packs are encoded in up to ``encode_workers`` worker
    processes (0: in this process), started when the first is filled
    (:meth:`prepare`); :meth:`close` stops them. ``retry_s``: how long a read waits for
    unreachable locations (see :class:`PackReader`).
    """

    def __init__(self, catalog: Catalog, locations: CurrentLocations, io: ThreadPoolExecutor,
                 quorum: int | None = None, encode_workers: int = 0, retry_s: float = 30.0) -> None:
        self.layouts = Layouts(catalog)
        self.coder = ErasureCoder(encode_workers)
        self.placement = Placement(catalog, locations, io, quorum)
        self.writer = PackWriter(locations, self.coder, self.placement)
        self.verifier = PackVerifier(catalog, locations, self.layouts, self.coder, io)
        self.repairer = PackRepairer(catalog, locations, self.layouts, self.coder, self.placement,
                                     self.verifier)
        self.reader = PackReader(catalog, locations, self.layouts, self.verifier, self.repairer, retry_s)
        self.tier: FastTier | None = None  # this host's fast tier (engine/tier.py), set at open
        self._catalog = catalog

    def prepare(self, redundancy: Redundancy) -> None:
        """See :meth:`ErasureCoder.prepare`."""
        self.coder.prepare(redundancy)

    def close(self) -> None:
        """Stop the erasure-coding worker processes; call once no pack is being written."""
        self.coder.close()

    # -- policy (see Placement) --------------------------------------------------

    def check_redundancy(self, redundancy: Redundancy) -> None:
        """See :meth:`Placement.check_redundancy`."""
        self.placement.check_redundancy(redundancy)

    def redundancy_for(self, run: str | None) -> Redundancy:
        """See :meth:`Placement.redundancy_for`."""
        return self.placement.redundancy_for(run)

    def check_writable(self, redundancy: Redundancy) -> None:
        """See :meth:`Placement.check_writable`."""
        self.placement.check_writable(redundancy)

    def quorum(self, redundancy: Redundancy) -> int:
        """See :meth:`Placement.quorum`."""
        return self.placement.quorum(redundancy)

    # -- layouts (see Layouts) ---------------------------------------------------

    def layout(self, pack_id: str, *, fresh: bool = False) -> PackLayout | None:
        """See :meth:`Layouts.get`."""
        return self.layouts.get(pack_id, fresh=fresh)

    def forget(self, pack_id: str) -> None:
        """See :meth:`Layouts.forget`."""
        self.layouts.forget(pack_id)

    # -- writing, reading, verifying, repairing -------------------------------------

    def write(self, pack_id: str, path: Path, size: int, redundancy: Redundancy) -> PackLayout:
        """See :meth:`PackWriter.write`."""
        return self.writer.write(pack_id, path, size, redundancy)

    def write_bytes(self, pack_id: str, data: bytes, redundancy: Redundancy) -> PackLayout:
        """See :meth:`PackWriter.write_bytes`."""
        return self.writer.write_bytes(pack_id, data, redundancy)

    def read_into(self, pack_id: str, offset: int, buffers: Sequence[memoryview], *,
                  heal: bool = True) -> int:
        """See :meth:`PackReader.read_into`; from this host's fast tier when it holds the pack.

        Raises:
            VersionNotDurableError, VersionLostError: the pack is on another host's fast tier,
                or was lost with one, and not on the locations.
        """
        tier = self.tier
        if tier is not None and tier.dir.holds(pack_id):
            try:
                return tier.dir.read_into(pack_id, offset, buffers)
            except BlobNotFoundError:
                pass  # evicted meanwhile: it had drained
        self._on_locations(pack_id)
        return self.reader.read_into(pack_id, offset, buffers, heal=heal)

    def _on_locations(self, pack_id: str) -> None:
        """Raise unless the pack is (as far as the catalog says now) on the locations."""
        layout = self.layouts.get(pack_id)
        if layout is None or layout.tier is None:
            return
        layout = self.layouts.get(pack_id, fresh=True)  # drained since it was cached?
        if layout is None or layout.tier is None:
            return
        from casckpt.catalog.tiers import pack_states
        from casckpt.engine.tier import not_durable_error

        state = pack_states(self._catalog, [pack_id]).get(pack_id, ("fast", layout.tier))
        raise not_durable_error(self._catalog, pack_id, layout.tier, state[0])

    def get(self, pack_id: str) -> bytes:
        """See :meth:`PackReader.get`; from this host's fast tier when it holds the pack intact."""
        tier = self.tier
        if tier is not None and tier.dir.holds(pack_id):
            try:
                data = tier.dir.get(pack_id)
                if object_id(data) == pack_id:
                    return data
            except BlobNotFoundError:
                pass
        self._on_locations(pack_id)
        return self.reader.get(pack_id)

    def can_reconstruct(self, pack_id: str) -> bool:
        """See :meth:`PackReader.can_reconstruct`. A drained pack the fast tier served can
        always be read again from the locations; a pack not drained cannot."""
        tier = self.tier
        if tier is not None and tier.dir.holds(pack_id):
            layout = self.layouts.get(pack_id, fresh=True)
            return layout is not None and layout.tier is None
        return self.reader.can_reconstruct(pack_id)

    def waiting_s(self) -> float | None:
        """See :meth:`PackReader.waiting_s`."""
        return self.reader.waiting_s()

    @property
    def retry_s(self) -> float:
        """See :attr:`PackReader.retry_s`."""
        return self.reader.retry_s

    def reconstruct(self, pack_id: str, *, heal: bool = True) -> bytes:
        """See :meth:`PackReader.reconstruct`. A damaged fast-tier copy of a drained pack is
        evicted and the pack read from the locations instead.

        Raises:
            CorruptPackError: the damaged copy is of a pack not drained yet (the only one).
        """
        tier = self.tier
        if tier is not None and tier.dir.holds(pack_id):
            layout = self.layouts.get(pack_id, fresh=True)
            if layout is not None and layout.tier is not None:
                raise CorruptPackError(
                    f"pack {pack_id} on the fast tier {tier.dir.root} is damaged and has not "
                    "drained yet: it is the only copy. Restore another version")
            tier.dir.evict(pack_id)
            return self.reader.get(pack_id)
        return self.reader.reconstruct(pack_id, heal=heal)

    def examine(self, pack_id: str, *, read_all: bool = True) -> ShardCheck:
        """See :meth:`PackVerifier.examine`."""
        return self.verifier.examine(pack_id, read_all=read_all)

    def read_detached(self, layout: PackLayout) -> tuple[bytes | None, dict[int, str]]:
        """See :meth:`PackVerifier.read_detached`."""
        return self.verifier.read_detached(layout)

    def repair(self, pack_id: str) -> RepairOutcome:
        """See :meth:`PackRepairer.repair`."""
        return self.repairer.repair(pack_id)
