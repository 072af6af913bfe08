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

:meth:`Packs.open` builds them, in that order, over one catalog and one
:class:`CurrentLocations`; with this host's fast tier, the tier then wraps the reader
(:class:`~.tierreads.TierReads`: its packs are read from its disk, the rest from the
locations). :class:`Packs` is immutable and holds the pieces: callers name the one they use
(``packs.placement.redundancy_for``), and read through :attr:`Packs.reads`;
:meth:`Packs.on_locations` is a copy reading from the locations only. Objects are
deleted only through :meth:`LocationSet.delete`.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from casckpt.catalog import Catalog
from casckpt.engine.packlayer.packcoding import ErasureCoder
from casckpt.engine.packlayer.packlayouts import Layouts
from casckpt.engine.packlayer.packplacement import Placement
from casckpt.engine.packlayer.packread import PackReader
from casckpt.engine.packlayer.packrepair import PackRepairer
from casckpt.engine.packlayer.packverify import PackVerifier
from casckpt.engine.packlayer.packwrite import PackWriter
from casckpt.storage.locations import CurrentLocations

if TYPE_CHECKING:  # the fast tier's modules load only for a store that has one
    from casckpt.engine.tiering.tier import FastTier


class PackSource(Protocol):
    """Where reads of packs go: :class:`PackReader` (the locations) or a
    :class:`~.tierreads.TierReads` (this host's fast tier in front of one)."""

    @property
    def retry_s(self) -> float: ...

    def waiting_s(self) -> float | None: ...

    def read_into(self, pack_id: str, offset: int, buffers: Sequence[memoryview], *,
                  heal: bool = True) -> int: ...

    def get(self, pack_id: str) -> bytes: ...

    def can_reconstruct(self, pack_id: str) -> bool: ...

    def reconstruct(self, pack_id: str, *, heal: bool = True) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Packs:
    """Writes, reads, verifies and repairs packs on the store's current locations. Thread-safe;
    immutable (built by :meth:`open`).

    ``reads`` is where reads go: ``reader`` (the locations), or this host's fast tier
    (``tier``) wrapping it. Writes, verification and repair always address the locations;
    a commit holds its packs on ``tier`` itself (:class:`~casckpt.engine.write.packer.Packer`).
    """

    layouts: Layouts
    coder: ErasureCoder
    placement: Placement
    writer: PackWriter
    verifier: PackVerifier
    repairer: PackRepairer
    reader: PackReader
    reads: PackSource
    tier: FastTier | None = None

    @classmethod
    def open(cls, catalog: Catalog, locations: CurrentLocations, io: ThreadPoolExecutor, *,
             quorum: int | None = None, encode_workers: int = 0, retry_s: float = 30.0,
             tier: FastTier | None = None) -> Packs:
        """The pack layer of one store, over this host's fast tier ``tier`` if it has one.

        ``io`` runs shard writes and reads in parallel; it must not be a pool whose tasks
        call into this object (the engine's read pool may). New erasure-coded packs are
        encoded in up to ``encode_workers`` worker processes (0: in this process), started
        when the first is filled (:meth:`prepare`); :meth:`close` stops them. ``retry_s``:
        how long a read waits for unreachable locations (see :class:`PackReader`).
        """
        layouts = Layouts(catalog)
        coder = ErasureCoder(encode_workers)
        placement = Placement(catalog, locations, io, quorum)
        writer = PackWriter(locations, coder, placement)
        verifier = PackVerifier(catalog, locations, layouts, coder, io)
        repairer = PackRepairer(catalog, locations, layouts, coder, placement, verifier)
        reader = PackReader(catalog, locations, layouts, verifier, repairer, retry_s)
        reads: PackSource = reader
        if tier is not None:
            from casckpt.engine.packlayer.tierreads import TierReads

            reads = TierReads(tier, reader, layouts)
        return cls(layouts, coder, placement, writer, verifier, repairer, reader, reads, tier)

    def on_locations(self) -> Packs:
        """This pack layer reading from the locations only, never from this host's fast tier
        (the same parts: closing either closes both)."""
        return self if self.tier is None else replace(self, reads=self.reader, tier=None)

    def close(self) -> None:
        """Stop the erasure-coding worker processes; call once no pack is being written."""
        self.coder.close()
