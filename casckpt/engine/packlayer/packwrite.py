"""Writing a new pack: encode it, place its shards, and hold it to the write quorum."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from casckpt.catalog import PackLayout, ShardRow
from casckpt.engine.packlayer.packcoding import ErasureCoder, ShardPayload
from casckpt.engine.packlayer.packplacement import Placement
from casckpt.errors import StorageError, StorageFullError
from casckpt.format import objectnames
from casckpt.storage.base import BlobStore
from casckpt.storage.erasure import Redundancy
from casckpt.storage.locations import CurrentLocations, LocationSet, refused

log = logging.getLogger(__name__)


class PackWriter:
    """Makes finished pack files durable on the locations. Thread-safe."""

    def __init__(self, locations: CurrentLocations, coder: ErasureCoder, placement: Placement) -> None:
        self._locations = locations
        self._coder = coder
        self._placement = placement

    def write(self, pack_id: str, path: Path, size: int, redundancy: Redundancy) -> PackLayout:
        """Make the finished pack file ``path`` durable at quorum; returns its layout (the
        catalog is not touched: the caller records the layout).

        One snapshot of the locations serves the whole write (placement, quorum, clean-up),
        whatever changes meanwhile. ``path`` may be consumed.

        Raises:
            StorageFullError: every location that refused a shard was full.
            StorageError: fewer than the quorum of shards could be written (nothing is
                recorded; the shards that were written are deleted, or left as orphans
                for GC where that fails).
            EncodeWorkerError: the erasure-coding worker died (nothing was written).
        """
        locations = self._locations.get()
        if redundancy.kind == "none":
            return self._one_copy(pack_id, size, locations, lambda blobs, key: blobs.put_file(key, path))
        self._placement.check_writable(redundancy, locations)
        layout, payloads = self._coder.encode_file(pack_id, path, size, redundancy)
        try:
            return self._place(layout, payloads, redundancy, locations)
        finally:
            for payload in payloads.values():  # staging shard files the locations did not consume
                if isinstance(payload.data, Path):
                    payload.data.unlink(missing_ok=True)

    def write_bytes(self, pack_id: str, data: bytes, redundancy: Redundancy) -> PackLayout:
        """Like :meth:`write`, of the pack's bytes in memory (a drain's, read from the fast
        tier: it leaves the tier's file where it is and needs no room beside it)."""
        locations = self._locations.get()
        if redundancy.kind == "none":
            return self._one_copy(pack_id, len(data), locations, lambda blobs, key: blobs.put(key, data))
        self._placement.check_writable(redundancy, locations)
        layout, payloads = self._coder.encode(pack_id, data, redundancy)
        return self._place(layout, payloads, redundancy, locations)

    def _one_copy(self, pack_id: str, size: int, locations: LocationSet,
                  put: Callable[[BlobStore, str], None]) -> PackLayout:
        """Store a pack of redundancy ``none`` on the first location of its placement that takes it."""
        key = objectnames.pack_name(pack_id)
        targets = locations.placement(pack_id)
        if not targets:
            raise StorageError("no active blob location to store packs on; see `casckpt location list`")
        failures: list[StorageError] = []
        for loc in targets:
            try:
                put(loc.blobs, key)
                return PackLayout(pack_id, key, size, shards=(ShardRow(0, loc.id, key, size),))
            except StorageError as exc:
                log.warning("pack %s: location %s refused it: %s", pack_id, loc.describe(), exc)
                failures.append(exc)
        raise refused(f"pack {pack_id}", failures)

    def _place(self, layout: PackLayout, payloads: dict[int, ShardPayload], redundancy: Redundancy,
               locations: LocationSet) -> PackLayout:
        """Write the payloads and hold them to the write quorum (see :meth:`write`)."""
        pack_id = layout.id
        failures: list[StorageError] = []
        written = self._placement.place(layout, payloads, locations.placement(pack_id), failures)
        healthy = self._placement.durable(written, locations)
        quorum = self._placement.quorum(redundancy)
        if healthy < quorum:
            locations.delete([(sh.location_id, sh.key) for sh in written if sh.state == "ok"])
            message = (f"pack {pack_id} is durable on only {healthy} of {redundancy.shards} shards "
                       f"(shards sharing a failure domain count once); the write quorum is {quorum}")
            if failures and all(isinstance(f, StorageFullError) for f in failures):
                raise refused(f"shards of pack {pack_id}", failures)
            raise StorageError(f"{message}. Check the locations (`casckpt location list`)")
        return replace(layout, shards=tuple(written))

    def close(self) -> None:
        """Stop the coder's worker processes (see :meth:`ErasureCoder.close`)."""
        self._coder.close()
