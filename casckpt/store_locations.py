"""``store.locations``: where a store's packs live, and how many copies each gets.

:class:`Locations` is the namespace of :class:`casckpt.Store` for blob locations (list, add,
retire, fail, activate) and redundancy (the store's or a run's). It works on the
:class:`~casckpt.store_core.StoreCore` it is given; thread-safe as the store is. Repair
moves shards off retiring and failed locations: ``store.ops.repair()``.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from pathlib import Path

from casckpt import config as cfg
from casckpt.catalog import identity as identity_sql
from casckpt.catalog import shards as shard_sql
from casckpt.catalog.settings import REDUNDANCY
from casckpt.engine.locations import identity
from casckpt.engine.maintenance import keyring
from casckpt.engine.versions import records
from casckpt.engine.versions.validate import check_name, check_timeout
from casckpt.errors import CasckptError, InvalidArgumentError
from casckpt.format import objectnames
from casckpt.storage import open_blob_store, redact_url
from casckpt.storage.erasure import Redundancy
from casckpt.storage.locations import Location
from casckpt.storage.sealed import sealed
from casckpt.store_core import StoreCore
from casckpt.types import LocationInfo

MAX_PROBE_TIMEOUT_S = 3600.0
"""The longest ``store.locations.list(timeout=)`` waits: an hour already means the location is gone."""


class Locations:
    """The blob locations of one open store and the redundancy of new packs (``store.locations``)."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    def list(self, *, timeout: float | None = None) -> list[LocationInfo]:
        """Every blob location with its failure domain, state, what it holds, and its health.

        Health is measured: each location (failed ones too, to tell whether one came
        back) is sent a real request -- a read of its identity record -- all at once,
        and ``reachable`` says whether it answered with this store's record within
        ``timeout`` seconds (default: the ``probe_timeout_s`` setting, 5 s), with
        ``reason`` why not and ``probe_s`` how long it took. The call returns after at
        most about ``timeout`` seconds, however many locations are silent.

        Raises:
            InvalidArgumentError: ``timeout`` is not a number of seconds from 0 to an hour.
        """
        return self._infos(self._core.locations.all, timeout)

    def add(self, url: str, *, domain: str | None = None, name: str | None = None) -> LocationInfo:
        """Add a blob location (a directory, ``file:///``, ``s3://``, ``az://``), usable at once.

        Recorded in the catalog (every host sees it) and in this store's
        config file. It receives a copy of every manifest and ``refs/``
        record at once (what a catalog rebuild needs). Existing packs stay
        where they are; ``store.ops.repair()`` uses the new location for shards it has
        to re-place.

        Raises:
            InvalidArgumentError: the name or URL is taken, or the location cannot be opened.
            StoreIdentityError: the location holds another store's data (or data this
                catalog knows nothing of); nothing was changed.
        """
        core = self._core
        core.refuse_write("store.locations.add", "the catalog and the locations")
        known = {loc.name for loc in core.locations.all}
        name = name or next(f"loc{i}" for i in range(len(known) + 1) if f"loc{i}" not in known)
        check_name(name, "location")
        base = core.config_file.parent if core.config_file is not None else Path.cwd()
        spec = cfg.BlobLocation(url, domain, name)
        absolute = cfg._resolved([spec], base)[0]  # noqa: SLF001 - one URL rule for files and args
        try:
            blob_store = sealed(open_blob_store(absolute.url, core.backends), core.crypto)
            for _ in blob_store.list(objectnames.PACKS):  # reachable and listable
                break
        except (CasckptError, OSError) as exc:
            raise InvalidArgumentError(f"cannot use {redact_url(url)} as a blob location: {exc}") from exc
        try:  # another store's location, or one holding data this catalog knows nothing of
            to_write = identity.check_at_open(core.catalog, [identity.survey(name, blob_store)],
                                              recover=False)
        except BaseException:
            blob_store.close()
            raise
        row = shard_sql.add_location(core.catalog, name, absolute.url, absolute.domain or name)
        identity.write_records(core.catalog, to_write)
        keyring.publish(core.catalog, {name: blob_store})
        if core.config_file is not None:
            cfg.add_location_to_file(core.config_file, spec)
        core.reload_locations({absolute.url: blob_store})
        records.record_locations(core.locations, core.catalog)
        added = next(loc for loc in core.locations.all if loc.name == row.name)
        # loaded when used: opening stays light
        from casckpt.engine.maintenance import repair as repair_engine

        repair_engine.copy_recovery_data(core.ctx, added)  # a full disaster-recovery copy at once
        return self._info(row.name)

    def retire(self, name: str) -> LocationInfo:
        """Stop writing to location ``name``; ``store.ops.repair()`` then moves its shards to
        others (``gc`` deletes the old objects after its grace period)."""
        return self._set_state(name, "retiring", "retire", "the catalog and the locations")

    def fail(self, name: str) -> LocationInfo:
        """Declare location ``name`` lost: it is never read again; ``store.ops.repair()``
        re-creates its shards elsewhere."""
        return self._set_state(name, "failed", "fail", "the catalog")

    def activate(self, name: str) -> LocationInfo:
        """Return a retiring or failed location to service (its shards count again once verified)."""
        return self._set_state(name, "active", "activate", "the catalog")

    def redundancy(self, run: str | None = None) -> str:
        """The redundancy new packs get: the store's, or ``run``'s own if it has one."""
        return str(self._core.ctx.packs.placement.redundancy_for(run))

    def set_redundancy(self, spec: str, *, run: str | None = None) -> str:
        """Set the redundancy of new packs: ``"none"``, ``"replicate:N"`` or ``"ec:K+M"``.

        For the whole store, or for one run (``run=``; ``spec=None`` is not
        accepted here: use ``"inherit"`` to make a run follow the store again).
        Packs already stored keep their scheme. Returns the scheme now in force.

        Raises:
            InvalidArgumentError: a bad spec, or more shards than active failure domains.
        """
        core = self._core
        core.refuse_write("store.locations.set_redundancy", "the catalog and the locations")
        if run is not None:
            check_name(run, "run")
        if run is not None and spec == "inherit":
            REDUNDANCY.set_run(core.catalog, run, None)
            records.record_run(core.locations, core.catalog, run)
            return self.redundancy(run)
        scheme = Redundancy.parse(spec)
        core.ctx.packs.placement.check_redundancy(scheme)
        if run is None:
            REDUNDANCY.set_store(core.catalog, str(scheme))
            records.record_store(core.locations, core.catalog)
        else:
            REDUNDANCY.set_run(core.catalog, run, str(scheme))
            records.record_run(core.locations, core.catalog, run)
        return str(scheme)

    def _set_state(self, name: str, state: str, verb: str, needs: str) -> LocationInfo:
        self._core.refuse_write(f"store.locations.{verb}", needs)
        shard_sql.set_location_state(self._core.catalog, name, state)
        self._core.reload_locations({})
        records.record_locations(self._core.locations, self._core.catalog)
        return self._info(name)

    def _info(self, name: str) -> LocationInfo:
        found = [loc for loc in self._core.locations.all if loc.name == name]
        return self._infos(found, None)[0]

    def _infos(self, locations: Sequence[Location], timeout: float | None) -> builtins.list[LocationInfo]:
        core = self._core
        timeout = core.config.probe_timeout_s if timeout is None else check_timeout(
            timeout, "a probe timeout", maximum=MAX_PROBE_TIMEOUT_S)
        usage = shard_sql.location_usage(core.catalog)
        # a recovering store's rebuild adopts the locations' identity
        mine = None if core.recovering else identity_sql.read(core.catalog)
        probes = core.prober.probe(locations, mine, timeout)
        out = []
        for loc, probe in zip(locations, probes, strict=True):
            shards, size, damaged = usage.get(loc.id, (0, 0, 0))
            out.append(LocationInfo(
                name=loc.name, url=redact_url(loc.blobs.url), domain=loc.domain, state=loc.state,
                shards=shards, bytes=size, damaged=damaged, reachable=probe.reachable,
                reason=probe.reason, probe_s=round(probe.seconds, 3)))
        return out
