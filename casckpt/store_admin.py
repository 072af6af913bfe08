"""Storage administration of a store: locations, redundancy, check, repair, rebuilds.

:class:`StoreAdmin` is the part of :class:`casckpt.store.Store` that administers where and
how data is stored; ``Store`` delegates to it and documents each method. It works on the
:class:`~casckpt.store_core.StoreCore` it is given (queries and commits live elsewhere).
The engines of check, repair and rebuilds are imported by the methods that run them, so
opening a store for a query (every CLI command) does not load them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from casckpt import config as cfg
from casckpt.catalog import deltas as deltas_sql
from casckpt.catalog import identity as identity_sql
from casckpt.catalog import inventory
from casckpt.catalog import shards as shard_sql
from casckpt.engine import identity, keyring, records
from casckpt.engine.deleterights import require_delete_rights
from casckpt.engine.validate import check_name, check_timeout
from casckpt.errors import CasckptError, InvalidArgumentError
from casckpt.format import keys
from casckpt.jsonable import jsonable
from casckpt.storage import open_blob_store, redact_url
from casckpt.storage.erasure import Redundancy
from casckpt.storage.locations import Location
from casckpt.storage.sealed import sealed
from casckpt.store_core import StoreCore
from casckpt.types import (
    CheckReport,
    KeyInfo,
    LocationInfo,
    MigrationReport,
    ProgressCallback,
    RebuildReport,
    RepairReport,
    StoreStats,
)

MAX_PROBE_TIMEOUT_S = 3600.0
"""The longest ``Store.locations(timeout=)`` waits: an hour already means the location is gone."""


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


class StoreAdmin:
    """Storage administration of one open store: see the module docstring.

    Every public method is the ``Store`` method of the same name (documented there);
    thread-safe as the store is.
    """

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    # -- redundancy -------------------------------------------------------------

    def redundancy(self, run: str | None = None) -> str:
        """The redundancy new packs get: the store's, or ``run``'s own if it has one."""
        return str(self._core.ctx.packs.redundancy_for(run))

    def set_redundancy(self, spec: str, *, run: str | None = None) -> str:
        """Set the redundancy of new packs: ``"none"``, ``"replicate:N"`` or ``"ec:K+M"``."""
        if run is not None:
            check_name(run, "run")
        if run is not None and spec == "inherit":
            shard_sql.set_run_redundancy(self._core.ctx.catalog, run, None)
            records.record_run(self._core.ctx.locations, self._core.ctx.catalog, run)
            return self.redundancy(run)
        scheme = Redundancy.parse(spec)
        self._core.ctx.packs.check_redundancy(scheme)
        if run is None:
            shard_sql.set_store_redundancy(self._core.ctx.catalog, str(scheme))
            records.record_store(self._core.ctx.locations, self._core.ctx.catalog)
        else:
            shard_sql.set_run_redundancy(self._core.ctx.catalog, run, str(scheme))
            records.record_run(self._core.ctx.locations, self._core.ctx.catalog, run)
        return str(scheme)

    # -- locations --------------------------------------------------------------

    def locations(self, *, timeout: float | None = None) -> list[LocationInfo]:
        """Every blob location with its failure domain, state, what it holds, and its health."""
        return self._location_infos(self._core.ctx.locations.all, timeout)

    def _location_infos(self, locations: Sequence[Location], timeout: float | None) -> list[LocationInfo]:
        timeout = self._core.ctx.config.probe_timeout_s if timeout is None else check_timeout(
            timeout, "a probe timeout", maximum=MAX_PROBE_TIMEOUT_S)
        usage = shard_sql.location_usage(self._core.ctx.catalog)
        # a recovering store's rebuild adopts the locations' identity
        mine = None if self._core.recovering else identity_sql.read(self._core.ctx.catalog)
        probes = self._core.prober.probe(locations, mine, timeout)
        out = []
        for loc, probe in zip(locations, probes, strict=True):
            shards, size, damaged = usage.get(loc.id, (0, 0, 0))
            out.append(LocationInfo(
                name=loc.name, url=redact_url(loc.blobs.url), domain=loc.domain, state=loc.state,
                shards=shards, bytes=size, damaged=damaged, reachable=probe.reachable,
                reason=probe.reason, probe_s=round(probe.seconds, 3)))
        return out

    def add_location(self, url: str, *, domain: str | None = None, name: str | None = None) -> LocationInfo:
        """Add a blob location (a directory, ``file:///``, ``s3://``); new packs may use it at once."""
        known = {loc.name for loc in self._core.ctx.locations.all}
        name = name or next(f"loc{i}" for i in range(len(known) + 1) if f"loc{i}" not in known)
        check_name(name, "location")
        base = self._core.config_file.parent if self._core.config_file is not None else Path.cwd()
        spec = cfg.BlobLocation(url, domain, name)
        absolute = cfg._resolved([spec], base)[0]  # noqa: SLF001 - one URL rule for files and args
        try:
            blob_store = sealed(open_blob_store(absolute.url, self._core.s3), self._core.ctx.crypto)
            for _ in blob_store.list(keys.PACKS):  # reachable and listable
                break
        except (CasckptError, OSError) as exc:
            raise InvalidArgumentError(f"cannot use {redact_url(url)} as a blob location: {exc}") from exc
        try:  # another store's location, or one holding data this catalog knows nothing of
            to_write = identity.check_at_open(self._core.ctx.catalog, [identity.survey(name, blob_store)],
                                              recover=False)
        except BaseException:
            blob_store.close()
            raise
        row = shard_sql.add_location(self._core.ctx.catalog, name, absolute.url, absolute.domain or name)
        identity.write_records(self._core.ctx.catalog, to_write)
        keyring.publish(self._core.ctx.catalog, {name: blob_store})
        if self._core.config_file is not None:
            cfg.add_location_to_file(self._core.config_file, spec)
        self._core.reload_locations({absolute.url: blob_store})
        records.record_locations(self._core.ctx.locations, self._core.ctx.catalog)
        added = next(loc for loc in self._core.ctx.locations.all if loc.name == row.name)
        from casckpt.engine import repair as repair_engine  # engines load when used: see the module doc

        repair_engine.copy_recovery_data(self._core.ctx, added)  # a full disaster-recovery copy at once
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

    # -- master keys (an encrypted store) ----------------------------------

    def keys(self) -> list[KeyInfo]:
        """See :meth:`casckpt.Store.keys`."""
        ctx = self._core.ctx
        return [KeyInfo(s.id, s.created_at, s.created_by, s.id == ctx.crypto.opened_with)
                for s in keyring.key_slots(ctx.catalog)]

    def add_key(self, key_file: str | os.PathLike[str]) -> KeyInfo:
        """See :meth:`casckpt.Store.add_key`."""
        ctx = self._core.ctx
        self._core.refuse_while_recovering("add a key")
        self._core.refuse_write("add a key", "the catalog and the locations (the key record)")
        slot = keyring.add_key(ctx.catalog, ctx.locations, ctx.crypto, keyring.read_key_file(key_file))
        return KeyInfo(slot.id, slot.created_at, slot.created_by, False)

    def remove_key(self, key_id: str) -> None:
        """See :meth:`casckpt.Store.remove_key`."""
        ctx = self._core.ctx
        self._core.refuse_while_recovering("remove a key")
        self._core.refuse_write("remove a key", "the catalog and the locations (the key record)")
        keyring.remove_key(ctx.catalog, ctx.locations, key_id)

    def rotate_key(self, new_key_file: str | os.PathLike[str], old: str | None = None) -> KeyInfo:
        """See :meth:`casckpt.Store.rotate_key`."""
        ctx = self._core.ctx
        self._core.refuse_while_recovering("rotate a key")
        self._core.refuse_write("rotate a key", "the catalog and the locations (the key record)")
        replaced = old or ctx.crypto.opened_with
        if replaced is None:
            keyring.key_slots(ctx.catalog)  # raises NotEncryptedError
            raise InvalidArgumentError("name the key to replace (old=KEY_ID)")
        slot = keyring.rotate_key(ctx.catalog, ctx.locations, ctx.crypto, replaced,
                                  keyring.read_key_file(new_key_file))
        return KeyInfo(slot.id, slot.created_at, slot.created_by, False)

    def _set_location_state(self, name: str, state: str) -> LocationInfo:
        shard_sql.set_location_state(self._core.ctx.catalog, name, state)
        self._core.reload_locations({})
        records.record_locations(self._core.ctx.locations, self._core.ctx.catalog)
        return self._location_info(name)

    def _location_info(self, name: str) -> LocationInfo:
        found = [loc for loc in self._core.ctx.locations.all if loc.name == name]
        return self._location_infos(found, None)[0]

    # -- integrity --------------------------------------------------------------

    def check(self, *, read_data: bool = False, read_data_subset: float | str | None = None,
              progress: ProgressCallback | None = None) -> CheckReport:
        """Check the catalog against the blob locations."""
        subset = parse_fraction(read_data_subset) if read_data_subset is not None else None
        from casckpt.engine import check as check_engine

        return check_engine.check(self._core.ctx, read_data=read_data, progress=progress,
                                  read_data_subset=subset)

    def repair(self, *, progress: ProgressCallback | None = None) -> RepairReport:
        """Rebuild lost or corrupt shards and move shards off draining or failed locations."""
        self._core.refuse_while_recovering("repair")
        require_delete_rights(self._core.ctx, "repair", objects=False)  # the admin role's catalog rights
        from casckpt.engine import repair as repair_engine

        report = repair_engine.repair(self._core.ctx, progress)
        self._core.ctx.catalog.record_audit("repair", None, _counts(report))
        return report

    def stats(self) -> StoreStats:
        """Space accounting: logical vs unique vs stored bytes, and what delta coding saved."""
        deltas = deltas_sql.delta_totals(self._core.ctx.catalog)
        return StoreStats(
            **inventory.totals(self._core.ctx.catalog), redundancy=self.redundancy(),
            delta_chunks=deltas.chunks,
            delta_raw_bytes=deltas.raw_bytes, delta_stored_bytes=deltas.stored_bytes,
            longest_chain=deltas.longest_chain, mean_chain=deltas.mean_chain,
            delta_chain=deltas_sql.store_delta_chain(self._core.ctx.catalog),
            run_delta_chains=deltas_sql.run_delta_chains(self._core.ctx.catalog))

    def delta_chain(self, run: str | None = None) -> int:
        """Deltas deep a chunk may be stored before a keyframe (0: no delta coding): the
        store's, or what commits to ``run`` use (its own, else the store's)."""
        if run is None:
            return deltas_sql.store_delta_chain(self._core.ctx.catalog)
        return deltas_sql.delta_chain_for(self._core.ctx.catalog, check_name(run, "run"))

    def set_delta_chain(self, chain: int, *, run: str | None = None) -> None:
        """Set how many deltas deep a chunk may be stored before a keyframe (0: no delta coding),
        for the whole store or (``run``) one run; ``run`` with ``chain=-1`` follows the store again."""
        if (isinstance(chain, bool) or not isinstance(chain, int) or not -1 <= chain <= 64
                or (chain == -1 and run is None)):
            raise InvalidArgumentError(
                "delta chain length must be 0 (off) to 64, or -1 to make a run follow the store; "
                f"got {chain!r}")
        if run is None:
            deltas_sql.set_store_delta_chain(self._core.ctx.catalog, chain)
            records.record_store(self._core.ctx.locations, self._core.ctx.catalog)
        else:
            own = None if chain < 0 else chain
            deltas_sql.set_run_delta_chain(self._core.ctx.catalog, check_name(run, "run"), own)
            records.record_run(self._core.ctx.locations, self._core.ctx.catalog, run)

    def rebuild_catalog(self, *, progress: ProgressCallback | None = None) -> RebuildReport:
        """Recreate an empty catalog from the blob locations alone (see
        :mod:`casckpt.engine.rebuild`)."""
        from casckpt.engine import rebuild as rebuild_engine

        report = rebuild_engine.rebuild(self._core.ctx, progress)
        self._core.ctx.catalog.record_audit("catalog.rebuild", None, _counts(report))
        self._core.recovering = False
        self._core.reload_locations({})  # the states the locations record restored
        return report

    def migrate_trees(self, *, progress: ProgressCallback | None = None) -> MigrationReport:
        """Give every version of manifest format 1 (written before tree manifests) its tree, so
        queries read it as a tree and its ``tensors`` rows go (see
        :mod:`casckpt.engine.treemigrate`). Version ids and restores do not change."""
        require_delete_rights(self._core.ctx, "migrate-trees", objects=False)  # deletes tensors rows
        from casckpt.engine import treemigrate as treemigrate_engine  # the commit engine: torch

        report = treemigrate_engine.migrate(self._core.ctx, progress)
        if report.versions_migrated or report.nodes_written or report.tensor_rows_deleted:
            self._core.ctx.catalog.record_audit("trees.migrate", None, _counts(report))
        return report

    def rebuild_cache(self) -> int:
        """Drop and refill this host's index cache from the catalog; returns the chunks cached."""
        from casckpt.engine import rebuild as rebuild_engine

        return rebuild_engine.refill_cache(self._core.ctx)


def _counts(report: object) -> dict[str, object]:
    """A report as an audit row's detail: its numbers, and how many items each list holds
    (the pack ids and reasons themselves stay in the report and the log)."""
    return {k: len(v) if isinstance(v, (list, tuple)) else v
            for k, v in jsonable(report).items()}
