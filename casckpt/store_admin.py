"""The redundancy side of the Store facade: locations, redundancy, repair, rebuilds.

Mixed into :class:`casckpt.store.Store`; kept apart so each module stays
one responsibility (queries and commits there, storage administration here).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from casckpt import config as cfg
from casckpt.catalog import deltas as deltas_sql
from casckpt.catalog import identity as identity_sql
from casckpt.catalog import shards as shard_sql
from casckpt.engine import check as check_engine
from casckpt.engine import identity, records
from casckpt.engine import rebuild as rebuild_engine
from casckpt.engine import repair as repair_engine
from casckpt.engine import treemigrate as treemigrate_engine
from casckpt.engine.context import EngineContext
from casckpt.engine.probe import LocationProber
from casckpt.engine.validate import check_name
from casckpt.errors import CasckptError, InvalidArgumentError, StoreIdentityError
from casckpt.format import keys
from casckpt.storage import BlobStore, open_blob_store, redact_url
from casckpt.storage.erasure import Redundancy
from casckpt.storage.locations import Location, LocationSet
from casckpt.storage.unreachable import UnreachableBlobStore
from casckpt.types import (
    CheckReport,
    LocationInfo,
    MigrationReport,
    ProgressCallback,
    RebuildReport,
    RepairReport,
    StoreStats,
)

log = logging.getLogger(__name__)

LOCATION_REFRESH_S = 30.0  # how stale this process's view of location states may get


def parse_fraction(value: float | str) -> float:
    """``0.05``, ``"5%"`` or ``"0.05"`` -> 0.05.

    Raises:
        InvalidArgumentError: not a fraction in (0, 1].
    """
    text = str(value).strip()
    try:
        fraction = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise InvalidArgumentError(f"{value!r} is not a share of the store: use e.g. 5% or 0.05") from None
    if not 0 < fraction <= 1:
        raise InvalidArgumentError(f"{value!r} must be more than 0% and at most 100%")
    return fraction


def open_location_store(name: str, url: str, s3: Any, given: dict[str, BlobStore], *,
                        create: bool = True, failed: bool = False) -> BlobStore:
    """Open one location's blob store; one this host cannot open is kept as unreachable.

    ``create=False`` for a location the catalog knows already: its directory, gone, is
    then unreachable rather than made again, empty (see :class:`~casckpt.storage.LocalBlobStore`).
    A location marked failed that cannot be opened is what was expected: no warning.
    """
    blob_store = given.get(url)
    if blob_store is None:
        try:
            blob_store = open_blob_store(url, s3, create=create)
        except (CasckptError, OSError) as exc:
            if not failed:
                log.warning("blob location %s (%s) cannot be opened: %s", name, redact_url(url), exc)
            blob_store = UnreachableBlobStore(url, str(exc))
    return blob_store


def open_location(row: shard_sql.LocationRow, url: str, s3: Any, given: dict[str, BlobStore]) -> Location:
    """Open one catalog location (see :func:`open_location_store`)."""
    return Location(row.id, row.name, row.domain, row.state,
                    open_location_store(row.name, url, s3, given, create=False,
                                        failed=row.state == "failed"))


class StoreAdmin:
    """Storage administration: see the module docstring."""

    _ctx: EngineContext
    _s3: Any
    _config_file: Path | None
    _locations_loaded: float
    _recovering: bool
    _prober: LocationProber

    def _refuse_while_recovering(self, what: str) -> None:
        """A store opened with ``recover=True`` over data its empty catalog lacks does nothing
        but rebuild the catalog until it has."""
        if self._recovering:
            raise StoreIdentityError(
                f"cannot {what}: this store was opened with recover=True and its catalog is empty "
                "while its locations hold data; run store.rebuild_catalog() (`casckpt catalog "
                "rebuild`) first")

    # -- redundancy -------------------------------------------------------------

    def redundancy(self, run: str | None = None) -> str:
        """The redundancy new packs get: the store's, or ``run``'s own if it has one."""
        return str(self._ctx.packs.redundancy_for(run))

    def set_redundancy(self, spec: str, *, run: str | None = None) -> str:
        """Set the redundancy of new packs: ``"none"``, ``"replicate:N"`` or ``"ec:K+M"``.

        For the whole store, or for one run (``run=``; ``spec=None`` is not
        accepted here: use ``"inherit"`` to make a run follow the store again).
        Packs already stored keep their scheme.

        Raises:
            InvalidArgumentError: a bad spec, or more shards than active failure domains.
        """
        if run is not None:
            check_name(run, "run")
        if run is not None and spec == "inherit":
            shard_sql.set_run_redundancy(self._ctx.catalog, run, None)
            records.record_run(self._ctx.locations, self._ctx.catalog, run)
            return self.redundancy(run)
        scheme = Redundancy.parse(spec)
        self._ctx.packs.check_redundancy(scheme)
        if run is None:
            shard_sql.set_store_redundancy(self._ctx.catalog, str(scheme))
            records.record_store(self._ctx.locations, self._ctx.catalog)
        else:
            shard_sql.set_run_redundancy(self._ctx.catalog, run, str(scheme))
            records.record_run(self._ctx.locations, self._ctx.catalog, run)
        return str(scheme)

    # -- locations --------------------------------------------------------------

    def locations(self, *, timeout: float | None = None) -> list[LocationInfo]:
        """Every blob location with its failure domain, state, what it holds, and its health.

        Health is measured: each location (failed ones too, to tell whether one came
        back) is sent a real request -- a read of its identity record -- all at once,
        and ``reachable`` says whether it answered with this store's record within
        ``timeout`` seconds (default: the ``probe_timeout_s`` setting, 5 s), with
        ``reason`` why not and ``probe_s`` how long it took. The call returns after at
        most about ``timeout`` seconds, however many locations are silent.

        Raises:
            InvalidArgumentError: ``timeout`` is negative.
        """
        return self._location_infos(self._ctx.locations.all, timeout)

    def _location_infos(self, locations: Sequence[Location], timeout: float | None) -> list[LocationInfo]:
        timeout = self._ctx.config.probe_timeout_s if timeout is None else timeout
        if not timeout >= 0:
            raise InvalidArgumentError(f"a probe timeout is 0 or more seconds, not {timeout!r}")
        usage = shard_sql.location_usage(self._ctx.catalog)
        mine = None if self._recovering else identity_sql.read(self._ctx.catalog)  # rebuild adopts theirs
        probes = self._prober.probe(locations, mine, timeout)
        out = []
        for loc, probe in zip(locations, probes, strict=True):
            shards, size, damaged = usage.get(loc.id, (0, 0, 0))
            out.append(LocationInfo(
                name=loc.name, url=redact_url(loc.blobs.url), domain=loc.domain, state=loc.state,
                shards=shards, bytes=size, damaged=damaged, reachable=probe.reachable,
                reason=probe.reason, probe_s=round(probe.seconds, 3)))
        return out

    def add_location(self, url: str, *, domain: str | None = None, name: str | None = None) -> LocationInfo:
        """Add a blob location (a directory, ``file:///``, ``s3://``); new packs may use it at once.

        Recorded in the catalog (every host sees it) and in this store's
        config file. It receives a copy of every manifest and ``refs/``
        record at once (what a catalog rebuild needs). Existing packs stay
        where they are; ``repair`` uses the new location for shards it has
        to re-place.

        Raises:
            InvalidArgumentError: the name or URL is taken, or the location cannot be opened.
            StoreIdentityError: the location holds another store's data (or data this
                catalog knows nothing of); nothing was changed.
        """
        known = {loc.name for loc in self._ctx.locations.all}
        name = name or next(f"loc{i}" for i in range(len(known) + 1) if f"loc{i}" not in known)
        check_name(name, "location")
        base = self._config_file.parent if self._config_file is not None else Path.cwd()
        spec = cfg.BlobLocation(url, domain, name)
        absolute = cfg._resolved([spec], base)[0]  # noqa: SLF001 - one URL rule for files and args
        try:
            blob_store = open_blob_store(absolute.url, self._s3)
            for _ in blob_store.list(keys.PACKS):  # reachable and listable
                break
        except (CasckptError, OSError) as exc:
            raise InvalidArgumentError(f"cannot use {redact_url(url)} as a blob location: {exc}") from exc
        try:  # another store's location, or one holding data this catalog knows nothing of
            to_write = identity.check_at_open(self._ctx.catalog, [identity.survey(name, blob_store)],
                                              recover=False)
        except BaseException:
            blob_store.close()
            raise
        row = shard_sql.add_location(self._ctx.catalog, name, absolute.url, absolute.domain or name)
        identity.write_records(self._ctx.catalog, to_write)
        if self._config_file is not None:
            cfg.add_location_to_file(self._config_file, spec)
        self._reload_locations({absolute.url: blob_store})
        records.record_locations(self._ctx.locations, self._ctx.catalog)
        added = next(loc for loc in self._ctx.locations.all if loc.name == row.name)
        repair_engine.copy_recovery_data(self._ctx, added)  # a full disaster-recovery copy at once
        return self._location_info(row.name)

    def drain_location(self, name: str) -> LocationInfo:
        """Stop writing to a location; ``repair`` then moves its shards to others (``gc``
        deletes the old objects after its grace period)."""
        return self._set_location_state(name, "draining")

    def fail_location(self, name: str) -> LocationInfo:
        """Declare a location lost: it is never read again; ``repair`` re-creates its shards elsewhere."""
        return self._set_location_state(name, "failed")

    def activate_location(self, name: str) -> LocationInfo:
        """Return a drained or failed location to service (its shards count again once verified)."""
        return self._set_location_state(name, "active")

    def _set_location_state(self, name: str, state: str) -> LocationInfo:
        shard_sql.set_location_state(self._ctx.catalog, name, state)
        self._reload_locations({})
        records.record_locations(self._ctx.locations, self._ctx.catalog)
        return self._location_info(name)

    def _refresh_locations(self) -> None:
        """Pick up location changes other processes made (add, drain, fail) every so often."""
        if time.monotonic() - self._locations_loaded >= LOCATION_REFRESH_S:
            self._reload_locations({})

    def _location_info(self, name: str) -> LocationInfo:
        found = [loc for loc in self._ctx.locations.all if loc.name == name]
        return self._location_infos(found, None)[0]

    def _reload_locations(self, opened: dict[str, BlobStore]) -> None:
        """Re-read locations from the catalog, keeping the blob stores already open."""
        current = {loc.id: loc.blobs for loc in self._ctx.current_locations.get().all}
        fresh = []
        for row in shard_sql.locations(self._ctx.catalog):
            if row.id in current:
                fresh.append(Location(row.id, row.name, row.domain, row.state, current[row.id]))
            else:
                fresh.append(open_location(row, row.url or "", self._s3, opened))
        self._ctx.current_locations.swap(LocationSet(fresh))  # running operations keep the set they took
        self._locations_loaded = time.monotonic()

    # -- integrity --------------------------------------------------------------

    def check(self, *, read_data: bool = False, read_data_subset: float | str | None = None,
              progress: ProgressCallback | None = None) -> CheckReport:
        """Check the catalog against the blob locations.

        Args:
            read_data: read every pack in full: verify each shard and every chunk.
            read_data_subset: scrub only this share of the stored bytes (``"5%"``,
                ``0.05``), least recently verified packs first; a cron job running
                ``check --read-data-subset 5%`` daily verifies everything every 20 days.

        Damaged shards found are queued for :meth:`repair`. Data is never modified.
        """
        subset = parse_fraction(read_data_subset) if read_data_subset is not None else None
        return check_engine.check(self._ctx, read_data=read_data, progress=progress,
                                  read_data_subset=subset)

    def repair(self, *, progress: ProgressCallback | None = None) -> RepairReport:
        """Rebuild lost or corrupt shards and move shards off draining or failed locations.

        Safe while other processes commit, restore and collect garbage.
        """
        self._refuse_while_recovering("repair")
        return repair_engine.repair(self._ctx, progress)

    def stats(self) -> StoreStats:
        """Space accounting: logical vs unique vs stored bytes, and what delta coding saved."""
        deltas = deltas_sql.delta_totals(self._ctx.catalog)
        return StoreStats(
            **self._ctx.catalog.totals(), redundancy=self.redundancy(), delta_chunks=deltas.chunks,
            delta_raw_bytes=deltas.raw_bytes, delta_stored_bytes=deltas.stored_bytes,
            longest_chain=deltas.longest_chain, mean_chain=deltas.mean_chain,
            delta_chain=deltas_sql.store_delta_chain(self._ctx.catalog),
            run_delta_chains=deltas_sql.run_delta_chains(self._ctx.catalog))

    def delta_chain(self, run: str | None = None) -> int:
        """Deltas deep a chunk may be stored before a keyframe (0: no delta coding): the
        store's, or what commits to ``run`` use (its own, else the store's)."""
        if run is None:
            return deltas_sql.store_delta_chain(self._ctx.catalog)
        return deltas_sql.delta_chain_for(self._ctx.catalog, check_name(run, "run"))

    def set_delta_chain(self, chain: int, *, run: str | None = None) -> None:
        """Set how many deltas deep a chunk may be stored before a keyframe (0: no delta coding),
        for the whole store or (``run``) one run; ``run`` with ``chain=-1`` follows the store again.

        Longer chains store less (a chunk that changes a little each commit costs only its
        delta) but restoring the end of a chain decodes every delta down from its keyframe.

        Raises:
            InvalidArgumentError: ``chain`` is out of range.
        """
        if not -1 <= chain <= 64 or (chain == -1 and run is None):
            raise InvalidArgumentError(
                "delta chain length must be 0 (off) to 64, or -1 to make a run follow the store; "
                f"got {chain}")
        if run is None:
            deltas_sql.set_store_delta_chain(self._ctx.catalog, chain)
            records.record_store(self._ctx.locations, self._ctx.catalog)
        else:
            own = None if chain < 0 else chain
            deltas_sql.set_run_delta_chain(self._ctx.catalog, check_name(run, "run"), own)
            records.record_run(self._ctx.locations, self._ctx.catalog, run)

    def rebuild_catalog(self, *, progress: ProgressCallback | None = None) -> RebuildReport:
        """Recreate an empty catalog from the blob locations alone (see :mod:`casckpt.engine.rebuild`).

        Raises:
            InvalidArgumentError: the catalog is not empty.
        """
        report = rebuild_engine.rebuild(self._ctx, progress)
        self._recovering = False
        self._reload_locations({})  # the states the locations record restored
        return report

    def migrate_trees(self, *, progress: ProgressCallback | None = None) -> MigrationReport:
        """Give every version of manifest format 1 (written before tree manifests) its tree, so
        queries read it as a tree and its ``tensors`` rows go (see
        :mod:`casckpt.engine.treemigrate`). Version ids and restores do not change.

        Resumable and idempotent (run it again after an interruption; a second run does
        nothing); safe while other processes commit, restore and run gc. ``open`` never runs
        it: on a large store it takes a while.

        Raises:
            CatalogError: nodes kept disappearing under a gc with grace 0; run it again.
            StorageError: nodes could not be written (the batches done so far stay done).
        """
        return treemigrate_engine.migrate(self._ctx, progress)

    def rebuild_cache(self) -> int:
        """Drop and refill this host's index cache from the catalog; returns the chunks cached."""
        return rebuild_engine.refill_cache(self._ctx)
